/* STAND-IN for the CUDA driver (libcuda.so.1), for the CPU-only build of the REAL FlagCX in
 * tests/flagcx_real.py: a machine without a GPU has no driver. Every entry point FlagCX
 * references answers CUDA_ERROR_NO_DEVICE (100); nothing else is replaced. */
#define NO_DEVICE 100
#define STUB(name) int name() { return NO_DEVICE; }
STUB(cuDeviceGet) STUB(cuDeviceGetAttribute) STUB(cuDriverGetVersion) STUB(cuMemAddressFree)
STUB(cuMemAddressReserve) STUB(cuMemCreate) STUB(cuMemExportToShareableHandle)
STUB(cuMemGetAddressRange_v2) STUB(cuMemGetAllocationGranularity)
STUB(cuMemGetHandleForAddressRange) STUB(cuMemImportFromShareableHandle) STUB(cuMemMap)
STUB(cuMemRelease) STUB(cuMemRetainAllocationHandle) STUB(cuMemSetAccess) STUB(cuMemUnmap)
STUB(cuMulticastAddDevice) STUB(cuMulticastBindMem) STUB(cuMulticastCreate)
STUB(cuMulticastGetGranularity) STUB(cuStreamWaitValue64_v2) STUB(cuStreamWriteValue64_v2)
STUB(cuInit) STUB(cuGetProcAddress) STUB(cuGetProcAddress_v2)

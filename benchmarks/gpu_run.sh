#!/usr/bin/env bash
# The GPU work of issues 35 and 36 in one command, on the device machine with
# ../shared/gpu-vllm's bundle unpacked to /tmp/site (its README: the staging calls).
# Each step fits one 600 s device call; run them as `bash benchmarks/gpu_run.sh STEP OUT`:
#   digest  the digest kernel against torch (tests/test_gpu_digest.py) and B2d's CUDA rows
#   hybrid  B5 on the real-width Qwen3.6 hybrid (CUDA graphs), PD vs monolithic + sweep
#   dense   B5 on the real-width Llama-3-8B-class dense model
#   suite   the GPU suite (PD == monolithic, negative controls) in CUDA graph mode
set -euo pipefail
step=${1:?step: digest, hybrid, dense or suite}
out=${2:?output directory}
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
case $step in
  digest)
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu_digest.py 2>&1 | tail -5
    python3 -m benchmarks --only b2d --out "$out/b2d" ;;
  hybrid) VLLM_FLAGCX_B5_MODEL=hybrid-wide python3 -m benchmarks --only b5 --out "$out/b5-hybrid" ;;
  dense) VLLM_FLAGCX_B5_MODEL=dense-wide python3 -m benchmarks --only b5 --out "$out/b5-dense" ;;
  suite)
    VLLM_FLAGCX_GPU_CASES=sliding-bf16-flash_attn,hybrid-bf16-flash_attn \
      VLLM_FLAGCX_GPU_REPORT="$out/gpu_suite.json" \
      python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tail -20 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac

"""What goes wrong on decode's receive: the real failures, until vLLM is told, and the
test-only faults the negative controls inject.

**The failure ledger** (``FailureLedger``): the first failure of a request is the one
reported, counted per stage, and ``drain`` hands vLLM the failed requests and their
blocks once.

**Test faults**, the negative controls of the PD == monolithic checks (a check that cannot
fail is a defect). Off unless the decode instance sets
``kv_connector_extra_config.test_faults: true``; a request then asks for one with
``kv_transfer_params.flagcx_test_fault``:

- ``corrupt_block``: after a pull that succeeded (integrity check included), overwrite
  the request's first block in every region of its first KV cache group (host memory, or
  GPU memory through the CUDA driver).
- ``drop_all``: skip the pull and report it done: decode runs on whatever its blocks held.

Either must make decode's greedy output differ from the monolithic one (or fail the
request); the e2e tests assert that, per model.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

from vllm_flagcx.connector.common.counters import delta
from vllm_flagcx.connector.common.metadata import RequestId

logger = logging.getLogger("vllm_flagcx")

# Where a decode-side receive can fail. (Registration fails at startup, loudly; a failed
# prefill-side write reaches decode as a failed pull reply; both are counted in stats.)
STAGES = ("handshake", "recv")


class FailureLedger:
    """Failed requests with their blocks, by stage; drained once per engine step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: dict[RequestId, tuple[str, str, list[int]]] = {}
        self.counts: dict[str, int] = defaultdict(int)
        self.recent: deque[tuple[float, str, str, str]] = deque(maxlen=256)  # for operators
        self._last_counts: dict[str, int] = {}

    def record(self, stage: str, request_id: RequestId, block_ids: list[int], error: str) -> None:
        assert stage in STAGES, stage
        with self._lock:
            if request_id in self._failed:
                return  # the first failure is the one reported
            self._failed[request_id] = (stage, error, list(block_ids))
            self.counts[stage] += 1
            self.recent.append((time.monotonic(), stage, request_id, error))
        logger.warning("FlagCX %s failure for request %s: %s", stage, request_id, error)

    def take_counts(self) -> dict[str, float]:
        """Failures by stage since the previous call (for stats)."""
        with self._lock:
            changed = delta(self.counts, self._last_counts)
            self._last_counts = dict(self.counts)
        return changed

    def drain(self) -> tuple[set[RequestId], set[int]]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return set(failed), {b for _, _, ids in failed.values() for b in ids}


PARAM = "flagcx_test_fault"
FAULTS = ("corrupt_block", "drop_all")
GARBAGE_BYTE = 0x3C  # bf16 0x3C3C ~ 0.0115, fp32 ~ 0.0115: finite, and wrong


class FaultKnobError(ValueError):
    """A fault asked for that is unknown, or asked where faults are off."""


def requested_fault(fault: str, enabled: bool) -> str:
    """The fault a request asks for (its ``kv_transfer_params[PARAM]``; "" for none);
    refuses one asked where faults are off, or one that is not named in ``FAULTS``."""
    if not fault:
        return ""
    if not enabled:
        raise FaultKnobError(f"kv_transfer_params.{PARAM} is set but this decode instance "
                             "does not allow test faults (kv_connector_extra_config."
                             "test_faults=true, tests only)")
    if fault not in FAULTS:
        raise FaultKnobError(f"kv_transfer_params.{PARAM}={fault!r}: use one of {FAULTS}")
    return str(fault)


def _fill_host(address: int, byte: int, size: int) -> None:
    ctypes.memset(address, byte, size)


def memory_filler(host_memory: bool) -> Callable[[int, int, int], None]:
    """``fill(address, byte, size)`` for the KV caches' memory: memset on the host, the CUDA
    driver's memset on a GPU. Refuses by name where GPU caches have no driver."""
    if host_memory:
        return _fill_host
    from vllm_flagcx.transport.cuda_ipc import driver

    cuda = driver()
    if cuda is None:
        raise FaultKnobError("corrupt_block: the KV caches are device memory and no CUDA "
                             "driver (libcuda.so.1) loads here")
    return cuda.fill


def corrupt_first_block(regions: Sequence[Any], block_ids: Sequence[Sequence[int]],
                        fill: Callable[[int, int, int], None]) -> int:
    """Overwrite block ``block_ids[0][0]`` in every region of group 0 with ``fill``
    (``memory_filler``); bytes written."""
    if not block_ids or not block_ids[0]:
        return 0
    block = block_ids[0][0]
    written = 0
    for region in regions:
        if region.group != 0 or not 0 <= block < region.num_blocks:
            continue
        fill(region.base + block * region.block_stride, GARBAGE_BYTE, region.block_bytes)
        written += region.block_bytes
    return written

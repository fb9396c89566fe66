"""A failed receive re-enters vLLM through vLLM's own failure path, per build.

What must happen (vLLM 0.34's ``_handle_failed_recving`` does exactly this): the request's
``num_computed_tokens`` goes to 0 and its id joins the scheduler's
``failed_recving_kv_req_ids``; when the request is promoted, vLLM's
``_update_waiting_for_remote_kv`` then FREES its blocks instead of caching them, and the
next schedule allocates a clean block table (local prefix hits included) and recomputes.

What must not happen: ``num_computed_tokens = 0`` alone. The request then takes the
SUCCESS branch over the blocks allocated for the load, and for a sliding-window group
those already had their out-of-window entries replaced by the shared null block
(``remove_skipped_blocks`` runs inside ``allocate_slots``): the prompt was recomputed
over null blocks (wrong text, HTTP 200), then vLLM's ``can_fit_full_sequence`` assertion
killed the engine (measured on 0.20.2 and 0.22.0).

How, per build:
- ``native``: ``KVConnectorOutput.failed_recving`` exists (0.34+); vLLM handles it.
- ``scheduler_failed_set``: 0.18-0.22 have the scheduler's set and the freeing branch but
  no request-level report for a connector. The connector holds a weak reference to the
  ``Scheduler`` that constructed it (found on the call stack of its ``__init__``: vLLM
  gives a connector no handle on its scheduler) and does what 0.34 does, from
  ``update_connector_output``, which vLLM calls before it reads ``finished_recving``.
- absent: neither; the connector refuses a decode role where a recompute over allocated
  blocks would be wrong (sliding-window groups).

A second gap, 0.13 only: a decode request that FINISHES while its load is in flight
(aborted, or failed by ``kv_load_failure_policy=fail``) keeps its blocks until no write can
land (the connector's ``request_finished`` answers True); 0.20+ free them when
``finished_recving`` names the request, 0.13 only records the id, so the blocks never came
back (measured: every such request leaked its blocks). ``free_finished_load`` does what
0.20+ do, through the same scheduler reference.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import resolve
from vllm_flagcx.compat.vllm_types import VllmRequest

NATIVE = "native"
SCHEDULER_FAILED_SET = "scheduler_failed_set"


def find_owning_scheduler(max_depth: int = 24) -> Any | None:
    """The vLLM scheduler whose construction is running the caller (a frame walk up to
    ``max_depth`` frames; None when none is found, e.g. a connector built by hand)."""
    try:
        from vllm.v1.core.sched.interface import SchedulerInterface
    except ImportError:
        return None
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, SchedulerInterface):
            return candidate
        frame = frame.f_back
    return None


def _frees_failed_loads(scheduler_cls: Any) -> bool:
    """Does this scheduler free the blocks of a request in ``failed_recving_kv_req_ids``?
    The capability is read from vLLM's own Scheduler; a subclass that overrides the method
    is not trusted to do the same."""
    method = "_update_waiting_for_remote_kv"
    return (capabilities().failed_load_blocks == "freed"
            and getattr(scheduler_cls, method, None) is getattr(resolve("Scheduler"), method))


def recovery_mode(scheduler_cls: Any | None) -> str | None:
    """``native``, ``scheduler_failed_set`` or None (see the module docstring);
    ``scheduler_cls`` None: no scheduler was found to hand failures to."""
    if capabilities().hybrid_load_failure_report == "failed_recving":
        return NATIVE
    if scheduler_cls is not None and _frees_failed_loads(scheduler_cls):
        return SCHEDULER_FAILED_SET
    return None


def recovery_probe() -> str:
    """The mode this build offers to its own ``Scheduler`` ("absent" for none)."""
    return recovery_mode(resolve("Scheduler")) or "absent"


class LoadFailureRecovery:
    """Sends a failed receive down vLLM's own failure path (see the module docstring)."""

    def __init__(self, scheduler: Any | None) -> None:
        self.mode = recovery_mode(type(scheduler) if scheduler is not None else None)
        self._scheduler = weakref.ref(scheduler) if scheduler is not None else None

    def recompute(self, request: VllmRequest) -> bool:
        """Mark ``request`` (still waiting for its KV) to recompute from a clean block
        table; False when this build or state offers no such path (nothing changed)."""
        if self.mode != SCHEDULER_FAILED_SET or self._scheduler is None:
            return False
        scheduler = self._scheduler()
        failed = getattr(scheduler, "failed_recving_kv_req_ids", None)
        if failed is None or getattr(request.status, "name", "") != "WAITING_FOR_REMOTE_KVS":
            return False  # finished or aborted meanwhile: finished_recving frees it
        request.num_computed_tokens = 0
        failed.add(request.request_id)
        return True

    def free_finished(self, request_id: str) -> bool:
        """``free_finished_load`` on the scheduler that built the connector."""
        scheduler = self._scheduler() if self._scheduler is not None else None
        return free_finished_load(scheduler, request_id)

    def forget(self, request_ids: set[str]) -> None:
        scheduler = self._scheduler() if self._scheduler is not None else None
        if scheduler is not None and request_ids:
            forget_stale_loads(scheduler, request_ids)


def free_finished_load(scheduler: Any, request_id: str) -> bool:
    """Free the blocks of ``request_id``, finished while its load was in flight, where the
    build does not (``capabilities().finished_load_blocks`` absent): vLLM's own
    ``_free_blocks``, as 0.20+ call it for ``finished_recving``. True when freed here."""
    if scheduler is None or capabilities().finished_load_blocks == "freed":
        return False
    request = getattr(scheduler, "requests", {}).get(request_id)
    if request is None or not request.is_finished():
        return False
    scheduler._free_blocks(request)
    # 0.13 then records the id in finished_recving_kv_req_ids, which nothing reads for a
    # freed request: dropped on the next call (``forget_stale_loads``).
    return True


def forget_stale_loads(scheduler: Any, request_ids: set[str]) -> None:
    """Drop ids of requests freed by ``free_finished_load`` from the scheduler's
    ``finished_recving_kv_req_ids`` (0.13 adds them after the connector ran)."""
    recorded = getattr(scheduler, "finished_recving_kv_req_ids", None)
    if recorded is not None:
        recorded -= request_ids

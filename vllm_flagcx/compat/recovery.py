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

How, per build (what each write is, and why there):

=========  ==============================================  ===========================
build      failed load: recompute from a clean table       finished during its load
=========  ==============================================  ===========================
0.30+      ``KVConnectorOutput.failed_recving`` (vLLM's)   vLLM frees it
0.18-0.28  scheduler's ``failed_recving_kv_req_ids``,      vLLM frees it
           request's ``num_computed_tokens = 0``
0.13       as 0.18-0.28                                    ``finished_sending``
=========  ==============================================  ===========================

0.13-0.28 give a connector no request-level report and no handle on its scheduler. The
scheduler hands itself over when it is one of ``compat.schedulers`` (``--scheduler-cls``);
otherwise a failed load recomputes over the blocks allocated for it
(``num_computed_tokens = 0``), which is right unless the model has sliding-window groups:
there a decode without the handed-over scheduler is refused at start, naming the flag.

0.13 only: a decode request that FINISHES while its load is in flight (aborted, or failed
by ``kv_load_failure_policy=fail``) keeps its blocks until no write can land (the
connector's ``request_finished`` answers True); 0.20+ free them when ``finished_recving``
names the request, 0.13 only records the id (measured: every such request leaked its
blocks). vLLM calls ``update_connector_output`` before it reads the output, so the
connector moves the id to ``finished_sending``, which 0.13 frees with its own
``_free_blocks`` (``report_as_sent``).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import resolve
from vllm_flagcx.compat.vllm_types import VllmRequest

NATIVE = "native"
SCHEDULER_FAILED_SET = "scheduler_failed_set"

# what a decode engine passes vLLM so that its scheduler hands itself over (either mode)
SCHEDULER_FLAG = "--scheduler-cls vllm_flagcx.compat.schedulers.FlagCXScheduler"
_HANDED_OVER: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "flagcx_scheduler_under_construction", default=None)


@contextlib.contextmanager
def handing_over(scheduler: object) -> Iterator[None]:
    """While ``scheduler`` constructs itself (and so its connector), the connector finds it
    through ``handed_over_scheduler`` (``compat.schedulers`` wraps its ``__init__``)."""
    token = _HANDED_OVER.set(scheduler)
    try:
        yield
    finally:
        _HANDED_OVER.reset(token)


def handed_over_scheduler() -> object | None:
    """The scheduler constructing the caller, when it handed itself over; else None."""
    return _HANDED_OVER.get()


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

    def __init__(self, scheduler: object | None) -> None:
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



def report_as_sent(output: Any, request_ids: set[str]) -> None:
    """Where vLLM does not free the blocks of a finished request that ``finished_recving``
    names (0.13), move ``request_ids`` (finished while their load was in flight, no write
    can land now) to the connector's ``finished_sending``, whose ids vLLM frees with its
    own ``_free_blocks`` (see the module docstring)."""
    if request_ids and capabilities().finished_load_blocks != "freed":
        output.finished_recving = set(output.finished_recving or ()) - request_ids
        output.finished_sending = set(output.finished_sending or ()) | request_ids

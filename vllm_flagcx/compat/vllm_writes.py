"""Every write the connector makes into vLLM's objects, per build, and why.

- ``truncate_for_prefill`` (Request: prompt and token ids, counts, ``max_tokens``, block
  hashes), all builds: prefill of a Mamba/GDN model for an unseeded decode runs N-1 tokens,
  because decode recomputes the last one to derive the state after it (``wire.params``).
- ``drop_unusable_params`` (Request: ``kv_transfer_params``), all builds: a value that is
  not an object (through ``vllm_xargs``) becomes None; 0.34's ``add_request`` calls
  ``.get`` on it. The user's own ``kv_transfer_params`` are never changed.
- ``LoadFailureRecovery`` (Scheduler: ``failed_recving_kv_req_ids``; Request:
  ``num_computed_tokens``), 0.13-0.28: a failed load recomputes from token 0 over a clean
  block table, as 0.30+ do for ``KVConnectorOutput.failed_recving``: in the failed set,
  vLLM's ``_update_waiting_for_remote_kv`` FREES the blocks and the next schedule
  allocates anew. ``num_computed_tokens = 0`` alone recomputes over the blocks allocated
  for the load, wrong for a sliding-window group, whose out-of-window entries are already
  the null block (wrong text with HTTP 200, then vLLM's ``can_fit_full_sequence``
  assertion killed the engine: measured on 0.20.2 and 0.22.0). vLLM gives a connector no
  handle on its scheduler; ``compat.schedulers.FlagCXScheduler`` (``--scheduler-cls``)
  hands itself over, and without it a sliding-window decode is refused at start.
- ``report_as_sent`` (the connector's own KVConnectorOutput), 0.13: a request finished
  while its load was in flight keeps its blocks until no write can land; 0.20+ free them
  when ``finished_recving`` names it, 0.13 only records the id (every such request leaked
  its blocks), so the id moves to ``finished_sending``, which 0.13 frees itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.probe import resolve
from vllm_flagcx.compat.vllm_types import VllmRequest
from vllm_flagcx.wire.params import seeds_first_token

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


def recovery_mode(scheduler_cls: Any | None) -> str | None:
    """``native`` (vLLM takes the report), ``scheduler_failed_set`` (a handed-over
    scheduler whose class frees a failed load's blocks as vLLM's own does; a subclass that
    overrides that method is not trusted) or None."""
    if capabilities().hybrid_load_failure_report == "failed_recving":
        return NATIVE
    method = "_update_waiting_for_remote_kv"
    if (scheduler_cls is not None and capabilities().failed_load_blocks == "freed"
            and getattr(scheduler_cls, method, None) is getattr(resolve("Scheduler"), method)):
        return SCHEDULER_FAILED_SET
    return None


def recovery_probe() -> str:
    """The mode this build offers a handed-over ``Scheduler`` ("absent" for none)."""
    return recovery_mode(resolve("Scheduler")) or "absent"


class LoadFailureRecovery:
    """Sends a failed receive down vLLM's own failure path (see the module docstring)."""

    def __init__(self, scheduler: object | None) -> None:
        self.mode = recovery_mode(type(scheduler) if scheduler is not None else None)
        self._scheduler = weakref.ref(scheduler) if scheduler is not None else None

    def recompute(self, request: VllmRequest, in_place: bool) -> None:
        """Make ``request``, whose load failed, recompute its prompt: through vLLM's own
        failure path where this build has one (nothing to do with ``native``: vLLM got
        the report), else over its allocated blocks when ``in_place`` (the model has no
        sliding-window group). A request finished or aborted meanwhile is left alone:
        ``finished_recving`` frees it."""
        if self.mode == NATIVE or getattr(request.status, "name", "") != "WAITING_FOR_REMOTE_KVS":
            return
        scheduler = self._scheduler() if self._scheduler is not None else None
        failed = getattr(scheduler, "failed_recving_kv_req_ids", None)
        if self.mode == SCHEDULER_FAILED_SET and failed is not None:
            failed.add(request.request_id)
        elif not in_place:
            return
        request.num_computed_tokens = 0


def report_as_sent(output: Any, request_ids: set[str]) -> None:
    """Where vLLM does not free the blocks of a finished request that ``finished_recving``
    names (0.13), move ``request_ids`` (finished while their load was in flight, no write
    can land now) to the connector's ``finished_sending``, whose ids vLLM frees with its
    own ``_free_blocks`` (see the module docstring)."""
    if request_ids and capabilities().finished_load_blocks != "freed":
        output.finished_recving = set(output.finished_recving or ()) - request_ids
        output.finished_sending = set(output.finished_sending or ()) | request_ids


def drop_unusable_params(request: VllmRequest) -> str | None:
    """Replace ``kv_transfer_params`` that are not an object by None (module docstring);
    returns why, or None when they are an object (or None) and were left alone."""
    params = request.kv_transfer_params
    if params is None or isinstance(params, Mapping):
        return None
    request.kv_transfer_params = None
    return f"kv_transfer_params must be an object, got {type(params).__name__}; ignored"


def truncate_for_prefill(request: Any, hash_block_size: int | None = None) -> bool:
    """Prefill side: drop the last prompt token. The caller cuts each request once (a
    preempted request comes back through the same hook); the user's ``kv_transfer_params``
    are only read.

    Returns True when this call truncated. Block hashes covering the dropped token are
    discarded too (``Request.truncate_block_hashes`` on 0.34, the same rule elsewhere), so
    a later prefix-cache lookup cannot match a block holding a token that was never run.
    """
    params = request.kv_transfer_params
    if params is None or request.num_prompt_tokens <= 1 or seeds_first_token(params):
        return False  # seeded: decode continues from prompt + [t1] (wire.params)
    if request.prompt_token_ids is not None:
        request.prompt_token_ids.pop()
    elif getattr(request, "prompt_embeds", None) is not None:
        request.prompt_embeds = request.prompt_embeds[:-1]
    else:
        return False
    request._all_token_ids.pop()
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    if hash_block_size:
        if capabilities().truncate_block_hashes == "native":
            request.truncate_block_hashes(hash_block_size)
        elif getattr(request, "block_hashes", None) is not None:
            del request.block_hashes[request.num_tokens // hash_block_size:]
    return True

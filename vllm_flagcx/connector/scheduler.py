"""Scheduler half of FlagCXConnector: which requests load, which send, when blocks free.

Decode side (``do_remote_prefill``): every prompt token not computed locally is loaded
asynchronously (N-1 with Mamba/GDN groups: decode recomputes the last token to derive the
state after it). The blocks allocated for them, per KV cache group, go to the workers.

Prefill side (``do_remote_decode``): a Mamba model's request is truncated by one token
(once, also under preemption) unless decode continues from prefill's first token
(``first_token_seeded``: decode gets prompt + [t1] and loads the whole prompt); when it
finishes, its blocks are held (``True`` from ``request_finished_all_groups``) until the
workers report the send done or the lease expired, and the returned
``kv_transfer_params`` carry what decode needs.

A decode request aborted before its KV arrived sends a release to prefill, so prefill frees
its blocks now instead of at lease expiry. Prefill's first lease is short
(``first_lease_seconds``): decode's heartbeat on the request's arrival extends it, so a
decode leg that never reached decode (an external router's failed leg) frees the blocks
soon, with no Release from anyone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_flagcx.compat import kv_cache as compat_kv
from vllm_flagcx.compat import vllm_writes
from vllm_flagcx.compat.kv_cache import SpecKind
from vllm_flagcx.compat.vllm_types import KVCacheConfigLike, VllmRequest
from vllm_flagcx.compat.vllm_writes import LoadFailureRecovery
from vllm_flagcx.connector.common.metadata import (
    FlagCXMetadataPayload,
    RecvTask,
    RequestId,
    SendTask,
    TransferId,
)
from vllm_flagcx.connector.common.settings import DEFAULTS
from vllm_flagcx.connector.decode.loads import LoadPhase, Loads
from vllm_flagcx.wire import params as wire_params
from vllm_flagcx.wire.client import HeartbeatSender
from vllm_flagcx.wire.params import (
    RemotePrefill,
    TransferParamsError,
    parse_remote_prefill,
    remote_prefill_params,
)

logger = logging.getLogger("vllm_flagcx")


@dataclass(frozen=True)
class SchedulerSettings:
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    tp_size: int
    lease_seconds: float = DEFAULTS.lease_seconds
    first_lease_seconds: float = DEFAULTS.initial_lease  # until decode's first word
    key: bytes | None = field(default=None, repr=False)  # side-channel MAC key (auth)


@dataclass
class RequestParams:
    """What this half read from one request's ``kv_transfer_params``, once, from its first
    hook to ``request_finished``: the params themselves (only read; ``{}`` when absent or
    not an object), decode's prefill to load from (None: none, refused, or the load was
    planned: never twice), why the params were refused (told in the response), and
    whether prefill cut the prompt to N-1 (Mamba, once: preemption comes back)."""

    params: Mapping[str, Any]
    remote: RemotePrefill | None = None
    refused: str | None = None
    truncated: bool = False


class HeldSends:
    """Prefill's held transfers: the requests whose KV it holds for a decode, one request
    per transfer id (a second request under a held id would let decode pull the first
    one's KV), from ``request_finished`` until vLLM reports the send finished. The
    worker's side of the same transfers is ``prefill.sends.Sends``."""

    def __init__(self) -> None:
        self._tasks: dict[RequestId, SendTask] = {}
        self._transfer_ids: set[TransferId] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def holds(self, transfer_id: TransferId) -> bool:
        return transfer_id in self._transfer_ids

    def hold(self, task: SendTask) -> None:
        self._tasks[task.request_id] = task
        self._transfer_ids.add(task.transfer_id)

    def sent(self, request_id: RequestId) -> None:
        """vLLM reported the send finished (pulled, released or expired)."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            self._transfer_ids.discard(task.transfer_id)


MAX_YIELDS = 5000  # scheduler lookups a failed load's request lets block holders go first


def _holds_and_waits(request: VllmRequest, load_failed: bool) -> bool:
    """Does this decode request hold blocks without running yet? By vLLM's RequestStatus
    name (the same on every build): a load in flight, or done and not yet scheduled; a
    failed load only until vLLM frees its blocks (it is WAITING again, holding none)."""
    status = getattr(getattr(request, "status", None), "name", "")
    return status == "WAITING_FOR_REMOTE_KVS" or (status == "WAITING" and not load_failed)


def reports_failures_per_request(groups: list[Any]) -> bool:
    """Must a failed receive be reported per request rather than as invalid blocks?

    Block ids map back to requests only with one KV cache group. And with a sliding-window
    group, vLLM's invalid-block path keeps the tokens before the first invalid block as
    computed: those are the null block's positions (never loaded), and the tokens
    recomputed after them would attend over them. Only a recompute from token 0 over a
    clean block table is right there."""
    return len(groups) > 1 or any(g.kind is SpecKind.SLIDING_WINDOW for g in groups)


def clip_to_window(block_ids: list[int], window_tokens: int | None, block_size: int
                   ) -> list[int]:
    """Sliding-window groups only need the blocks the window can still see."""
    if window_tokens is None:
        return block_ids
    keep = math.ceil(window_tokens / block_size) + 1
    return block_ids[-keep:]


class SchedulerHalf:
    def __init__(self, settings: SchedulerSettings, kv_cache_config: KVCacheConfigLike | None,
                 recovery: LoadFailureRecovery | None = None) -> None:
        self.settings = settings
        self.groups = compat_kv.group_facts(kv_cache_config) if kv_cache_config else []
        self.has_mamba = any(g.kind is SpecKind.MAMBA for g in self.groups)
        self.has_sliding = any(g.kind is SpecKind.SLIDING_WINDOW for g in self.groups)
        self.recovery = recovery or LoadFailureRecovery(None)
        self.hash_block_size = min((g.block_size for g in self.groups), default=0)
        self._pending = FlagCXMetadataPayload()
        self.held = HeldSends()  # prefill: the requests whose KV it holds for a decode
        self.loads = Loads()  # decode: one slot per request that loads (connector.loads)
        self._requests: dict[RequestId, RequestParams] = {}  # until request_finished
        self.recomputed_after_failure = 0
        self.rejected_params = 0
        self.heartbeats = HeartbeatSender(settings.lease_seconds / 3, self.loads.awaited,
                                          key=settings.key)

    # -------------------------------------------------------------------- decode side
    def on_new_request(self, request: VllmRequest) -> None:
        """A request entered the engine (vLLM 0.22+). Decode: its prefill hears at once that
        decode has it (a heartbeat), which turns prefill's short first lease into the full
        one; builds without this hook send it when vLLM first schedules the request."""
        remote = self._read(request).remote
        if remote is not None:
            self.loads.match(RequestId(request.request_id), request, remote, 0)
            self.heartbeats.wake()

    def _read(self, request: VllmRequest) -> RequestParams:
        """The request's ``RequestParams``, read at its first hook. Params that are not an
        object (``vllm_writes.drop_unusable_params``) or that name a prefill badly are
        refused with a warning: bad input never strands a request, it is computed
        locally."""
        request_id = RequestId(request.request_id)
        seen = self._requests.get(request_id)
        if seen is not None:
            return seen
        why = vllm_writes.drop_unusable_params(request)
        params = request.kv_transfer_params
        seen = RequestParams(params if isinstance(params, Mapping) else {}, refused=why)
        if seen.params and wire_params.wants_remote_prefill(seen.params):
            try:
                seen.remote = parse_remote_prefill(seen.params)
            except TransferParamsError as exc:
                seen.refused = str(exc)
        if seen.refused is not None:
            self.rejected_params += 1
            logger.warning("request %s: %s; computing it locally", request_id, seen.refused)
        self._requests[request_id] = seen
        return seen

    def get_num_new_matched_tokens(self, request: VllmRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        request_id = RequestId(request.request_id)
        if self._yields(request_id):
            return None, False  # "not yet": vLLM skips it this step (every build >= 0.13)
        seen = self._read(request)
        if (wire_params.wants_remote_decode(seen.params) and self.has_mamba
                and not seen.truncated
                and vllm_writes.truncate_for_prefill(request, self.hash_block_size)):
            seen.truncated = True  # once: preemption brings it back here
        remote = seen.remote
        if remote is None:
            return 0, False
        wanted = compat_kv.remote_prefill_token_count(
            request.num_prompt_tokens, self.has_mamba, remote.remote_num_tokens)
        if wanted is None:
            # prefill's recurrent state is after another token count than decode can use:
            # computed here, and prefill is told to free its blocks (update_state_after_alloc)
            logger.warning("request %s: prefill holds the state after %s prompt tokens, "
                           "this request has %d; computing it locally", request.request_id,
                           remote.remote_num_tokens, request.num_prompt_tokens)
            return 0, False
        count = wanted - num_computed_tokens
        self.loads.match(request_id, request, remote, num_computed_tokens)
        if count > 0:  # until its blocks are allocated, the heartbeat keeps the lease
            self.heartbeats.wake()
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: VllmRequest, blocks: Any,
                                 num_external_tokens: int) -> None:
        seen = self._read(request)
        remote, seen.remote = seen.remote, None  # planned (or a local hit): never twice
        if remote is None:
            return
        if num_external_tokens <= 0:
            # Everything was a local hit: prefill still holds blocks; free them there.
            self.loads.drop(RequestId(request.request_id))
            self._pending.release[remote.transfer_id] = remote
            return
        per_group = compat_kv.unhashed_block_ids_all_groups(blocks)
        local_hit = self.loads.plan(RequestId(request.request_id), request, remote)
        ids, offsets = [], []
        for facts, group in zip(self.groups, per_group, strict=True):
            group = compat_kv.strip_null_blocks(group)
            if facts.kind is SpecKind.SLIDING_WINDOW:
                group = clip_to_window(group, facts.sliding_window, facts.block_size)
            ids.append(group)
            full = facts.kind in (SpecKind.FULL_ATTENTION, SpecKind.MLA)
            offsets.append(local_hit // facts.block_size if full else None)
        rid = RequestId(request.request_id)
        self._pending.recv[rid] = RecvTask(rid, remote, ids, num_external_tokens, offsets,
                                           time.monotonic())

    # -------------------------------------------------------------------- both sides
    def build_payload(self, idle: bool = False) -> FlagCXMetadataPayload:
        """This step's payload; ``idle``: the step computes no token (its workers may
        wait for transfers in flight, ``connector.in_flight``)."""
        payload, self._pending = self._pending, FlagCXMetadataPayload()
        payload.idle = idle
        self.loads.dispatch(payload.recv)
        return payload

    def on_preemptions(self, req_ids: set[str]) -> None:
        self._pending.preempted_req_ids |= {RequestId(r) for r in req_ids}

    def request_finished(self, request: VllmRequest, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, object] | None]:
        seen = self._read(request)  # read here if no hook did before
        del self._requests[RequestId(request.request_id)]
        ended = self.loads.end_request(RequestId(request.request_id))
        phase, awaited = ended if ended is not None else (None, None)
        loading = phase in (LoadPhase.PLANNED, LoadPhase.PULLING)
        if seen.remote is not None or loading:  # still to load, or loading
            # Decode request ended before (or while) its KV arrived: tell prefill.
            remote = awaited if loading else seen.remote
            if remote is not None:
                self._pending.release[remote.transfer_id] = remote
            if phase is not LoadPhase.PULLING:
                self._pending.recv.pop(RequestId(request.request_id), None)
                return False, None  # no worker was told to pull: nothing can be in flight
            # A pull may be writing into these blocks right now: keep them (KEPT). Every
            # dispatched pull ends (done, failed or timed out) in finished_recving, which
            # is where vLLM frees the blocks of a request that already finished (0.13: we
            # do, compat.vllm_writes.report_as_sent).
            return True, None
        if seen.refused is not None:  # the client learns its KV was computed here, and why
            return False, wire_params.not_loaded_params(seen.refused)
        if (not wire_params.wants_remote_decode(seen.params)
                or not self._finished_by_length(request)):
            return False, None
        if wire_params.is_bootstrap_leg(seen.params):
            self.rejected_params += 1
            logger.warning("FlagCX: request %s: %s", request.request_id,
                           wire_params.BOOTSTRAP_LEG_REFUSAL)
            return False, {"transfer_id": seen.params["transfer_id"],
                           wire_params.NOT_HELD: wire_params.BOOTSTRAP_LEG_REFUSAL}
        ids = [compat_kv.strip_null_blocks(list(g)) for g in block_ids]
        transfer_id = TransferId(str(seen.params.get("transfer_id") or request.request_id))
        if self.held.holds(transfer_id):
            # A second request under a held id: decode would pull the first one's KV.
            logger.warning("FlagCX: transfer_id %r of request %s is already held for "
                           "another request; its KV is not offered (decode recomputes)",
                           transfer_id[:80], request.request_id)
            return False, None
        out = remote_prefill_params(
            transfer_id=transfer_id, host=self.settings.side_channel_host,
            port=self.settings.side_channel_port, tp_size=self.settings.tp_size,
            engine_id=self.settings.engine_id,
            block_sizes=tuple(g.block_size for g in self.groups),
            num_tokens=request.num_prompt_tokens)
        if not any(ids):
            return False, out
        task = SendTask(RequestId(request.request_id), transfer_id, ids,
                        time.monotonic() + self.settings.first_lease_seconds)
        self.held.hold(task)
        self._pending.send[RequestId(request.request_id)] = task
        return True, out

    @staticmethod
    def _finished_by_length(request: VllmRequest) -> bool:
        status = getattr(request, "status", None)
        return getattr(status, "name", "") == "FINISHED_LENGTH_CAPPED"

    def update_connector_output(self, finished_sending: set[str] | None,
                                finished_recving: set[str] | None,
                                failed_recving: set[str] | None = None) -> set[str]:
        """Finished transfers; ``failed_recving``: receives our workers reported failed
        (builds where vLLM has no request-level report), recomputed as
        ``compat.vllm_writes`` says. Returns the requests that finished during their load
        and whose load just ended: vLLM may free their blocks now (``report_as_sent``)."""
        for req_id in map(RequestId, failed_recving or ()):
            # with a recovery mode vLLM frees its blocks, and it yields: see _yields
            request = self.loads.fail(req_id, vllm_frees=self.recovery.mode is not None,
                                      yields=MAX_YIELDS)
            if request is None:
                continue
            self.recomputed_after_failure += 1
            self.recovery.recompute(request, in_place=not self.has_sliding)
        ended: set[str] = {r for r in map(RequestId, finished_recving or ())
                           if self.loads.land(r)}
        for sent in map(RequestId, finished_sending or ()):
            self.held.sent(sent)
        return ended

    def _yields(self, request_id: RequestId) -> bool:
        """Must this request, whose load failed, let the block holders go first?

        vLLM frees a failed load's blocks, and the request then waits to recompute at
        the head of the queue of block holders (0.34's ``kv_holding_waiting``,
        0.18-0.22's ``skipped_waiting``), which the scheduler drains first and in order.
        When the pool cannot fit its recompute, admission stops at it every step, and the
        requests behind it that hold blocks (loads in flight, loaded ones waiting to run,
        other failed loads not yet freed) never get there: measured, 17-34 of 30-50
        requests stuck for good after a burst of failed receives. So it answers "not
        yet" while any of those waits; they need only their last token to run, or free
        their blocks. Bounded (``MAX_YIELDS`` lookups) so a steady stream of new loads
        cannot starve it; once it stops yielding nothing behind it is admitted, so the
        running requests' blocks come back to it."""
        load = self.loads.get(request_id)
        left = load.yields_left if load is not None else None
        if load is None or left is None:
            return False
        if left > 0 and any(_holds_and_waits(h.request, h.vllm_frees)
                            for h in self.loads.holders(but=request_id)):
            load.yields_left = left - 1
            return True
        if left <= 0:
            logger.warning("FlagCX: request %s stopped yielding to block holders after %d "
                           "lookups", request_id, MAX_YIELDS)
        load.yields_left = None
        return False

    def shutdown(self) -> None:
        self.heartbeats.stop()

    @property
    def num_held(self) -> int:
        return len(self.held)

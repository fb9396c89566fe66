"""Decode's loads, one lifecycle in one place (the scheduler half's counterpart of
``sends.Sends``).

A request that names a prefill (``do_remote_prefill``) gets one slot, keyed by its vLLM
request id, from the step vLLM asks how many tokens come from outside until the request
ends:

* **MATCHED**: the request entered decode (``on_new_request``) or vLLM was told its
  prompt's tokens come from prefill; no blocks yet. Its prefill's lease is kept alive by
  the heartbeat, which reads these (``awaited``).
* **PLANNED**: blocks allocated, the pull is in this step's payload (no worker knows yet).
* **PULLING**: the payload went to the workers: a pull may be writing into the blocks.
* **LANDED**: the workers reported the load, done or failed (``failed``); the request
  holds its blocks until it runs.
* **KEPT**: the request finished while PULLING: its blocks stay ours until the load ends
  (a pull may still write into them), then vLLM frees them.

The invariants: only PULLING turns into KEPT (a PLANNED pull never left the scheduler, so
nothing can write its blocks); a slot leaves at the request's end, or for KEPT when its
load ends; a failed load's request may *yield* to the other block holders a bounded
number of times (``scheduler.SchedulerHalf._yields`` says why).

vLLM's scheduler thread calls in; the heartbeat thread only reads ``awaited``, and the
slot table changes shape under one lock.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from vllm_flagcx.compat.vllm_types import VllmRequest
from vllm_flagcx.connector.common.metadata import RequestId
from vllm_flagcx.wire.params import RemotePrefill


class LoadPhase(enum.Enum):
    MATCHED = "matched"
    PLANNED = "planned"
    PULLING = "pulling"
    LANDED = "landed"
    KEPT = "kept"


HOLDS_BLOCKS = (LoadPhase.PLANNED, LoadPhase.PULLING, LoadPhase.LANDED)


class LoadStateError(RuntimeError):
    """A transition the lifecycle does not allow (a bug in the caller, never input)."""


@dataclass
class Load:
    """One decode request's load (see the module docstring)."""

    request: VllmRequest
    remote: RemotePrefill
    phase: LoadPhase
    local_hit: int = 0  # prompt tokens decode had computed locally when matched
    failed: bool = False
    vllm_frees: bool = False  # failed, and vLLM frees its blocks (it then holds none)
    yields_left: int | None = None  # lookups it may still yield (such a failed load only)


class Loads:
    """The decode requests of one scheduler and their transitions."""

    def __init__(self) -> None:
        self._slots: dict[RequestId, Load] = {}
        self._lock = threading.Lock()  # the slot table's shape (the heartbeat reads it)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slots

    def get(self, request_id: RequestId) -> Load | None:
        return self._slots.get(request_id)

    def phase(self, request_id: RequestId) -> LoadPhase | None:
        slot = self.get(request_id)
        return slot.phase if slot else None

    def match(self, request_id: RequestId, request: VllmRequest, remote: RemotePrefill,
              local_hit: int) -> None:
        """vLLM asked (again) how many tokens come from prefill. Asking again before the
        blocks came (the pool was full) only updates the local hit."""
        slot = self.get(request_id)
        if slot is not None and slot.phase is not LoadPhase.MATCHED:
            raise LoadStateError(f"request {request_id} matched again while {slot.phase.value}")
        self._put(request_id, Load(request, remote, LoadPhase.MATCHED, local_hit))

    def plan(self, request_id: RequestId, request: VllmRequest, remote: RemotePrefill) -> int:
        """Blocks allocated and the pull planned; the local hit it was matched with."""
        slot = self.get(request_id)
        if slot is not None and slot.phase is not LoadPhase.MATCHED:
            raise LoadStateError(f"request {request_id} planned twice ({slot.phase.value})")
        local_hit = slot.local_hit if slot else 0
        self._put(request_id, Load(request, remote, LoadPhase.PLANNED, local_hit))
        return local_hit

    def drop(self, request_id: RequestId) -> None:
        """The match came to nothing (every token was a local hit)."""
        self._remove(request_id)

    def dispatch(self, request_ids: Iterable[RequestId]) -> None:
        """The step's payload went to the workers: its planned pulls may now write."""
        for request_id in request_ids:
            slot = self.get(request_id)
            if slot is not None and slot.phase is LoadPhase.PLANNED:
                slot.phase = LoadPhase.PULLING

    def end_request(self, request_id: RequestId) -> tuple[LoadPhase, RemotePrefill] | None:
        """The request finished: the phase its load was in, and its prefill. A PULLING one
        turns KEPT (and stays), any other leaves."""
        slot = self.get(request_id)
        if slot is None:
            return None
        before = slot.phase
        if slot.phase is LoadPhase.PULLING:
            slot.phase = LoadPhase.KEPT
            slot.yields_left = None
        else:
            self._remove(request_id)
        return before, slot.remote

    def fail(self, request_id: RequestId, vllm_frees: bool, yields: int
             ) -> VllmRequest | None:
        """The workers reported this load failed: its Request (None when it is not loading:
        finished meanwhile, or unknown). ``vllm_frees``: vLLM frees its blocks and it
        waits to recompute, yielding to the block holders up to ``yields`` lookups."""
        slot = self.get(request_id)
        if slot is None or slot.phase not in (LoadPhase.PLANNED, LoadPhase.PULLING):
            return None
        slot.failed = True
        slot.vllm_frees = vllm_frees
        slot.yields_left = yields if vllm_frees else None
        return slot.request

    def land(self, request_id: RequestId) -> bool:
        """The workers reported the load ended; True when the request had already finished
        (KEPT: its slot leaves and vLLM may free its blocks now)."""
        slot = self.get(request_id)
        if slot is None:
            return False
        if slot.phase is LoadPhase.KEPT:
            self._remove(request_id)
            return True
        if slot.phase in (LoadPhase.PLANNED, LoadPhase.PULLING):
            slot.phase = LoadPhase.LANDED
        return False

    def awaited(self) -> list[RemotePrefill]:
        """The prefills of MATCHED loads: transfers decode will pull, not yet planned
        (the heartbeat's targets; safe from any thread)."""
        with self._lock:
            slots = list(self._slots.values())
        return [s.remote for s in slots if s.phase is LoadPhase.MATCHED]

    def _put(self, request_id: RequestId, load: Load) -> None:
        with self._lock:
            self._slots[request_id] = load

    def _remove(self, request_id: RequestId) -> None:
        with self._lock:
            self._slots.pop(request_id, None)

    def holders(self, but: RequestId) -> Iterator[Load]:
        """Every other request that holds blocks for a load (planned, pulling or landed)."""
        return (s for rid, s in self._slots.items()
                if rid != but and s.phase in HOLDS_BLOCKS)

"""The per-step contract between the connector's scheduler half and its workers.

Each engine step the scheduler half builds one ``FlagCXMetadataPayload`` and vLLM hands it
to every worker (``start_load_kv``): decode loads to start (``RecvTask``), prefill sends to
hold until pulled (``SendTask``), transfers decode gave up on (release). It crosses the
scheduler -> worker boundary inside vLLM's own connector metadata, so it lives here, not
in either half (the worker never imports the scheduler module).

Two ids, never mixed up (typed, so mypy catches a swap):

* ``RequestId``: vLLM's id of a request *in this engine* (the scheduler's and workers'
  key, what ``get_finished`` reports);
* ``TransferId``: the cross-engine key of one PD transfer, minted by prefill's scheduler
  half (or a router) and carried in ``kv_transfer_params``; prefill's side channel and
  decode's pulls speak only this one.

**The clock rule**: every instant here (``RecvTask.planned_at``, ``SendTask.deadline``) is
``time.monotonic()`` seconds, the one clock of a host's processes (``wire.timeline``), so
a worker may compare it with its own readings; durations that cross hosts are never
compared with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from vllm_flagcx.wire.params import RemotePrefill, TransferId

__all__ = ["FlagCXMetadataPayload", "RecvTask", "RequestId", "SendTask", "TransferId"]

RequestId = NewType("RequestId", str)


@dataclass
class RecvTask:
    """Decode: load these local blocks (per group) from the prefill named in ``remote``."""

    request_id: RequestId
    remote: RemotePrefill
    block_ids: list[list[int]]
    num_tokens: int
    offsets: list[int | None] = field(default_factory=list)  # per group, see plans
    planned_at: float = 0.0  # when the scheduler half planned the load (monotonic)


@dataclass
class SendTask:
    """Prefill: these blocks (per group) hold the KV of ``transfer_id`` until released or
    the lease ends at ``deadline`` (monotonic)."""

    request_id: RequestId
    transfer_id: TransferId
    block_ids: list[list[int]]
    deadline: float


@dataclass
class FlagCXMetadataPayload:
    """The per-step content of the connector metadata (scheduler -> workers)."""

    recv: dict[RequestId, RecvTask] = field(default_factory=dict)
    send: dict[RequestId, SendTask] = field(default_factory=dict)
    release: dict[TransferId, RemotePrefill] = field(default_factory=dict)
    preempted_req_ids: set[RequestId] = field(default_factory=set)
    idle: bool = False  # the step computes no token (``connector.in_flight``)

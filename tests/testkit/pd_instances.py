"""Prefill and decode instances in one process: a REAL vLLM Scheduler with FlagCXConnector's
scheduler half (built by vLLM's own factory) plus one ``WorkerHalf`` per TP rank over the
caches of ``pd_caches``, wired to a transport (the in-process stand-in by default).
``pd_harness`` re-exports these names."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from testkit import cpu_platform  # noqa: F401 - first: spawned processes import it
from testkit import vllm_harness as harness
from testkit.pd_caches import (
    RankCaches,
)
from vllm_flagcx.compat import kv_cache
from vllm_flagcx.connector.entry import FlagCXWorkerMetadata
from vllm_flagcx.connector.scheduler import reports_failures_per_request
from vllm_flagcx.connector.worker import WorkerHalf


def free_port(span: int = 10) -> int:
    """A base port with ``span`` consecutive free loopback ports (P binds base + rank)."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - span)
        sockets = []
        try:
            for offset in range(span):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise RuntimeError("no block of free loopback ports found")


class EntryWorkers:
    """Drives real FlagCXConnector WORKER-role objects the way vLLM's model runner does:
    bind metadata, start_load_kv, wait_for_save, get_finished (or get_transfer_results),
    get_block_ids_with_load_errors, build_connector_worker_meta, clear metadata."""

    def __init__(self, connectors: list[Any]) -> None:
        self.connectors = connectors

    @property
    def halves(self) -> list[WorkerHalf]:
        return [c.worker for c in self.connectors]

    def run_step(self, meta: Any) -> tuple[Counter, Counter, set[int], set[str], Any]:
        sending, recving, invalid, failed, metas = Counter(), Counter(), set(), set(), []
        for c in self.connectors:
            c.bind_connector_metadata(meta)
            c.start_load_kv(None)
            c.wait_for_save()
            if hasattr(c, "get_transfer_results"):
                results = c.get_transfer_results(set())
                s, r = results.finished_sending, results.finished_recving
                failed |= results.failed_recving
            else:
                s, r = c.get_finished(set())
            sending.update(s or ())
            recving.update(r or ())
            invalid |= c.get_block_ids_with_load_errors()
            worker_meta = c.build_connector_worker_meta()
            if worker_meta is not None:
                metas.append(worker_meta)
                failed |= worker_meta.failed_recving
            c.clear_connector_metadata()
        return sending, recving, invalid, failed, metas


@dataclass
class Instance:
    scheduler: Any
    workers: list[WorkerHalf]
    ranks: list[RankCaches]
    tp: int
    finished: Counter = field(default_factory=Counter)
    recv_tasks: dict[str, Any] = field(default_factory=dict)
    send_tasks: dict[str, Any] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    entry: EntryWorkers | None = None
    # request id -> (num_computed_tokens, block ids per group) each time it was scheduled
    # as new
    scheduled_blocks: dict[str, list[Any]] = field(default_factory=dict)
    # blocks vLLM (0.34+) told the workers to zero (SchedulerOutput.new_block_ids_to_zero)
    zeroed: set[int] = field(default_factory=set)

    @functools.cached_property
    def failures_per_request(self) -> bool:
        """Whether this vLLM reports failed loads per request for these groups (fixed
        for the instance: computed once, as vLLM's worker does, not per step)."""
        return reports_failures_per_request(kv_cache.group_facts(self.ranks[0].config))

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.zeroed.update(getattr(out, "new_block_ids_to_zero", None) or ())
        for new in out.scheduled_new_reqs:
            self.scheduled_blocks.setdefault(new.req_id, []).append(
                (new.num_computed_tokens, [list(g) for g in new.block_ids]))
        meta = out.kv_connector_metadata
        children = getattr(meta, "metadata", None)  # MultiConnector: one child, ours
        if isinstance(children, tuple) and len(children) == 1:
            meta = children[0]
        payload = getattr(meta, "payload", None)
        if payload is not None:
            self.recv_tasks.update(payload.recv)
            self.send_tasks.update(payload.send)
        if self.entry is not None:
            sending, recving, invalid, failed, _ = self.entry.run_step(meta)
            self.failed |= failed
        else:
            sending, recving, invalid = self._step_halves(payload)
        self.finished.update({f"s:{k}": v for k, v in sending.items()})
        self.finished.update({f"r:{k}": v for k, v in recving.items()})
        done_s = {k[2:] for k, v in self.finished.items() if k[0] == "s" and v == self.tp}
        done_r = {k[2:] for k, v in self.finished.items() if k[0] == "r" and v == self.tp}
        for key in [f"s:{k}" for k in done_s] + [f"r:{k}" for k in done_r]:
            del self.finished[key]
        failed_now = self.failed & done_r
        self.failed -= failed_now
        per_request = self.failures_per_request
        fields = harness.load_failure_fields(failed=failed_now, invalid_blocks=invalid,
                                     per_request=per_request,
                                     worker_meta=FlagCXWorkerMetadata(failed_now))
        if per_request and failed_now:
            # vLLM's own worker also sends what build_connector_worker_meta returns, on
            # every build that has the field (0.34 too, next to failed_recving); dropped
            # by make_connector_output where the field is absent
            fields.setdefault("kv_connector_worker_meta", FlagCXWorkerMetadata(failed_now))
        kv_out = harness.make_connector_output(
            finished_sending=done_s or None, finished_recving=done_r or None, **fields)
        self.outputs.append(self.scheduler.update_from_output(
            out, harness.model_output(out, kv_connector_output=kv_out)))

    def _step_halves(self, payload: Any) -> tuple[Counter, Counter, set[int]]:
        if payload is not None:
            for worker in self.workers:
                worker.start_step(payload)
        sending, recving, invalid = Counter(), Counter(), set()
        for worker in self.workers:
            s, r = worker.get_finished()
            sending.update(s)
            recving.update(r)
            self.failed |= worker.failed_last_step
            invalid |= worker.get_block_ids_with_load_errors()
        return sending, recving, invalid

    def shutdown(self) -> None:
        if self.entry is not None:
            for connector in self.entry.connectors:
                connector.shutdown()
            return
        for worker in self.workers:
            worker.shutdown()

"""Prefill and decode instances in one process: a REAL vLLM Scheduler with FlagCXConnector's
scheduler half (built by vLLM's own factory) plus one ``WorkerHalf`` per TP rank over the
caches of ``pd_caches``, wired to a transport (the in-process stand-in by default).
``pd_harness`` re-exports these names."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from testkit import cpu_platform  # noqa: F401 - first: spawned processes import it
from testkit import vllm_harness as harness
from testkit.pd_caches import (
    KEY_DIM,
    KV_HEADS,
    VALUE_DIM,
    RankCaches,
    allocate,
    declared_dims_of,
    dense_rank_kv_cache_config,
    layout_declaring,
    mla_rank_kv_cache_config,
    rank_kv_cache_config,
    sliding_rank_kv_cache_config,
)
from testkit.transport_standin import FAULTS_KEY, Faults, MemmoveTransport
from vllm_flagcx.compat import kv_cache, kv_layout, kv_views
from vllm_flagcx.connector.entry import FlagCXWorkerMetadata
from vllm_flagcx.connector.scheduler import reports_failures_per_request
from vllm_flagcx.connector.worker import WorkerHalf, WorkerSettings, model_page_bytes
from vllm_flagcx.layout.regions import ConvSplit
from vllm_flagcx.layout.topology import head_range
from vllm_flagcx.wire import auth
from vllm_flagcx.wire import handshake as hs


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
        per_request = reports_failures_per_request(kv_cache.group_facts(self.ranks[0].config))
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


def build_instance(role: str, tp: int, port: int, conv_layout: str = "SD",
                   num_blocks: int = 48, faults: Faults | None = None, seed: int = 0,
                   lease_seconds: float = 30.0, recv_timeout: float = 10.0,
                   model: str = "hybrid", dtype: Any = torch.bfloat16,
                   peer_ttl: float = 300.0, via_entry: bool = False,
                   prefix_caching: bool = False, transport: str | None = None,
                   kernel_ratio: int = 1, verify_integrity: bool = True,
                   extra: dict | None = None, test_faults: bool = False,
                   cache_format: str = "CPU_ATTN:isa=vec:layout=HND",
                   secret_file: str | None = None, engine_id: str | None = None,
                   attn_layout: str = "flash_hnd",
                   failure_policy: str | None = None,
                   release_hold_seconds: float = 600.0, multi: bool = False,
                   dp_rank: int = 0, logical_check: bool = True) -> Instance:
    """``secret_file``: the side-channel secret (wire.auth) for the scheduler (through
    the extra config) and the workers. ``failure_policy``: vLLM's
    ``kv_load_failure_policy`` where this build has it (None: the build's default).
    ``multi``: the scheduler's connector is vLLM's MultiConnector holding FlagCXConnector
    as its one child (how NVIDIA Dynamo takes a connector it does not name). ``dp_rank``:
    this instance is that data-parallel rank of a DP deployment (vLLM's ParallelConfig);
    its workers bind the side-channel port the product's scheduler half advertises.
    ``logical_check=False``: the workers register no cache views, so the full logical
    digest is neither sent nor checked (the byte sample still is)."""
    hybrid = model == "hybrid"
    key = auth.load_key(secret_file)
    if secret_file:
        extra = {**(extra or {}), auth.SECRET_FILE_KEY: secret_file}
    if via_entry and faults is not None:  # the entry's transport comes from the factory
        assert transport is None, "fault knobs need the stand-in transport"
        extra = {**(extra or {}), FAULTS_KEY: {
            f.name: getattr(faults, f.name) for f in dataclasses.fields(faults)
            if getattr(faults, f.name) != f.default}}
    extra_config = {"side_channel_port": port, "lease_seconds": lease_seconds,
                    **({"transport": transport} if transport else
                       {"transport_factory": "testkit.transport_standin:factory"}),
                    **(extra or {})}
    wrapped: dict[str, Any] = {}
    if multi:
        wrapped = {"connector": "MultiConnector", "module_path": None, "hma": None,
                   "extra_config": {"connectors": [{
                       "kv_connector": harness.CONNECTOR, "kv_role": role,
                       "kv_connector_module_path": harness.CONNECTOR_MODULE,
                       "kv_connector_extra_config": extra_config}]}}
    config = harness.make_vllm_config(**{
        "model": harness.HYBRID_MODEL if hybrid else harness.DENSE_MODEL, "hma": True,
        "kv_role": role, "extra_config": extra_config, "prefix_caching": prefix_caching,
        **wrapped})
    # The instance's TP size as its scheduler sees it (no worker processes run here).
    config.parallel_config.tensor_parallel_size = tp
    if dp_rank:
        config.parallel_config.data_parallel_size = dp_rank + 1
        config.parallel_config.data_parallel_rank = dp_rank
        if hasattr(config.parallel_config, "data_parallel_index"):
            config.parallel_config.data_parallel_index = dp_rank
    if failure_policy is not None:
        config.kv_transfer_config.kv_load_failure_policy = failure_policy
    if model == "mla":
        rank_config = mla_rank_kv_cache_config(tp, num_blocks)
    elif model == "sliding":
        rank_config = sliding_rank_kv_cache_config(tp, num_blocks)
    elif hybrid:
        rank_config = rank_kv_cache_config(tp, num_blocks, conv_layout=conv_layout)
    else:
        rank_config = dense_rank_kv_cache_config(tp, num_blocks, dtype=dtype)
    if via_entry:  # the connector reads the dims of this platform's backend: match them
        from vllm_flagcx.compat.attention import layer_attention_dims

        names = [n for _, g in kv_cache.attention_groups(rank_config) for n in g.layer_names]
        attn_layout = layout_declaring(layer_attention_dims(config, names), attn_layout)
    ranks = [allocate(rank_config, conv_layout, seed * 100 + r, kernel_ratio, attn_layout)
             for r in range(tp)]
    if model == "mla":  # the latent is the same on every rank
        for caches in ranks[1:]:
            for name, tensor in caches.caches.items():
                tensor.copy_(ranks[0].caches[name])
    elif tp > KV_HEADS:  # replicated KV heads hold the same bytes on every rank with them
        for rank in range(tp):
            first = next(r for r in range(tp)
                         if head_range(r, tp, KV_HEADS) == head_range(rank, tp, KV_HEADS))
            for group in ranks[rank].config.kv_cache_groups[:1]:
                for layer in group.layer_names:
                    ranks[rank].caches[layer].copy_(ranks[first].caches[layer])
    scheduler = harness.make_scheduler(config, ranks[0].config)
    children = getattr(scheduler.connector, "_connectors", None)
    port = (children[0] if children else scheduler.connector).side_channel_port
    if via_entry:  # the product's own worker path: vLLM's role enum, register_kv_caches
        from vllm_flagcx.compat.connector_api import KVConnectorRole
        from vllm_flagcx.connector import FlagCXConnector

        assert tp == 1, "entry workers read their TP rank from vLLM's (absent) TP group"
        connector = FlagCXConnector(config, KVConnectorRole.WORKER, ranks[0].config)
        connector.register_kv_caches(ranks[0].caches)
        return Instance(scheduler, [connector.worker], ranks, tp,
                        entry=EntryWorkers([connector]))
    split = ConvSplit((("q", KEY_DIM // tp, KEY_DIM), ("k", KEY_DIM // tp, KEY_DIM),
                       ("v", VALUE_DIM // tp, VALUE_DIM)))
    workers = []
    for rank, caches in enumerate(ranks):
        # what the backend of these caches declares, as the product reads it from vLLM
        dims = {i: declared_dims_of(attn_layout)
                for i, _ in kv_cache.attention_groups(caches.config)}
        regions = kv_layout.regions_for_kv_caches(caches.caches, caches.config, tp, KV_HEADS,
                                                  conv_layout, split, dims)
        groups = kv_cache.group_facts(caches.config)
        layout = hs.LayoutFacts(
            model=model, dtype="bfloat16", kv_cache_dtype=str(dtype).removeprefix("torch."),
            group_kinds=tuple(g.kind.value for g in groups),
            block_sizes=tuple(g.block_size for g in groups),
            kernel_block_sizes=tuple(g.block_size // kernel_ratio for g in groups),
            page_bytes=model_page_bytes(regions, len(groups)), conv_layout=conv_layout,
            num_kv_heads=KV_HEADS, cache_format=cache_format)
        # the engine id the scheduler half puts in remote_engine_id (vLLM's KVTransferConfig)
        worker_engine = engine_id or config.kv_transfer_config.engine_id
        worker = WorkerHalf(WorkerSettings(engine_id=worker_engine, tp_rank=rank,
                                           tp_size=tp,
                                           layout=layout, side_channel_port=port,
                                           lease_seconds=lease_seconds,
                                           recv_timeout=recv_timeout,
                                           handshake_timeout=2.0, peer_ttl=peer_ttl,
                                           verify_integrity=verify_integrity,
                                           release_hold_seconds=release_hold_seconds,
                                           test_faults=test_faults, key=key),
                            MemmoveTransport(faults))
        ratios = [kernel_ratio] * len(caches.config.kv_cache_groups)
        views = kv_views.cache_views(caches.caches, caches.config, KV_HEADS, dims, ratios,
                                     rank, tp, conv_layout, split.parts)
        worker.register_regions(regions, serve=role == "kv_producer",
                                logical_num_blocks=caches.config.num_blocks,
                                views=views if logical_check else None)
        workers.append(worker)
    return Instance(scheduler, workers, ranks, tp)

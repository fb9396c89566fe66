"""Builds the test kit's prefill and decode instances (``pd_instances.Instance``): vLLM's
real Scheduler from a real VllmConfig, every TP rank's caches (``pd_caches``), and the
workers, either the product's entry class or worker halves over the stand-in transport,
registered as the product registers them. ``pd_harness`` re-exports ``build_instance``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

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
from testkit.pd_instances import EntryWorkers, Instance
from testkit.transport_standin import FAULTS_KEY, Faults, MemmoveTransport
from vllm_flagcx.compat import kv_cache, kv_layout, kv_views
from vllm_flagcx.connector.worker import WorkerHalf, WorkerSettings, model_page_bytes
from vllm_flagcx.layout.regions import ConvSplit
from vllm_flagcx.layout.topology import head_range
from vllm_flagcx.wire import auth
from vllm_flagcx.wire import handshake as hs


@dataclass(frozen=True)
class InstanceOptions:
    """What one test instance differs in (``build_instance``'s keyword arguments).

    ``secret_file``: the side-channel secret (wire.auth) for the scheduler (through the
    extra config) and the workers. ``failure_policy``: vLLM's ``kv_load_failure_policy``
    where this build has it (None: the build's default). ``multi``: the scheduler's
    connector is vLLM's MultiConnector holding FlagCXConnector as its one child (how NVIDIA
    Dynamo takes a connector it does not name). ``dp_rank``: this instance is that
    data-parallel rank of a DP deployment (vLLM's ParallelConfig); its workers bind the
    side-channel port the product's scheduler half advertises. ``logical_check=False``:
    the workers register no cache views, so the full logical digest is neither sent nor
    checked (the byte sample still is). ``via_entry``: one worker through the product's
    own entry class (vLLM's role enum, ``register_kv_caches``) instead of stand-in ones.
    ``hands_over=False``: vLLM's own Scheduler, which gives the connector no handle on it
    (no ``--scheduler-cls``, ``compat.schedulers``)."""

    conv_layout: str = "SD"
    num_blocks: int = 48
    faults: Faults | None = None
    seed: int = 0
    lease_seconds: float = 30.0
    recv_timeout: float = 10.0
    model: str = "hybrid"
    dtype: Any = torch.bfloat16
    peer_ttl: float = 300.0
    via_entry: bool = False
    prefix_caching: bool = False
    transport: str | None = None
    kernel_ratio: int = 1
    verify_integrity: bool = True
    extra: dict | None = None
    test_faults: bool = False
    cache_format: str = "CPU_ATTN:isa=vec:layout=HND"
    secret_file: str | None = None
    engine_id: str | None = None
    attn_layout: str = "flash_hnd"
    failure_policy: str | None = None
    release_hold_seconds: float = 600.0
    multi: bool = False
    dp_rank: int = 0
    logical_check: bool = True
    hands_over: bool = True


def build_instance(role: str, tp: int, port: int, **options: Any) -> Instance:
    """A prefill (``kv_producer``) or decode (``kv_consumer``) instance of ``tp`` ranks on
    vLLM's real Scheduler, its side channel from ``port`` (``InstanceOptions``)."""
    opts = InstanceOptions(**options)
    config = _vllm_config(role, tp, port, opts)
    rank_config = _rank_kv_cache_config(tp, opts)
    attn_layout = opts.attn_layout
    if opts.via_entry:  # the connector reads the dims of this platform's backend: match them
        from vllm_flagcx.compat.attention import layer_attention_dims

        names = [n for _, g in kv_cache.attention_groups(rank_config) for n in g.layer_names]
        attn_layout = layout_declaring(layer_attention_dims(config, names), attn_layout)
    ranks = _rank_caches(tp, opts, rank_config, attn_layout)
    scheduler = harness.make_scheduler(config, ranks[0].config,
                                       harness.scheduler_class(opts.hands_over))
    if opts.via_entry:  # the product's own worker path: vLLM's role enum, register_kv_caches
        from vllm_flagcx.compat.connector_api import KVConnectorRole
        from vllm_flagcx.connector import FlagCXConnector

        assert tp == 1, "entry workers read their TP rank from vLLM's (absent) TP group"
        connector = FlagCXConnector(config, KVConnectorRole.WORKER, ranks[0].config)
        connector.register_kv_caches(ranks[0].caches)
        return Instance(scheduler, [connector.worker], ranks, tp,
                        entry=EntryWorkers([connector]))
    children = getattr(scheduler.connector, "_connectors", None)
    advertised = (children[0] if children else scheduler.connector).side_channel_port
    engine = opts.engine_id or config.kv_transfer_config.engine_id  # remote_engine_id's
    workers = [_standin_worker(role, rank, tp, caches, advertised, engine, attn_layout, opts)
               for rank, caches in enumerate(ranks)]
    return Instance(scheduler, workers, ranks, tp)


def _connector_extra_config(port: int, opts: InstanceOptions) -> dict[str, Any]:
    extra = dict(opts.extra or {})
    if opts.secret_file:
        extra[auth.SECRET_FILE_KEY] = opts.secret_file
    if opts.via_entry and opts.faults is not None:  # the entry's transport: the factory
        assert opts.transport is None, "fault knobs need the stand-in transport"
        extra[FAULTS_KEY] = {f.name: getattr(opts.faults, f.name)
                             for f in dataclasses.fields(opts.faults)
                             if getattr(opts.faults, f.name) != f.default}
    return {"side_channel_port": port, "lease_seconds": opts.lease_seconds,
            **({"transport": opts.transport} if opts.transport else
               {"transport_factory": "testkit.transport_standin:factory"}),
            **extra}


def _vllm_config(role: str, tp: int, port: int, opts: InstanceOptions) -> Any:
    extra_config = _connector_extra_config(port, opts)
    wrapped: dict[str, Any] = {}
    if opts.multi:
        wrapped = {"connector": "MultiConnector", "module_path": None, "hma": None,
                   "extra_config": {"connectors": [{
                       "kv_connector": harness.CONNECTOR, "kv_role": role,
                       "kv_connector_module_path": harness.CONNECTOR_MODULE,
                       "kv_connector_extra_config": extra_config}]}}
    config = harness.make_vllm_config(**{
        "model": harness.HYBRID_MODEL if opts.model == "hybrid" else harness.DENSE_MODEL,
        "hma": True, "kv_role": role, "extra_config": extra_config,
        "prefix_caching": opts.prefix_caching, **wrapped})
    # The instance's TP size as its scheduler sees it (no worker processes run here).
    config.parallel_config.tensor_parallel_size = tp
    if opts.dp_rank:
        config.parallel_config.data_parallel_size = opts.dp_rank + 1
        config.parallel_config.data_parallel_rank = opts.dp_rank
        if hasattr(config.parallel_config, "data_parallel_index"):
            config.parallel_config.data_parallel_index = opts.dp_rank
    if opts.failure_policy is not None:
        config.kv_transfer_config.kv_load_failure_policy = opts.failure_policy
    return config


def _rank_kv_cache_config(tp: int, opts: InstanceOptions) -> Any:
    if opts.model == "mla":
        return mla_rank_kv_cache_config(tp, opts.num_blocks)
    if opts.model == "sliding":
        return sliding_rank_kv_cache_config(tp, opts.num_blocks)
    if opts.model == "hybrid":
        return rank_kv_cache_config(tp, opts.num_blocks, conv_layout=opts.conv_layout)
    return dense_rank_kv_cache_config(tp, opts.num_blocks, dtype=opts.dtype)


def _rank_caches(tp: int, opts: InstanceOptions, rank_config: Any, attn_layout: str
                 ) -> list[RankCaches]:
    """Every rank's random-filled caches; what ranks must share (MLA's latent, a
    replicated KV head) holds the same bytes on each."""
    ranks = [allocate(rank_config, opts.conv_layout, opts.seed * 100 + r, opts.kernel_ratio,
                      attn_layout) for r in range(tp)]
    if opts.model == "mla":  # the latent is the same on every rank
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
    return ranks


def _standin_worker(role: str, rank: int, tp: int, caches: RankCaches, port: int,
                    engine_id: str, attn_layout: str, opts: InstanceOptions) -> WorkerHalf:
    """One TP rank's worker half over the memmove stand-in transport, registered as the
    product registers it (regions, layout facts and cache views read off the caches)."""
    split = ConvSplit((("q", KEY_DIM // tp, KEY_DIM), ("k", KEY_DIM // tp, KEY_DIM),
                       ("v", VALUE_DIM // tp, VALUE_DIM)))
    # what the backend of these caches declares, as the product reads it from vLLM
    dims = {i: declared_dims_of(attn_layout) for i, _ in kv_cache.attention_groups(caches.config)}
    regions = kv_layout.regions_for_kv_caches(caches.caches, caches.config, tp, KV_HEADS,
                                              opts.conv_layout, split, dims)
    groups = kv_cache.group_facts(caches.config)
    layout = hs.LayoutFacts(
        model=opts.model, dtype="bfloat16", kv_cache_dtype=str(opts.dtype).removeprefix("torch."),
        group_kinds=tuple(g.kind.value for g in groups),
        block_sizes=tuple(g.block_size for g in groups),
        kernel_block_sizes=tuple(g.block_size // opts.kernel_ratio for g in groups),
        page_bytes=model_page_bytes(regions, len(groups)), conv_layout=opts.conv_layout,
        num_kv_heads=KV_HEADS, cache_format=opts.cache_format)
    worker = WorkerHalf(WorkerSettings(
        engine_id=engine_id, tp_rank=rank, tp_size=tp, layout=layout, side_channel_port=port,
        lease_seconds=opts.lease_seconds, recv_timeout=opts.recv_timeout,
        handshake_timeout=2.0, peer_ttl=opts.peer_ttl, verify_integrity=opts.verify_integrity,
        release_hold_seconds=opts.release_hold_seconds, test_faults=opts.test_faults,
        key=auth.load_key(opts.secret_file)), MemmoveTransport(opts.faults))
    ratios = [opts.kernel_ratio] * len(caches.config.kv_cache_groups)
    views = kv_views.cache_views(caches.caches, caches.config, KV_HEADS, dims, ratios, rank,
                                 tp, opts.conv_layout, split.parts)
    worker.register_regions(regions, serve=role == "kv_producer",
                            logical_num_blocks=caches.config.num_blocks,
                            views=views if opts.logical_check else None)
    return worker

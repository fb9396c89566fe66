"""A prefill and a decode instance in one process: REAL vLLM Schedulers and our workers.

Each instance is vLLM's real ``Scheduler`` (with FlagCXConnector's scheduler half, built by
vLLM's own factory) plus one ``WorkerHalf`` per TP rank over CPU KV tensors laid out the way
vLLM lays them out (hybrid: attention restrided blocks-first with HND heads, GDN
``[conv, ssm]`` views into the same page). ``step`` plays the part of the model runner,
which cannot run here: it binds the step's connector metadata to every worker, collects
``get_finished`` from all ranks (a request is done when every rank says so, as vLLM's output
aggregator does) and feeds a real ``ModelRunnerOutput`` back to the scheduler.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from testkit import (
    cpu_platform,  # noqa: F401 - first: spawned prefill processes import this module
    vllm_builders,
)
from testkit import vllm_harness as harness
from testkit.transport_standin import Faults, MemmoveTransport
from vllm_flagcx.compat import kv_cache, kv_layout
from vllm_flagcx.compat.connector_api import load_failure_fields, make_connector_output
from vllm_flagcx.connector.entry import FlagCXWorkerMetadata
from vllm_flagcx.connector.scheduler import reports_failures_per_request
from vllm_flagcx.connector.worker import WorkerHalf, WorkerSettings, model_page_bytes
from vllm_flagcx.layout.regions import ConvSplit
from vllm_flagcx.layout.topology import head_range
from vllm_flagcx.wire import auth
from vllm_flagcx.wire import handshake as hs

KV_HEADS, HEAD_DIM, BLOCK = 2, 256, 16


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
KEY_DIM, VALUE_DIM, SSM_HEADS, SSM_DIM, CONV_WIDTH = 64, 128, 4, 32, 3


@dataclass
class RankCaches:
    config: Any  # the rank's KVCacheConfig (per-rank specs)
    raw: list[torch.Tensor]
    caches: dict[str, Any]


def rank_kv_cache_config(tp: int, num_blocks: int, repeats: int = 2,
                         conv_layout: str = "SD") -> Any:
    """The KVCacheConfig one TP rank of the tiny hybrid sees (heads and channels / tp)."""
    heads = max(1, KV_HEADS // tp)
    attention = vllm_builders.make_full_attention_spec(block_size=BLOCK, num_kv_heads=heads,
                                                  head_size=HEAD_DIM, dtype=torch.bfloat16)
    page = attention.page_size_bytes
    conv_dim = (2 * KEY_DIM + VALUE_DIM) // tp
    conv_shape = (CONV_WIDTH, conv_dim) if conv_layout == "SD" else (conv_dim, CONV_WIDTH)
    gdn = vllm_builders.make_mamba_spec(block_size=BLOCK,
                                   shapes=(conv_shape,
                                           (SSM_HEADS // tp, SSM_DIM, SSM_DIM)),
                                   dtypes=(torch.bfloat16, torch.float32),
                                   mamba_type="gdn_attention", page_size_padded=page)
    layout = harness.HybridLayout(repeats=repeats, num_blocks=num_blocks)
    gdn_groups = [layout.gdn_layers[i::3] for i in range(3)]
    groups = [(layout.attention_layers, attention)] + [(n, gdn) for n in gdn_groups]
    tensors = [(page * num_blocks, [layout.attention_layers[r]] + [g[r] for g in gdn_groups])
               for r in range(repeats)]
    return vllm_builders.make_kv_cache_config(num_blocks=num_blocks, groups=groups, tensors=tensors)


DENSE_HEAD_DIM = 64


def dense_rank_kv_cache_config(tp: int, num_blocks: int, layers: int = 2,
                               dtype: Any = torch.bfloat16) -> Any:
    heads = max(1, KV_HEADS // tp)
    spec = vllm_builders.make_full_attention_spec(block_size=BLOCK, num_kv_heads=heads,
                                             head_size=DENSE_HEAD_DIM, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return vllm_builders.make_kv_cache_config(
        num_blocks=num_blocks, groups=[(names, spec)],
        tensors=[(spec.page_size_bytes * num_blocks, [n]) for n in names])


SLIDING_WINDOW = 32  # tokens: 2 blocks, so prompts of 100+ tokens leave it far behind


def sliding_rank_kv_cache_config(tp: int, num_blocks: int, layers: int = 2) -> Any:
    """Sliding-window + full attention (2 KV cache groups under HMA, Gemma/Mistral style):
    layer 0 full, the rest sliding, each layer its own tensor."""
    heads = max(1, KV_HEADS // tp)
    common = dict(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM,
                  dtype=torch.bfloat16)
    full = vllm_builders.make_full_attention_spec(**common)
    sliding = vllm_builders.make_full_attention_spec(**common, sliding_window=SLIDING_WINDOW)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return vllm_builders.make_kv_cache_config(
        num_blocks=num_blocks, groups=[(names[:1], full), (names[1:], sliding)],
        tensors=[(full.page_size_bytes * num_blocks, [n]) for n in names])


MLA_HEAD = 576  # kv_lora_rank 512 + rope 64, DeepSeek-style latent


def mla_rank_kv_cache_config(tp: int, num_blocks: int, layers: int = 2) -> Any:
    """MLA: every rank holds the whole latent (replicated across TP)."""
    spec = vllm_builders.make_mla_spec(block_size=BLOCK, head_size=MLA_HEAD, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return vllm_builders.make_kv_cache_config(
        num_blocks=num_blocks, groups=[(names, spec)],
        tensors=[(spec.page_size_bytes * num_blocks, [n]) for n in names])


# Single-group attention caches as each backend family declares them (vLLM 0.22's
# get_kv_cache_shape and get_kv_cache_stride_order): the physical order, and the
# permutation to the logical shape vLLM hands to register_kv_caches.
ATTN_LAYOUTS = {
    # FLASH_ATTN / FLEX_ATTENTION / ROCm: (2, B, N, H, D), HND stride order
    "flash_hnd": ("2BHND", (0, 1, 3, 2, 4)),
    # FLASHINFER with its HND stride order: (B, 2, N, H, D) stored (B, 2, H, N, D)
    "flashinfer_hnd": ("B2HND", (0, 1, 3, 2, 4)),
    # TRITON_ATTN, FLASHINFER NHD: (B, 2, N, H, D) stored as declared
    "triton_nhd": ("B2NHD", (0, 1, 2, 3, 4)),
}


def _attention_cache(raw: Any, dtype: Any, nb: int, h: int, n: int, dim: int,
                     layout: str) -> Any:
    physical, perm = ATTN_LAYOUTS[layout]
    sizes = {"2": 2, "B": nb, "H": h, "N": n, "D": dim}
    return raw.view(dtype).view(*(sizes[c] for c in physical)).permute(*perm)


def allocate(config: Any, conv_layout: str, seed: int, kernel_ratio: int = 1,
             attn_layout: str = "flash_hnd") -> RankCaches:
    """Random-filled caches viewed as vLLM does (one int8 buffer per KVCacheTensor)."""
    gen = torch.Generator().manual_seed(seed)
    specs = {n: g.kv_cache_spec for g in config.kv_cache_groups for n in g.layer_names}
    raws, caches = [], {}
    for size, names in kv_cache.kv_cache_tensors(config):
        raw = torch.randint(-128, 127, (size,), dtype=torch.int8, generator=gen)
        raws.append(raw)
        nb = config.num_blocks
        for name in names:
            spec = specs[name]
            page = spec.page_size_bytes
            if kv_cache.spec_kind(spec) is kv_cache.SpecKind.MAMBA:
                conv_shape, ssm_shape = spec.shapes  # storage order of the conv layout
                conv = torch.as_strided(raw.view(torch.bfloat16), (nb, *conv_shape),
                                        (page // 2, conv_shape[1], 1))
                conv_bytes = conv_shape[0] * conv_shape[1] * 2
                ssm = torch.as_strided(raw.view(torch.float32), (nb, *ssm_shape),
                                       (page // 4, ssm_shape[1] * ssm_shape[2], ssm_shape[2],
                                        1), storage_offset=conv_bytes // 4)
                caches[name] = [conv, ssm]
            elif kv_cache.spec_kind(spec) is kv_cache.SpecKind.MLA:
                caches[name] = raw.view(torch.bfloat16).view(nb, BLOCK, spec.head_size)
            elif len(config.kv_cache_groups) == 1:  # one backend family's own layout
                # vLLM allocates num_blocks * ratio kernel blocks of BLOCK // ratio tokens
                caches[name] = _attention_cache(raw, spec.dtype, nb * kernel_ratio,
                                                spec.num_kv_heads, BLOCK // kernel_ratio,
                                                spec.head_size, attn_layout)
            else:  # hybrid: attention restrided blocks-first so pages line up with GDN
                h = spec.num_kv_heads
                phys = raw.view(torch.bfloat16).view(nb, 2, h, BLOCK, HEAD_DIM)
                caches[name] = phys.permute(1, 0, 3, 2, 4)  # logical (2, B, N, H, D)
    return RankCaches(config, raws, caches)


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

    def step(self) -> None:
        out = self.scheduler.schedule()
        for new in out.scheduled_new_reqs:
            self.scheduled_blocks.setdefault(new.req_id, []).append(
                (new.num_computed_tokens, [list(g) for g in new.block_ids]))
        meta = out.kv_connector_metadata
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
        kv_out = make_connector_output(
            finished_sending=done_s or None, finished_recving=done_r or None,
            **load_failure_fields(failed=failed_now, invalid_blocks=invalid,
                                  per_request=reports_failures_per_request(
                                      kv_cache.group_facts(self.ranks[0].config)),
                                  worker_meta=FlagCXWorkerMetadata(failed_now)))
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
                   attn_layout: str = "flash_hnd") -> Instance:
    """``secret_file``: the side-channel secret (wire.auth) for the scheduler (through
    the extra config) and the workers."""
    hybrid = model == "hybrid"
    key = auth.load_key(secret_file)
    if secret_file:
        extra = {**(extra or {}), auth.SECRET_FILE_KEY: secret_file}
    config = harness.make_vllm_config(model=harness.HYBRID_MODEL if hybrid else
                                      harness.DENSE_MODEL, hma=True, kv_role=role,
                                      extra_config={"side_channel_port": port,
                                                    "lease_seconds": lease_seconds,
                                                    **({"transport": transport} if transport
                                                       else {"transport_factory":
                                                             "testkit.transport_standin:factory"}),
                                                    **(extra or {})},
                                      prefix_caching=prefix_caching)
    # The instance's TP size as its scheduler sees it (no worker processes run here).
    config.parallel_config.tensor_parallel_size = tp
    if model == "mla":
        rank_config = mla_rank_kv_cache_config(tp, num_blocks)
    elif model == "sliding":
        rank_config = sliding_rank_kv_cache_config(tp, num_blocks)
    elif hybrid:
        rank_config = rank_kv_cache_config(tp, num_blocks, conv_layout=conv_layout)
    else:
        rank_config = dense_rank_kv_cache_config(tp, num_blocks, dtype=dtype)
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
        regions = kv_layout.regions_for_kv_caches(caches.caches, caches.config, tp, KV_HEADS,
                                                  conv_layout, split)
        groups = kv_cache.group_facts(caches.config)
        layout = hs.LayoutFacts(
            model=model, dtype="bfloat16", kv_cache_dtype=str(dtype).removeprefix("torch."),
            group_kinds=tuple(g.kind.value for g in groups),
            block_sizes=tuple(g.block_size for g in groups),
            kernel_block_sizes=tuple(g.block_size // kernel_ratio for g in groups),
            page_bytes=model_page_bytes(regions, len(groups)), conv_layout=conv_layout,
            num_kv_heads=KV_HEADS, cache_format=cache_format)
        worker = WorkerHalf(WorkerSettings(engine_id=engine_id or role, tp_rank=rank,
                                           tp_size=tp,
                                           layout=layout, side_channel_port=port,
                                           lease_seconds=lease_seconds,
                                           recv_timeout=recv_timeout,
                                           handshake_timeout=2.0, peer_ttl=peer_ttl,
                                           verify_integrity=verify_integrity,
                                           test_faults=test_faults, key=key),
                            MemmoveTransport(faults))
        worker.register_regions(regions, serve=role == "kv_producer",
                                logical_num_blocks=caches.config.num_blocks)
        workers.append(worker)
    return Instance(scheduler, workers, ranks, tp)


def step_prefill(p: Instance, steps: int = 3) -> None:
    """A few prefill steps: its worker arms a finished request's transfer, and reports a
    released one in finished_sending, at the step after."""
    for _ in range(steps):
        p.step()


def run_prefill(p: Instance, prompts: list[int], timeout: float = 30.0) -> dict[str, Any]:
    """Prefill each prompt as the router does (max_tokens=1, a minted transfer id)."""
    records = {}
    for i, n in enumerate(prompts):
        tid = f"xfer-{i}-{time.monotonic_ns()}"
        req = harness.make_request(n, max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True,
                                                       "transfer_id": tid})
        p.scheduler.add_request(req)
        records[tid] = {"p_req": req.request_id, "tokens": n}
    deadline = time.monotonic() + timeout
    p_ids = {r["p_req"] for r in records.values()}
    while not p_ids <= set(finished_ids(p)) and time.monotonic() < deadline:
        p.step()
    params = {}
    for step in p.outputs:
        for eng in step.values():
            for o in eng.outputs:
                if o.kv_transfer_params:
                    params[o.kv_transfer_params["transfer_id"]] = o.kv_transfer_params
    for tid, rec in records.items():
        rec["params"] = params.get(tid)
    return records


def run_decode(p: Instance, d: Instance, records: dict[str, Any], max_tokens: int = 3,
               timeout: float = 60.0, remote_port_shift: int = 0, hasher: Any = None) -> None:
    """Send each prefilled request to decode with the params prefill returned; step both
    engines until neither holds a request (bounded)."""
    for rec in records.values():
        params = dict(rec["params"] or {})
        if params and remote_port_shift:
            params["remote_port"] += remote_port_shift
        req = harness.make_request(rec["tokens"], max_tokens=max_tokens,
                                   kv_transfer_params=params, hasher=hasher)
        d.scheduler.add_request(req)
        rec["d_req"] = req.request_id
    settle(p, d, timeout)


def busy(inst: Instance) -> bool:
    return inst.scheduler.has_requests() or harness.blocks_in_use(inst.scheduler) > 0


def settle(p: Instance, d: Instance, timeout: float = 60.0) -> None:
    """Step both engines until neither holds a request or a block (bounded)."""
    deadline = time.monotonic() + timeout
    while (busy(p) or busy(d)) and time.monotonic() < deadline:
        p.step()
        d.step()
        time.sleep(0.002)


def run_pd(p: Instance, d: Instance, prompts: list[int], max_tokens: int = 3,
           remote_port_shift: int = 0) -> dict[str, Any]:
    records = run_prefill(p, prompts)
    run_decode(p, d, records, max_tokens, remote_port_shift=remote_port_shift)
    return records


def aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def attention_block_bytes(inst: Instance, layer: str, block: int) -> Any:
    """(2, H_global, N, D) bytes of one attention block, gathered over the ranks."""
    parts = [None] * KV_HEADS
    for rank, caches in enumerate(inst.ranks):
        cache = caches.caches[layer]
        # (2, N, H_l, D) from either family: (2, B, ...) or (B, 2, ...)
        t = cache[:, block] if cache.shape[0] == 2 else cache[block]
        lo, hi = head_range(rank, inst.tp, KV_HEADS)
        for h in range(lo, hi):
            parts[h] = t[:, :, h - lo].contiguous().view(torch.uint8).numpy()
    return np.stack(parts, axis=1)


def finished_ids(instance: Instance) -> dict[str, str]:
    """request id -> finish reason, over every step's engine outputs."""
    out = {}
    for step in instance.outputs:
        for eng in step.values():
            for o in eng.outputs:
                if o.finish_reason is not None:
                    out[o.request_id] = str(o.finish_reason)
    return out


def prefill_process(conn: Any, port: int, model: str, prompts: list[int],
                    transport: str) -> None:
    """A prefill instance in its own process (spawned): prefill the prompts, send back the
    kv_transfer_params, serve pulls until told to stop, then send the bytes of the blocks
    it sent, per layer, for the parent to compare."""
    p = build_instance("kv_producer", 1, port, model=model, via_entry=True,
                       transport=transport)
    try:
        records = run_prefill(p, prompts)
        conn.send(records)
        while not conn.poll(0.002):
            p.step()
        conn.recv()
        settle(p, p, timeout=10)
        layers = p.ranks[0].config.kv_cache_groups[0].layer_names
        sent = {t.request_id: {layer: [attention_block_bytes(p, layer, b).tobytes()
                                       for b in t.block_ids[0]] for layer in layers}
                for t in p.send_tasks.values()}
        conn.send((sent, busy(p)))
    finally:
        p.shutdown()

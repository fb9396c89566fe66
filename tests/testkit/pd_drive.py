"""Driving instances of ``pd_instances`` the way vLLM's engine loop does: prefill steps,
decode steps, settling, and what tests read back (block bytes, finished ids); plus a
prefill instance in a spawned process. ``pd_harness`` re-exports these names."""


from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from testkit import cpu_platform  # noqa: F401 - first: spawned processes import it
from testkit import vllm_harness as harness
from testkit.pd_build import build_instance
from testkit.pd_caches import KV_HEADS
from testkit.pd_instances import Instance
from vllm_flagcx.layout.topology import head_range
from vllm_flagcx.wire.params import prefill_leg_params


def step_prefill(p: Instance, steps: int = 3) -> None:
    """A few prefill steps: its worker arms a finished request's transfer, and reports a
    released one in finished_sending, at the step after."""
    for _ in range(steps):
        p.step()


def run_prefill(p: Instance, prompts: list[int], timeout: float = 30.0,
                prefill_params: Callable[[int], dict[str, Any]] | None = None,
                request_id: Callable[[int], str] | None = None) -> dict[str, Any]:
    """Prefill each prompt as the router does (max_tokens=1, a minted transfer id), or
    with ``prefill_params(i)`` as the prefill leg's ``kv_transfer_params`` (another
    router's shape); records by transfer id (the request id where none was given).
    ``request_id(i)``: the prompt's request id (default: a fresh one)."""
    records = {}
    for i, n in enumerate(prompts):
        params = (prefill_params(i) if prefill_params is not None else
                  prefill_leg_params(f"xfer-{i}-{time.monotonic_ns()}"))
        req = harness.make_request(n, max_tokens=1, kv_transfer_params=params,
                                   request_id=request_id(i) if request_id else None)
        p.scheduler.add_request(req)
        tid = params.get("transfer_id") or req.request_id
        records[tid] = {"p_req": req.request_id, "tokens": n}
    deadline = time.monotonic() + timeout
    p_ids = {r["p_req"] for r in records.values()}
    while not p_ids <= set(finished_ids(p)) and time.monotonic() < deadline:
        p.step()
    params_by_tid = {}
    for step in p.outputs:
        for eng in step.values():
            for o in eng.outputs:
                if o.kv_transfer_params:
                    params_by_tid[o.kv_transfer_params["transfer_id"]] = o.kv_transfer_params
    for tid, rec in records.items():
        rec["params"] = params_by_tid.get(tid)
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
        rec["d_req"], rec["d_request"] = req.request_id, req
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
        cache, dims = caches.caches[layer], caches.attention_dims
        # one block, (2, N, H_l, D) or (2, H_l, N, D), whichever dims the layout declares
        t = cache.select(dims.index("B"), block)
        heads_dim = dims.replace("B", "").index("H")
        lo, hi = head_range(rank, inst.tp, KV_HEADS)
        for h in range(lo, hi):
            parts[h] = t.select(heads_dim, h - lo).contiguous().view(torch.uint8).numpy()
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


def assert_idle(inst: Instance) -> None:
    """No request left in the instance's scheduler and every KV block free."""
    assert not inst.scheduler.has_requests()
    assert harness.blocks_in_use(inst.scheduler) == 0


def assert_attention_bytes_moved(p: Instance, d: Instance, records: dict[str, Any]) -> None:
    """Every layer's K/V bytes of each request's blocks on decode equal prefill's (one
    attention group)."""
    for rec in records.values():
        send = next(t for t in p.send_tasks.values() if t.request_id == rec["p_req"])
        recv = d.recv_tasks[rec["d_req"]]
        for layer in p.ranks[0].config.kv_cache_groups[0].layer_names:
            for pb, db in zip(send.block_ids[0][-len(recv.block_ids[0]):],
                              recv.block_ids[0], strict=True):
                np.testing.assert_array_equal(attention_block_bytes(d, layer, db),
                                              attention_block_bytes(p, layer, pb))

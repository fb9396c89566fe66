"""B1: planning cost per request, ours against vLLM NIXL's own descriptor-id code.

From "request metadata in hand" to "arrays ready for the transport":

* ours: ``layout.plans.plan_transfer`` (kernel-block expansion, per-region addresses,
  coalescing) -> uint64 src/dst/length arrays, as the prefill worker calls it per pull;
* NIXL (the installed vLLM's ``NixlBaseConnectorWorker``): ``_logical_to_kernel_block_ids``
  and ``_compute_desc_ids`` for the remote and the local side, as ``_read_blocks`` calls
  them before ``make_prepped_xfer``. Their own methods are called on an object holding only
  the attributes they read (the worker needs a GPU and NIXL to construct); the native
  ``make_prepped_xfer`` (44-74 ns per descriptor, NIXL PR #430) is not included, so the
  NIXL column is a lower bound of its cost.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from benchmarks import layout as L
from benchmarks import report, use_test_helpers
from vllm_flagcx.layout import plans


def nixl_planner(num_blocks: int, ratio: int) -> Any | None:
    """A callable planning one request with NIXL's code, or None when this vLLM has no
    NIXL connector of that shape."""
    use_test_helpers()
    try:
        import torch
        from testkit import vllm_builders
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
            NixlBaseConnectorWorker as W,
        )
    except Exception:  # no NIXL connector in this vLLM: reported as "n/a"
        return None
    if not hasattr(W, "_compute_desc_ids") or not hasattr(W, "_logical_to_kernel_block_ids"):
        return None
    fa = vllm_builders.make_full_attention_spec(block_size=L.BLOCK_TOKENS, num_kv_heads=1,
                                                head_size=256, dtype=torch.uint8)
    gdn = vllm_builders.make_mamba_spec(block_size=L.BLOCK_TOKENS,
                                        shapes=[(3, 1024), (4, 128, 128)],
                                        dtypes=[torch.bfloat16, torch.float32])
    specs = [fa] + [gdn] * L.GDN_GROUPS
    me = SimpleNamespace(
        _has_mamba=True, _conv_decomp=SimpleNamespace(local_conv_offsets=[0, 1, 2]),
        _ssm_region_indices=list(range(L.FA_LAYERS)), block_len_per_layer=[L.PAGE] * 10,
        num_regions=L.FA_LAYERS, _group_spec_types=[type(s) for s in specs],
        _ple_group_index=None,
        kv_cache_config=SimpleNamespace(
            transfer_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs]))
    regions = [r for _ in range(L.NUM_GROUPS) for r in range(L.FA_LAYERS)]
    keys = [g for g in range(L.NUM_GROUPS) for _ in range(L.FA_LAYERS)]

    def plan(remote_ids: list[list[int]], local_ids: list[list[int]]) -> int:
        remote = W._logical_to_kernel_block_ids(me, remote_ids, ratio)
        local = W._logical_to_kernel_block_ids(me, local_ids, ratio)
        r = W._compute_desc_ids(me, block_ids=remote, dst_num_blocks=num_blocks * ratio,
                                block_size_ratio=None, physical_blocks_per_logical=ratio,
                                pairs=(regions, keys))
        loc = W._compute_desc_ids(me, block_ids=local, dst_num_blocks=num_blocks * ratio,
                                  block_size_ratio=None, physical_blocks_per_logical=ratio,
                                  pairs=(regions, keys))
        assert len(r) == len(loc)
        return len(r)

    return plan


def run(quick: bool) -> dict[str, Any]:
    num_blocks = 600 if quick else 2000
    reps = 50 if quick else 1000
    tokens_list = (1024, 32768) if quick else L.REQUEST_TOKENS
    rows, out, tables = [], [], []
    for ratio in (1, 33):
        p_side = L.rank_layout(num_blocks, ratio, base=1 << 40)
        d_side = L.rank_layout(num_blocks, ratio, base=1 << 42)
        nixl = nixl_planner(num_blocks, ratio)
        pair = plans.RankPair(0, L.TP, 0, L.TP)
        # Once per peer (the worker caches it by the receiver's incarnation and rank), as
        # NIXL builds its descriptor lists once per peer at the handshake.
        table_us = report.summary(report.time_us(
            lambda p=p_side, d=d_side, pr=pair: plans.build_table(p.regions, d.regions, pr,
                                                                L.NUM_GROUPS), 20))
        table = plans.build_table(p_side.regions, d_side.regions, pair, L.NUM_GROUPS)
        tables.append({"ratio": ratio, "build_us": table_us})
        for tokens in tokens_list:
            for pattern in L.PATTERNS:
                p_ids = L.block_ids(tokens, num_blocks, pattern, seed=1)
                d_ids = L.block_ids(tokens, num_blocks, pattern, seed=2)

                def ours(p_ids=p_ids, d_ids=d_ids, table=table, ratios=(ratio, 1, 1, 1)):
                    return table.plan(p_ids, d_ids, ratios)

                plan = ours()
                reference = plans.plan_transfer(p_side.regions, d_side.regions, p_ids, d_ids,
                                                pair, kernel_ratios=[ratio, 1, 1, 1])
                assert reference.num_descriptors == plan.num_descriptors
                assert plan.num_bytes == L.request_bytes(tokens), (plan.num_bytes, tokens)
                mine = report.summary(report.time_us(ours, reps))
                entry = {"ratio": ratio, "tokens": tokens, "pattern": pattern,
                         "ours_us": mine, "ours_descriptors": plan.num_descriptors,
                         "bytes_per_descriptor": plan.num_bytes / plan.num_descriptors}
                if nixl is not None:
                    theirs = report.summary(report.time_us(
                        lambda p=p_ids, d=d_ids, planner=nixl: planner(p, d), reps))
                    entry.update(nixl_us=theirs, nixl_descriptors=nixl(p_ids, d_ids),
                                 ratio_to_nixl=mine["median"] / theirs["median"])
                out.append(entry)
                rows.append((ratio, tokens, pattern, plan.num_descriptors,
                             entry.get("nixl_descriptors", "n/a"), mine["median"], mine["p99"],
                             entry.get("nixl_us", {}).get("median", "n/a"),
                             entry.get("ratio_to_nixl", "n/a")))
    text = report.table(
        f"B1 plan cost per request (pool {num_blocks} blocks, {reps} reps; NIXL = its "
        "desc-id code without make_prepped_xfer)",
        ("kernel ratio", "tokens", "block ids", "our descs", "NIXL descs", "ours us p50",
         "ours us p99", "NIXL us p50", "ours/NIXL"), rows)
    text += "\nplan table per peer (once, at the first pull): " + ", ".join(
        f"kernel ratio {t['ratio']}: {t['build_us']['median']:.0f} us" for t in tables)
    return {"name": "b1_plan", "text": text, "rows": out, "tables": tables}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    rows = [r for r in result["rows"] if r["pattern"] == "contiguous" or r["tokens"] == 32768]
    labels = [f"r{r['ratio']} {r['tokens'] // 1024}k {r['pattern'][:4]}" for r in rows]
    series = {"FlagCX plan (us p50)": [r["ours_us"]["median"] for r in rows]}
    if all("nixl_us" in r for r in rows):
        series["NIXL desc ids (us p50)"] = [r["nixl_us"]["median"] for r in rows]
    report.bar_chart(out_dir, "b1_plan", "B1 planning cost per request", labels, series,
                     "microseconds", log=True)

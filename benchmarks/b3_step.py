"""B3: cost per engine step of the connector's scheduler side, on the real vLLM Scheduler.

A decode instance's scheduler (vLLM's own ``Scheduler``, ``KVCacheManager``, ``Request``)
steps 4 generating requests while N requests wait for their KV from a remote prefill
(``do_remote_prefill``; the transfer never completes, so they stay in flight). Each step
is ``schedule()`` + ``update_from_output()`` with a model output, as the engine core does;
the connector metadata is pickled as vLLM ships it to the workers. The same trace runs
with FlagCXConnector, with vLLM's NixlConnector (its scheduler side only; no NIXL agent
is needed there), and without a connector (the baseline, N = 0). Reported: microseconds
per step added over the baseline, and metadata bytes per step.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from benchmarks import report, use_test_helpers

RUNNING = 4
PROMPT = 64  # tokens of each waiting request (4 blocks of 16)
CLOSED_PORT = 9  # discard: nothing listens on loopback, heartbeats fail fast


def _harness() -> Any:
    use_test_helpers()
    from testkit import (
        cpu_platform,  # noqa: F401 - vLLM's CPU platform before vLLM loads
        vllm_harness,
    )

    return vllm_harness


def _params(kind: str, i: int) -> dict[str, Any]:
    if kind == "flagcx":
        from vllm_flagcx.wire.params import remote_prefill_params

        return remote_prefill_params(transfer_id=f"t{i}", host="127.0.0.1", port=CLOSED_PORT,
                                     tp_size=1, engine_id="prefill", block_sizes=[16])
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": list(range(1 + 4 * i, 5 + 4 * i)),
            "remote_engine_id": "prefill", "remote_request_id": f"p{i}",
            "remote_host": "127.0.0.1", "remote_port": CLOSED_PORT, "tp_size": 1}


def _scheduler(h: Any, kind: str) -> Any:
    connector = {"none": None, "flagcx": h.CONNECTOR, "nixl": "NixlConnector"}[kind]
    module = h.CONNECTOR_MODULE if kind == "flagcx" else None
    config = h.make_vllm_config(connector=connector, module_path=module,
                                kv_role="kv_consumer", max_model_len=2048)
    return h.make_scheduler(config, h.dense_kv_cache_config(num_blocks=2048))


HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "request_finished_all_groups",
         "get_finished_count", "take_events")


def _time_hooks(connector: Any) -> list[int]:
    """Wrap the connector's scheduler-side hooks to add their wall time (ns) to a counter:
    the part of a step spent inside the connector itself, not in vLLM's own handling of
    the waiting requests."""
    spent = [0]
    for name in HOOKS:
        fn = getattr(connector, name, None)
        if fn is None:
            continue

        def timed(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter_ns() - start

        setattr(connector, name, timed)
    return spent


def _steps(h: Any, kind: str, in_flight: int, steps: int
           ) -> tuple[list[float], list[int], list[float]]:
    scheduler = _scheduler(h, kind)
    connector = getattr(scheduler, "connector", None)
    spent = _time_hooks(connector) if connector is not None else [0]
    for _ in range(RUNNING):
        scheduler.add_request(h.make_request(32, max_tokens=10_000))
    for i in range(in_flight):
        scheduler.add_request(h.make_request(PROMPT, max_tokens=4,
                                             kv_transfer_params=_params(kind, i)))
    times, meta, hooks = [], [], []
    for step in range(steps + 5):
        spent[0] = 0
        start = time.perf_counter_ns()
        out = scheduler.schedule()
        blob = pickle.dumps(out.kv_connector_metadata) if kind != "none" else b""
        scheduler.update_from_output(out, h.model_output(out))
        if step >= 5:  # the first steps admit requests: not the steady state
            times.append((time.perf_counter_ns() - start) / 1e3)
            meta.append(len(blob))
            hooks.append(spent[0] / 1e3)
    waiting = sum("REMOTE_KVS" in str(r.status) for r in scheduler.requests.values())
    if kind != "none" and waiting < in_flight:
        raise AssertionError(f"{kind}: only {waiting} of {in_flight} requests still wait for "
                             "their KV: the trace is not what B3 measures")
    shutdown = getattr(scheduler, "shutdown", None)
    if shutdown is not None:
        shutdown()
    return times, meta, hooks


def run(quick: bool) -> dict[str, Any]:
    h = _harness()
    steps = 60 if quick else 400
    loads = (0, 8, 64) if quick else (0, 1, 8, 64, 256)
    base_times, _, _ = _steps(h, "none", 0, steps)
    base = report.summary(base_times)
    rows, out = [], []
    for kind in ("flagcx", "nixl"):
        for n in loads:
            try:
                times, meta, hooks = _steps(h, kind, n, steps)
            except Exception as exc:  # the peer connector may not build on this vLLM
                print(f"B3: {kind} with {n} in flight not measured: {exc}", flush=True)
                continue
            s = report.summary(times)
            entry = {"connector": kind, "in_flight": n, "step_us": s,
                     "added_us": s["median"] - base["median"],
                     "hooks_us": report.summary(hooks),
                     "metadata_bytes": sorted(meta)[len(meta) // 2]}
            out.append(entry)
    by = {(e["connector"], e["in_flight"]): e for e in out}
    for n in loads:
        ours, theirs = by.get(("flagcx", n)), by.get(("nixl", n))
        row: list[Any] = [n]
        for e in (ours, theirs):
            row += ([e["step_us"]["median"], e["added_us"], e["hooks_us"]["median"],
                     e["metadata_bytes"]] if e else ["n/a"] * 4)
        rows.append(tuple(row))
    text = report.table(
        f"B3 scheduler step with N requests waiting for remote KV ({RUNNING} generating; "
        f"{steps} steps; baseline without connector {base['median']:.1f} us/step)",
        ("in flight", "FlagCX us/step", "added", "in hooks", "meta B", "NIXL us/step",
         "added", "in hooks", "meta B"), rows)
    text += ("\nadded = step time over the no-connector baseline (includes vLLM's own "
             "handling of the waiting requests); in hooks = time inside the connector's "
             "scheduler-side methods")
    return {"name": "b3_step", "text": text, "baseline_us": base, "rows": out}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    loads = sorted({r["in_flight"] for r in result["rows"]})
    series = {}
    for kind, label in (("flagcx", "FlagCX"), ("nixl", "NIXL")):
        rows = {r["in_flight"]: r for r in result["rows"] if r["connector"] == kind}
        if len(rows) == len(loads):
            series[f"{label}: added per step"] = [rows[n]["added_us"] for n in loads]
            series[f"{label}: in its hooks"] = [rows[n]["hooks_us"]["median"] for n in loads]
    report.bar_chart(out_dir, "b3_step", "B3 scheduler cost per engine step",
                     [f"{n} in flight" for n in loads], series, "microseconds")

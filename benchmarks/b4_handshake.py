"""B4: first-request handshake on loopback, region table included.

A prefill worker half (``connector.worker.WorkerHalf``, the Qwen3.6 TP-8 rank's 40 regions)
serves its side channel in another process. Decode does what its first pull to an unknown
prefill does: a new ZMQ context and socket, ``HandshakeRequest`` -> fact sheet, the
compatibility check, the region table decoded into ``Region``s, and the transport's
``connect`` to the advertised description. Cold = a new context each time (what a fresh
decode worker pays); warm = the context kept, a new socket per handshake (a re-handshake
after the sheet's TTL). Process and interpreter start are excluded.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from benchmarks import layout as L
from benchmarks import peer, report, use_test_helpers
from vllm_flagcx.transport.local import LocalTransport
from vllm_flagcx.wire import client
from vllm_flagcx.wire import handshake as hs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(quick: bool) -> dict[str, Any]:
    import zmq

    reps = 20 if quick else 200
    port = _free_port()
    local = hs.make_sheet(layout=peer.layout_facts(), engine_id="bench-decode",
                          incarnation="d", tp_size=L.TP, tp_rank=0)
    transport = LocalTransport()
    parts: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}, "kept": {}}
    small: dict[str, list[float]] = {"new connection": [], "kept connection": []}
    use_test_helpers()
    from testkit import peers

    with peers.spawned(peer.prefill_side_channel, port, 2000, start_timeout=120,
                       stop="stop"):
        shared = zmq.Context()
        channels = client.Channels(shared)
        for mode in ("cold", "warm", "kept"):
            for _ in range(reps):
                t0 = time.perf_counter_ns()
                ctx = zmq.Context() if mode == "cold" else shared
                ask = channels.ask if mode == "kept" else partial(client.ask, ctx)
                reply = ask("127.0.0.1", port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0),
                            5.0)
                t1 = time.perf_counter_ns()
                assert isinstance(reply, hs.HandshakeReply), reply
                hs.check_compatible(local, reply.sheet)
                regions = list(reply.sheet.regions)
                t2 = time.perf_counter_ns()
                transport.connect(reply.sheet.transport_desc)
                t3 = time.perf_counter_ns()
                if mode == "cold":
                    ctx.term()
                assert len(regions) == L.FA_LAYERS * L.NUM_GROUPS
                for key, value in (("round trip", t1 - t0), ("check + regions", t2 - t1),
                                   ("transport connect", t3 - t2), ("total", t3 - t0)):
                    parts[mode].setdefault(key, []).append(value / 1e6)
        beat = hs.Heartbeat(("bench-unknown-transfer",))  # the smallest message
        for _ in range(reps * 5):
            for label, ask in (("new connection", partial(client.ask, shared)),
                               ("kept connection", channels.ask)):
                t0 = time.perf_counter_ns()
                ask("127.0.0.1", port, beat, 5.0)
                small[label].append((time.perf_counter_ns() - t0) / 1e6)
        channels.close()
        shared.term()
    out = {mode: {k: report.summary(v) for k, v in d.items()} for mode, d in parts.items()}
    rows = [(mode, key, s["median"], s["p99"]) for mode, d in out.items()
            for key, s in d.items()]
    sheet_bytes = len(hs.encode(hs.HandshakeReply(reply.sheet)))
    text = report.table(f"B4 first-request handshake on loopback ({reps} reps, fact sheet "
                        f"{sheet_bytes:,} B with {len(regions)} regions)",
                        ("mode", "part", "ms p50", "ms p99"), rows)
    new, kept = (report.summary(small[k]) for k in ("new connection", "kept connection"))
    text += "\n" + report.table(
        f"B4b side-channel message round trip (Heartbeat, {reps * 5} reps, interleaved; "
        "issue 27: a kept connection per peer)", ("connection", "ms p50", "ms p99"),
        [("new per message", new["median"], new["p99"]),
         ("kept (wire.client.Channels)", kept["median"], kept["p99"])])
    text += f"\nratio kept / new (p50): {kept['median'] / new['median']:.2f}"
    return {"name": "b4_handshake", "text": text, "parts": out, "sheet_bytes": sheet_bytes,
            "message_round_trip": {"new": new, "kept": kept}}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    keys = ["round trip", "check + regions", "transport connect", "total"]
    report.bar_chart(out_dir, "b4_handshake", "B4 handshake (ms, p50)", keys,
                     {mode: [result["parts"][mode][k]["median"] for k in keys]
                      for mode in ("cold", "warm")}, "milliseconds")

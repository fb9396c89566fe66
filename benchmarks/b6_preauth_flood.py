"""B6: a flood of unauthenticated bytes against a prefill side channel with a secret.

The attack of the side-channel review: 4 connections that complete ZMTP's NULL greeting
and push 48-frame messages of 15 MiB frames (before: prefill's RSS 851 MB -> 4,075 MB,
handshakes up to 3 s). With a secret the channel is CURVE (``wire.curve``): a NULL peer
fails the greeting and is disconnected before a frame is read. Measured in one run, in
the prefill process (Qwen3.6's TP-8 region table, another process): its RSS and the
round trip of authenticated handshakes, without the flood (the baseline) and during it.
The flooder is this process, over raw loopback sockets; every loop is time-bounded.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

from benchmarks import peer, report, use_test_helpers
from vllm_flagcx.wire import auth, client, endpoints
from vllm_flagcx.wire import handshake as hs

SECRET = "bench-secret-of-32-characters!!!"
FRAME = 15 << 20
CONNECTIONS = 4


def _greeting() -> bytes:
    """ZMTP 3.0 greeting, NULL mechanism, then a READY command of a REQ socket."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
    greeting += b"\0" + b"\0" * 31
    prop = b"\x0bSocket-Type" + struct.pack(">I", 3) + b"REQ"
    body = b"\x05READY" + prop
    return greeting + b"\x04" + bytes([len(body)]) + body


def _connect(port: int, unix: bool) -> socket.socket:
    """A raw connection to the side channel: its TCP port, or (``unix``) its socket."""
    if not unix:
        return socket.create_connection(("127.0.0.1", port), timeout=1.0)
    path = endpoints.local_socket("127.0.0.1", port)
    if path is None:
        raise FileNotFoundError(f"no side-channel socket for port {port}")
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1.0)
    s.connect(path)
    return s


def _flood(port: int, seconds: float, sent: list[int], frames: int = 48,
           unix: bool = False) -> None:
    chunk = b"\x03" + struct.pack(">Q", FRAME) + b"x" * FRAME  # long frame, more follows
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with _connect(port, unix) as s:
                s.sendall(_greeting())
                for _ in range(frames):
                    if time.monotonic() > deadline:
                        return
                    s.sendall(chunk)
                    sent[0] += len(chunk)
        except OSError:
            time.sleep(0.01)  # refused or reset: the server dropped us; try again


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _handshakes(port: int, key: bytes, seconds: float) -> list[float]:
    import zmq

    out, ctx = [], zmq.Context.instance()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        reply = client.ask(ctx, "127.0.0.1", port, hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0),
                           5.0, key=key)
        out.append((time.perf_counter() - t0) * 1e3)
        assert isinstance(reply, hs.HandshakeReply), reply
        time.sleep(0.05)
    return out


def _control_growth(seconds: float) -> tuple[float, int]:
    """The flooder against a side channel WITHOUT a secret (NULL mechanism, which reads
    frames before any check), over its Unix socket as the engine's own user (another
    user cannot connect: the socket's directory is 0700): prefill's RSS growth, bytes
    taken. Shows the flood is real, so B6's CURVE row can fail. One connection of 20
    frames (300 MB) at most."""
    from testkit import peers

    from benchmarks.b4_handshake import _free_port

    port = _free_port()
    with peers.spawned(peer.keyed_prefill_side_channel, port, 2000, "",
                       start_timeout=120, stop="stop") as (_, pid):
        before, sent = _rss_mb(pid), [0]
        flooder = threading.Thread(target=_flood, args=(port, seconds, sent, 20, True),
                                   daemon=True)
        flooder.start()
        peak = before
        while flooder.is_alive():
            peak = max(peak, _rss_mb(pid))
            flooder.join(timeout=0.05)
        return peak - before, sent[0]


def run(quick: bool) -> dict[str, Any]:
    from benchmarks.b4_handshake import _free_port

    seconds = 2.0 if quick else 8.0
    port = _free_port()
    key = auth.load_key(environ={auth.SECRET_ENV: SECRET})
    assert key is not None
    use_test_helpers()
    from testkit import peers

    with peers.spawned(peer.keyed_prefill_side_channel, port, 2000, SECRET,
                       start_timeout=120, stop="stop") as (_, pid):
        before = _rss_mb(pid)
        quiet = _handshakes(port, key, seconds)
        sent = [0]
        flooders = [threading.Thread(target=_flood, args=(port, seconds, sent), daemon=True)
                    for _ in range(CONNECTIONS)]
        for t in flooders:
            t.start()
        peak, flooded = before, _handshakes(port, key, seconds)
        for t in flooders:
            t.join(timeout=seconds + 5)
            peak = max(peak, _rss_mb(pid))
    control_growth, control_sent = _control_growth(min(seconds, 3.0))
    q, f = report.summary(quiet), report.summary(flooded)
    rows = [("secret, no flood", f"{before:.0f}", "", "", q["median"], q["p99"]),
            (f"secret, {CONNECTIONS} flooders", f"{peak:.0f}", f"{peak - before:+.0f}",
             f"{sent[0] / 1e6:,.0f}", f["median"], f["p99"]),
            ("control: no secret, same uid, 1 flooder", "", f"{control_growth:+.0f}",
             f"{control_sent / 1e6:,.0f}", "", "")]
    text = report.table(
        f"B6 unauthenticated flood vs a prefill side channel ({seconds:g} s phases; RSS of "
        "the prefill process in MB, frame bytes the server took in MB, handshake ms)",
        ("phase", "RSS MB", "RSS growth", "MB taken", "handshake p50", "p99"), rows)
    text += (f"\nratio: handshake p99 flooded / quiet = {f['p99'] / q['p99']:.2f}")
    return {"name": "b6_preauth_flood", "text": text, "rss_before_mb": before,
            "rss_peak_mb": peak, "taken_bytes": sent[0], "quiet_ms": q, "flooded_ms": f,
            "control_growth_mb": control_growth, "control_taken_bytes": control_sent}


def chart(result: dict[str, Any], out_dir: Any) -> None:
    report.bar_chart(out_dir, "b6_preauth_flood", "B6 handshake under a pre-auth flood (ms)",
                     ["p50", "p99"],
                     {"quiet": [result["quiet_ms"]["median"], result["quiet_ms"]["p99"]],
                      "flooded": [result["flooded_ms"]["median"],
                                  result["flooded_ms"]["p99"]]}, "milliseconds")

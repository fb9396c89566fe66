"""Seeded fuzzing of what crosses a process boundary: prefill's side channel (real worker
and server over loopback, real vLLM Scheduler) and the router's HTTP API (stand-in
upstreams). Every case is bounded and reproducible from its seed.

A seeded generator rather than hypothesis: the project keeps its test dependencies to
pytest (pyproject.toml), and these inputs need no shrinking to be understood: each failing
case is printed whole.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import msgspec
import zmq
from testkit import pd_harness as pd
from testkit import router_standin as rs

from vllm_flagcx.router.app import build_app
from vllm_flagcx.router.legs import Instance, Pool, RouterSettings
from vllm_flagcx.router.proxy import Proxy
from vllm_flagcx.wire import client, endpoints
from vllm_flagcx.wire import handshake as hs

SEED = 20261204
CASES = 150


def _weird_int(rng: random.Random) -> int:
    return rng.choice([0, -1, 1, 2, 1 << 31, -(1 << 31), (1 << 63) - 1, -(1 << 63),
                       rng.randrange(-1000, 1000)])


def _weird_str(rng: random.Random) -> str:
    return rng.choice(["", "x" * rng.randrange(0, 3000), "\u0000", "é", "a/b", "../../etc"])


def _mutated(rng: random.Random, good: hs.PullRequest) -> hs.Message:
    """A message of a real type whose fields a hostile or buggy peer chose."""
    sheet = good.sheet
    kind = rng.randrange(7)
    if kind == 0:
        return hs.PullRequest(_weird_str(rng), sheet, good.block_ids)
    if kind == 1:
        ids = tuple(tuple(_weird_int(rng) for _ in range(rng.randrange(0, 5)))
                    for _ in range(rng.randrange(0, 4)))
        return hs.PullRequest(good.transfer_id, sheet, ids)
    if kind == 2:
        return hs.PullRequest(good.transfer_id, msgspec.structs.replace(
            sheet, tp_size=_weird_int(rng), tp_rank=_weird_int(rng)), good.block_ids)
    if kind == 3:
        regions = tuple(msgspec.structs.replace(r, base=abs(_weird_int(rng)),
                                                num_blocks=abs(_weird_int(rng)))
                        for r in sheet.regions)
        return hs.PullRequest(good.transfer_id, msgspec.structs.replace(
            sheet, regions=regions, incarnation=_weird_str(rng)), good.block_ids)
    if kind == 4:
        return hs.Heartbeat(tuple(_weird_str(rng) for _ in range(rng.randrange(0, 50))))
    if kind == 5:
        return hs.HandshakeRequest(_weird_int(rng), _weird_int(rng))
    return hs.PullRequest(good.transfer_id, sheet, good.block_ids,
                          tuple(rng.choice([None, _weird_int(rng)]) for _ in range(3)))


def _frames(rng: random.Random, good: hs.PullRequest) -> list[bytes]:
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 200))]
    if kind == 1:  # valid msgpack, wrong shape
        return [msgspec.msgpack.encode(rng.choice([None, 1, "pull", [1, 2], {"type": "pull"},
                                                   {"type": "release"}]))]
    if kind == 2:  # a real message, truncated
        data = hs.encode(_mutated(rng, good))
        return [data[:rng.randrange(0, max(1, len(data)))]]
    return [hs.encode(_mutated(rng, good))]


def test_side_channel_survives_fuzzed_messages_and_still_serves_a_real_request():
    rng = random.Random(SEED)
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", lease_seconds=2.0)
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=1, model="dense")
    context = zmq.Context.instance()
    try:
        records = pd.run_prefill(p, [37])
        good = hs.PullRequest(next(iter(records)), d.workers[0].sheet,
                              ((1, 2, 3),) * len(d.workers[0].sheet.layout.block_sizes))
        for case in range(CASES):
            frames = _frames(rng, good)
            if rng.random() < 0.2:  # no REQ envelope at all
                dealer = context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(endpoints.address("127.0.0.1", port))
                dealer.send_multipart(frames * rng.randrange(1, 4))
                dealer.close()
                continue
            sock = context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoints.address("127.0.0.1", port))
            sock.send(frames[0])
            if sock.poll(3000):  # parked pulls may not answer before their lease ends
                answer = hs.decode(sock.recv())
                assert isinstance(answer, hs.Message.__args__), (case, frames)  # type: ignore[attr-defined]
            sock.close()
        assert p.workers[0].server is not None and p.workers[0].server.alive
        answer = client.ask(context, "127.0.0.1", port,
                            hs.HandshakeRequest(hs.PROTOCOL_VERSION, 0), 5.0)
        assert isinstance(answer, hs.HandshakeReply)
        time.sleep(2.5)  # fuzzed pulls parked for unknown ids expire
        records = pd.run_pd(p, d, [37, 70])  # a real request end to end, afterwards
        assert all(r["d_req"] in pd.finished_ids(d) for r in records.values())
        assert d.workers[0].observations.total("bytes_transferred")[1] > 0
        assert sum(d.workers[0].ledger.counts.values()) == 0
        assert not pd.busy(p) and not pd.busy(d)
    finally:
        p.shutdown()
        d.shutdown()


def _json_value(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(8 if depth < 4 else 5)
    if choice == 0:
        return rng.choice([None, True, False])
    if choice == 1:
        return rng.choice([0, -1, 1.5, 10**30, -(10**30)])
    if choice == 2:
        return rng.choice(["", "false", "0", "true", "x" * 100, "é\u2028"])
    if choice == 3:
        return rng.choice(["stream", "max_tokens", "prompt", "messages"])
    if choice == 4:
        return rng.randrange(-5, 5)
    if choice in (5, 6):
        return {rng.choice(["stream", "prompt", "max_tokens", "kv_transfer_params",
                            "messages", "n", "stop"]): _json_value(rng, depth + 1)
                for _ in range(rng.randrange(0, 5))}
    return [_json_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]


def test_router_answers_every_fuzzed_body_with_a_status_and_json_error():
    rng = random.Random(SEED)
    with rs.upstream("prefill") as up_p, rs.upstream("decode") as up_d:
        proxy = Proxy(Pool("prefill", [Instance(up_p.url, "prefill")]),
                      Pool("decode", [Instance(up_d.url, "decode")]), RouterSettings())
        with rs.serving(build_app(proxy)) as port:
            url = f"http://127.0.0.1:{port}"
            for case in range(CASES):
                if rng.random() < 0.3:
                    raw = rng.randbytes(rng.randrange(0, 100))
                else:
                    body = _json_value(rng)
                    if isinstance(body, dict) and rng.random() < 0.5:
                        body = {"model": "demo", "prompt": "hi", **body}
                    raw = json.dumps(body).encode()
                path = rng.choice(["/v1/completions", "/v1/chat/completions"])
                r = httpx.post(url + path, content=raw, timeout=20)
                # 4xx/502 from the router or passed on from an upstream; never a 500 (a
                # router bug) and never an error without a JSON message.
                assert r.status_code != 500, (case, raw, r.text)
                if r.status_code != 200:
                    assert "message" in r.json()["error"], (case, raw, r.text)
            assert all(i.in_flight == 0 for i in proxy.decode.instances + proxy.prefill.instances)
            assert not proxy.counters["router_errors"]

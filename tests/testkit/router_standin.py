"""STAND-IN upstreams for the router's unit tests: a vLLM-like OpenAI server and a prefill
side channel, each a few lines, on loopback.

The real thing (vLLM engines with the connector) runs in ``test_e2e.py``; these exist so
the router's failure paths (HTTP errors, dead sockets, cut streams, slow legs, client
disconnects) are tested fast, in every env, with exact control over what fails when.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Upstream:
    """What the stand-in server does and what it saw."""

    role: str
    status: int = 200
    delay: float = 0.0
    text: str = "hello"
    return_params: bool = True
    cut_stream_after: int | None = None  # chunks, then the connection drops
    raw_body: bytes | None = None  # answer 200 with exactly these bytes (not JSON, say)
    prompt_ids: Any = None  # prefill: choices[0].prompt_token_ids when return_token_ids
    token_ids: Any = None  # choices[0].token_ids (the output's) when return_token_ids
    finish_reason: str = "length"
    usage: Any = None  # the answer's usage (streams: a last event when include_usage)
    seen: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def params(self, body: dict[str, Any]) -> dict[str, Any]:
        tid = body["kv_transfer_params"]["transfer_id"]
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                "remote_host": "127.0.0.1", "remote_port": 1, "remote_tp_size": 1,
                "remote_engine_id": "standin", "remote_block_sizes": [16]}


def _app(up: Upstream) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({}, status_code=up.status)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "demo", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        up.seen.append(body)
        # Like vLLM's server (``with_cancellation``): a request whose client went away is
        # aborted.
        until = time.monotonic() + up.delay
        while time.monotonic() < until:
            if await request.is_disconnected():
                up.cancelled += 1
                return JSONResponse({}, 499)
            await asyncio.sleep(0.05)
        if up.status != 200:
            return JSONResponse({"error": {"message": f"{up.role} says no"}}, up.status)
        if up.raw_body is not None:
            return Response(up.raw_body, 200, media_type="application/json")
        if body.get("stream"):
            async def events():
                for i, word in enumerate(up.text.split()):
                    if up.cut_stream_after is not None and i >= up.cut_stream_after:
                        raise RuntimeError("stand-in decode dies mid-stream")
                    chunk = {"choices": [{"index": 0, "text": word}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if up.usage is not None and (body.get("stream_options") or {}).get(
                        "include_usage"):
                    yield f"data: {json.dumps({'choices': [], 'usage': up.usage})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        out: dict[str, Any] = {"id": f"cmpl-{up.role}", "created": 1, "model": "demo",
                               "choices": [{"index": 0, "text": up.text,
                                            "finish_reason": up.finish_reason}]}
        if up.usage is not None:
            out["usage"] = up.usage
        if body.get("return_token_ids") and up.prompt_ids is not None:
            out["choices"][0]["prompt_token_ids"] = up.prompt_ids  # as vLLM answers it
        if body.get("return_token_ids") and up.token_ids is not None:
            out["choices"][0]["token_ids"] = up.token_ids
        if up.role == "prefill" and up.return_params:
            out["kv_transfer_params"] = up.params(body)
        return out

    return app


@contextlib.contextmanager
def serving(app: Any, port: int | None = None) -> Iterator[int]:
    """Run an ASGI app with uvicorn in a thread on 127.0.0.1; yields its port."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline, "stand-in server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def upstream(role: str, **knobs: Any) -> Iterator[Upstream]:
    up = Upstream(role, **knobs)
    with serving(_app(up)) as port:
        up.port = port
        yield up


@contextlib.contextmanager
def side_channel() -> Iterator[tuple[int, list[Any]]]:
    """A stand-in prefill side channel: records every message, answers a handshake with a
    fact sheet (engine ``standin-engine``, TP 2) and anything else with an ``Ack``."""
    import zmq

    from vllm_flagcx.wire import handshake as hs

    port, seen, stop = free_port(), [], threading.Event()
    layout = hs.LayoutFacts(model="demo", dtype="bfloat16", kv_cache_dtype="auto",
                            group_kinds=("full",), block_sizes=(16,), kernel_block_sizes=(16,),
                            page_bytes=(4096,), conv_layout="", num_kv_heads=2,
                            cache_format="CPU_ATTN:isa=vec:layout=HND")
    sheet = hs.make_sheet(layout=layout, engine_id="standin-engine", incarnation="1",
                          tp_size=2, tp_rank=0)
    context = zmq.Context()
    sock = context.socket(zmq.REP)
    sock.bind(f"tcp://127.0.0.1:{port}")

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if dict(poller.poll(20)).get(sock):
                message = hs.decode(sock.recv())
                seen.append(message)
                if isinstance(message, hs.HandshakeRequest):
                    sock.send(hs.encode(hs.HandshakeReply(sheet)))
                else:
                    sock.send(hs.encode(hs.Ack(getattr(message, "transfer_id", ""))))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port, seen
    finally:
        stop.set()
        thread.join(5)
        sock.close()
        context.term()


BODY = {"model": "demo", "prompt": "100 + 100 =", "max_tokens": 8, "temperature": 0,
        "stop": ["\n"]}


@contextlib.contextmanager
def router(prefills: list[Any], decodes: list[Any], **settings: Any
           ) -> Iterator[tuple[str, Any]]:
    """The REAL router (``vllm_flagcx.router``) in front of stand-in upstreams: its URL and
    its ``Proxy``."""
    from vllm_flagcx.router.app import build_app
    from vllm_flagcx.router.legs import Instance, Pool, RouterSettings
    from vllm_flagcx.router.proxy import Proxy

    proxy = Proxy(Pool("prefill", [Instance(u.url, "prefill", getattr(u, "side", None))
                                   for u in prefills]),
                  Pool("decode", [Instance(u.url, "decode") for u in decodes]),
                  RouterSettings(**settings))
    with serving(build_app(proxy)) as port:
        yield f"http://127.0.0.1:{port}", proxy

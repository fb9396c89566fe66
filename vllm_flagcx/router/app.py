"""The router's HTTP surface: OpenAI completions and chat completions (streamed or not),
``/v1/models`` and ``/health`` passed through, ``/stats`` of its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_flagcx.router.legs import LegError
from vllm_flagcx.router.proxy import Proxy

DISCONNECT_POLL_S = 0.2
MAX_JSON_DEPTH = sys.getrecursionlimit()
logger = logging.getLogger("vllm_flagcx.router")


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _or_disconnect(request: Request, work: Any) -> Any:
    """Run ``work`` unless the client goes away first (then cancel it: both legs close,
    vLLM aborts them, what prefill holds is released). Returns None on disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, LegError):
        await task
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"request body: {name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e400: no JSON number can carry it on
        raise ValueError(f"request body: the number {text[:40]} is out of a double's range")
    return value


def parse_body(raw: bytes) -> dict[str, object]:
    """The request body as a JSON object, strictly: what the router cannot forward as
    valid JSON (NaN, Infinity, a lone surrogate, nesting deeper than Python parses) is a
    400 naming the problem, and ``stream`` must be a JSON boolean (the string "false"
    would otherwise turn a plain answer into an event stream). msgspec first (it refuses
    all of the above too, and a 32k-token prompt's ids parse in 1.2 ms, not 3 ms plus
    3 ms to check them again); what it refuses goes the stdlib way, whose error says why."""
    with contextlib.suppress(msgspec.MsgspecError, RecursionError):
        fast = msgspec.json.decode(raw)
        if isinstance(fast, dict):
            _check_stream(fast)
            return fast
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise ValueError("request body is not UTF-8") from None
    except ValueError as exc:
        raise ValueError(str(exc) if str(exc).startswith("request body:") else
                         f"request body must be JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                         "unpaired): not valid Unicode") from None
    except RecursionError:
        raise ValueError(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_stream(body)
    return body


def _check_stream(body: dict[str, object]) -> None:
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ValueError(f"stream must be true or false (a JSON boolean), got "
                         f"{json.dumps(body['stream'])[:40]}")


def _error(exc: LegError) -> JSONResponse:
    status = exc.status if 400 <= exc.status < 600 else 502
    return JSONResponse(exc.body(), status_code=status)


def build_app(proxy: Proxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.client.aclose()

    app = FastAPI(title="vllm-flagcx router", lifespan=lifespan)
    started = time.time()

    async def _route(path: str, request: Request) -> Response:
        try:
            body = parse_body(await request.body())
        except ValueError as exc:
            proxy.counters["bad_requests"] += 1
            return JSONResponse({"error": {"message": str(exc),
                                           "type": "invalid_request_error"}}, 400)
        try:
            return await _serve(path, request, body)
        except Exception as exc:  # a bug: still a JSON answer, never a bare 500
            proxy.counters["router_errors"] += 1
            logger.exception("router: %s failed", path)
            return JSONResponse({"error": {"message": f"router: {type(exc).__name__}: {exc}",
                                           "type": "router_error", "code": 500}}, 500)

    async def _serve(path: str, request: Request, body: dict[str, object]) -> Response:
        try:
            flow = await _or_disconnect(request, proxy.start(path, body))
        except LegError as exc:
            return _error(exc)
        if flow is None:  # counted by proxy.start
            return Response(status_code=499)
        if body.get("stream"):
            return StreamingResponse(flow.stream(body), media_type="text/event-stream")
        try:
            result = await _or_disconnect(request, flow.json())
        except LegError as exc:
            return _error(exc)
        if result is None:
            proxy.counters["client_disconnects"] += 1
            await flow.close()
            return Response(status_code=499)
        status, data = result
        return JSONResponse(data, status_code=status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _route("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        instance = proxy.decode.pick()
        try:
            r = await proxy.client.get(instance.url + "/v1/models",
                                       timeout=proxy.settings.connect_timeout)
        except httpx.HTTPError as exc:
            return _error(LegError(502, "decode", instance.url, f"unreachable: {exc!r}"))
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        async def probe(url: str) -> str:
            try:
                r = await proxy.client.get(url + "/health",
                                           timeout=proxy.settings.connect_timeout)
                return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                return f"unreachable ({type(exc).__name__})"

        instances = proxy.prefill.instances + proxy.decode.instances
        states = await asyncio.gather(*(probe(i.url) for i in instances))
        report = {f"{i.role} {i.url}": s for i, s in zip(instances, states, strict=True)}
        healthy = all(s == "ok" for s in states)
        return JSONResponse(report, status_code=200 if healthy else 503)

    @app.get("/stats")
    async def stats() -> dict[str, object]:
        return {"uptime_s": round(time.time() - started, 1), "mode": proxy.settings.mode,
                "counters": dict(proxy.counters),
                "prefill": [i.snapshot() for i in proxy.prefill.instances],
                "decode": [i.snapshot() for i in proxy.decode.instances]}

    return app

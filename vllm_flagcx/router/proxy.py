"""The two legs of one disaggregated request, and what happens when either fails.

Sequential (default): prefill gets the request with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true, "transfer_id": <minted here>}``; what it
returns in ``kv_transfer_params`` (host, exact side-channel port, TP size, engine id) goes
unchanged to decode with the client's original request. Concurrent: both legs start at
once; decode's pull waits at prefill's side channel until prefill finished (the router
learns the prefill's engine id and TP size once, by the connector's own handshake).

A failed leg reaches the client as an HTTP error naming the instance (never a hang, never
a 200 with empty text). A client that goes away cancels both legs (vLLM aborts a request
whose connection closed) and, when prefill already holds the KV, the router tells prefill
to free it instead of waiting for its lease.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from vllm_flagcx.router.legs import (
    LegError,
    RouterSettings,
    check_advertised,
    decode_body,
    json_object,
    prefill_body,
    sse_error,
    upstream_error,
)
from vllm_flagcx.router.pool import Instance, Pool, RouterConfigError
from vllm_flagcx.wire import params as params_schema

logger = logging.getLogger("vllm_flagcx.router")

class Proxy:
    """Routes requests over a prefill pool and a decode pool; keeps the counters."""

    def __init__(self, prefill: Pool, decode: Pool, settings: RouterSettings,
                 client: httpx.AsyncClient | None = None) -> None:
        if settings.mode == "concurrent":
            missing = [i.url for i in prefill.instances if i.side_channel_port is None]
            if missing:
                raise RouterConfigError(
                    f"--mode concurrent needs each prefill's side-channel port: give "
                    f"--prefill URL SIDE_CHANNEL_PORT for {', '.join(missing)}")
        self.prefill, self.decode, self.settings = prefill, decode, settings
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(settings.decode_timeout, connect=settings.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.counters: dict[str, float] = defaultdict(float)
        self._sheets: dict[str, tuple[str, int, tuple[int, ...]]] = {}

    # ------------------------------------------------------------------ legs
    async def run_prefill(self, path: str, body: dict[str, Any], transfer_id: str
                          ) -> tuple[Instance, dict[str, Any] | None]:
        instance = self.prefill.pick()
        instance.in_flight += 1
        started = time.monotonic()
        try:
            response = await self.client.post(instance.url + path,
                                              json=prefill_body(body, transfer_id),
                                              timeout=self.settings.prefill_timeout)
        except httpx.TimeoutException as exc:
            instance.failed += 1
            raise LegError(504, "prefill", instance.url, f"no answer within "
                           f"{self.settings.prefill_timeout:.0f} s ({type(exc).__name__})"
                           ) from exc
        except httpx.HTTPError as exc:
            instance.failed += 1
            raise LegError(502, "prefill", instance.url, f"unreachable: {exc!r}") from exc
        finally:
            instance.in_flight -= 1
        self.counters["prefill_seconds"] += time.monotonic() - started
        if response.status_code != 200:
            instance.failed += 1
            raise LegError(response.status_code, "prefill", instance.url,
                           f"answered HTTP {response.status_code}",
                           upstream_error(response))
        try:
            answer = json_object(response, "prefill", instance.url)
        except LegError:
            instance.failed += 1
            raise
        instance.served += 1
        params = answer.get("kv_transfer_params")
        if not params:
            # Prefill holds nothing (not a kv_producer, or nothing to send): decode computes
            # the prompt itself. Counted, so a misconfigured prefill is visible in /stats.
            self.counters["decode_recomputed"] += 1
            logger.warning("prefill %s returned no kv_transfer_params for %s; decode "
                           "recomputes the prompt (is it started with kv_role=kv_producer?)",
                           instance.url, transfer_id)
        return instance, params

    async def concurrent_params(self, instance: Instance, transfer_id: str) -> dict[str, Any]:
        """Decode's params before prefill answered, from the prefill's own fact sheet."""
        if instance.url not in self._sheets:
            import zmq

            from vllm_flagcx.wire import client, handshake

            assert instance.side_channel_port is not None
            where = f"side channel {instance.host}:{instance.side_channel_port}"
            try:
                reply = await asyncio.to_thread(
                    client.ask, zmq.Context.instance(), instance.host,
                    instance.side_channel_port,
                    handshake.HandshakeRequest(handshake.PROTOCOL_VERSION, 0),
                    self.settings.connect_timeout, None, self.settings.key, "router")
            except (TimeoutError, OSError, zmq.ZMQError, handshake.HandshakeError) as exc:
                instance.failed += 1
                raise LegError(502, "prefill", instance.url, f"{where}: {exc}") from None
            if not isinstance(reply, handshake.HandshakeReply):
                instance.failed += 1
                reason = getattr(reply, "reason", "")
                raise LegError(502, "prefill", instance.url,
                               f"{where} answered {type(reply).__name__} {reason}".strip())
            self._sheets[instance.url] = (reply.sheet.engine_id, reply.sheet.tp_size,
                                          tuple(reply.sheet.layout.block_sizes))
        engine_id, tp_size, block_sizes = self._sheets[instance.url]
        assert instance.side_channel_port is not None
        return params_schema.remote_prefill_params(
            transfer_id=transfer_id, host=instance.host, port=instance.side_channel_port,
            tp_size=tp_size, engine_id=engine_id, block_sizes=block_sizes)

    async def open_decode(self, path: str, body: dict[str, Any],
                          params: dict[str, Any] | None) -> tuple[Instance, httpx.Response]:
        """Send the decode leg; returns the open (streamed) response once headers came."""
        instance = self.decode.pick()
        instance.in_flight += 1
        handed_over = False  # the caller owns the in-flight count once it has the response
        try:
            request = self.client.build_request("POST", instance.url + path,
                                                json=decode_body(body, params))
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TimeoutException as exc:
                instance.failed += 1
                raise LegError(504, "decode", instance.url,
                               f"no answer ({type(exc).__name__})") from exc
            except httpx.HTTPError as exc:
                instance.failed += 1
                raise LegError(502, "decode", instance.url, f"unreachable: {exc!r}") from exc
            if response.status_code != 200:
                instance.failed += 1
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                raise LegError(response.status_code, "decode", instance.url,
                               f"answered HTTP {response.status_code}",
                               upstream_error(response))
            handed_over = True
            return instance, response
        finally:
            if not handed_over:
                instance.in_flight -= 1

    async def release(self, params: dict[str, Any] | None) -> None:
        """Free what prefill holds for a request nobody will decode."""
        if not params or "remote_port" not in params:
            return
        from vllm_flagcx.wire.client import release_transfer

        errors = await asyncio.to_thread(
            release_transfer, str(params.get("remote_host")), int(params["remote_port"]),
            int(params.get("remote_tp_size", 1)), str(params.get("transfer_id")),
            self.settings.release_timeout, self.settings.key)
        self.counters["released"] += 1
        if errors:
            logger.info("release of %s not acknowledged (%s); prefill's lease frees it",
                        params.get("transfer_id"), "; ".join(errors))

    # ------------------------------------------------------------------ one request
    async def start(self, path: str, body: dict[str, Any]) -> Flow:
        """Both legs up to decode's response headers; raises LegError."""
        self.counters["requests"] += 1
        flow = Flow(self, transfer_id=f"flagcx-{uuid.uuid4().hex}")
        try:
            if self.settings.mode == "concurrent":
                p_instance = self.prefill.pick()
                flow.params = await self.concurrent_params(p_instance, flow.transfer_id)
                flow.prefill_task = asyncio.create_task(
                    self.run_prefill(path, body, flow.transfer_id))
            else:
                p_instance, flow.params = await self.run_prefill(path, body, flow.transfer_id)
                check_advertised(p_instance, self.decode.instances, flow.params)
            flow.instance, flow.response = await self.open_decode(path, body, flow.params)
            if flow.prefill_task is not None:
                flow.watch_prefill()
        except LegError as exc:
            self.counters[f"failed_{exc.leg}"] += 1
            await flow.abandon()
            raise
        except asyncio.CancelledError:  # the client went away
            self.counters["client_disconnects"] += 1
            await flow.abandon()
            raise
        except BaseException:  # a bug: the caller answers it as a JSON 500
            await flow.abandon()
            raise
        return flow


@dataclass
class Flow:
    """One request between prefill's answer and the end of decode's answer."""

    proxy: Proxy
    transfer_id: str
    params: dict[str, Any] | None = None
    instance: Instance | None = None
    response: httpx.Response | None = None
    prefill_task: asyncio.Task | None = None
    _closing: asyncio.Future | None = None

    async def abandon(self) -> None:
        """The request ends without a decode: cancel what runs, free what is held. Once
        decode accepted the request, its connector tells prefill itself."""
        if self.prefill_task is not None and not self.prefill_task.done():
            self.prefill_task.cancel()
        accepted = self.instance is not None
        await self.close()
        if not accepted:
            await self.proxy.release(self.params)

    def watch_prefill(self) -> None:
        """Concurrent mode: a failed prefill leg closes decode's answer at once (decode
        aborts the request) instead of letting decode wait for KV that never comes."""
        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                self._closing = asyncio.ensure_future(self.close())

        assert self.prefill_task is not None
        self.prefill_task.add_done_callback(done)

    def prefill_error(self) -> LegError | None:
        task = self.prefill_task
        if task is None or not task.done() or task.cancelled():
            return None
        error = task.exception()
        return error if isinstance(error, LegError) else None

    async def close(self) -> None:
        if self.response is not None:
            await self.response.aclose()
            self.response = None
            if self.instance is not None:
                self.instance.in_flight -= 1

    async def check_prefill(self) -> None:
        """Concurrent mode: a failed prefill leg fails the request."""
        if self.prefill_task is not None:
            await self.prefill_task

    async def json(self) -> tuple[int, Any]:
        assert self.response is not None and self.instance is not None
        try:
            data = await self.response.aread()
            await self.check_prefill()
        except httpx.HTTPError as exc:
            if (error := self.prefill_error()) is not None:
                raise error from exc
            self.instance.failed += 1
            self.proxy.counters["failed_decode"] += 1
            raise LegError(502, "decode", self.instance.url, f"answer cut: {exc!r}") from exc
        finally:
            await self.close()
        try:
            parsed = json.loads(data)
        except ValueError:
            self.instance.failed += 1
            self.proxy.counters["failed_decode"] += 1
            raise LegError(502, "decode", self.instance.url,
                           f"answered 200 with a body that is not JSON: {data[:200]!r}"
                           ) from None
        self.instance.served += 1
        return 200, parsed

    async def stream(self) -> AsyncIterator[bytes]:
        """Decode's SSE bytes as they come; an error event if decode dies midway."""
        assert self.response is not None and self.instance is not None
        instance = self.instance
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
            await self.check_prefill()
            instance.served += 1
        except httpx.HTTPError as exc:
            if (error := self.prefill_error()) is not None:
                yield sse_error(error)
                return
            instance.failed += 1
            self.proxy.counters["failed_decode"] += 1
            yield sse_error(LegError(502, "decode", instance.url, f"stream cut: {exc!r}"))
        except LegError as exc:
            yield sse_error(exc)
        finally:
            await self.close()

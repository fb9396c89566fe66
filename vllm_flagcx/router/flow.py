"""One routed request after its legs started: decode's answer passed through (JSON or
SSE), a failed leg turned into an error naming the instance, what is held freed when the
request ends without a decode, and the request's ``wire.timeline`` line."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from vllm_flagcx.router import first_token
from vllm_flagcx.router.legs import Instance, LegError, sse_error
from vllm_flagcx.wire import timeline

logger = logging.getLogger("vllm_flagcx.router")
# (path, body, prefill's params, the flow's marks) -> decode's instance and response
Json = dict[str, object]  # a request body or kv_transfer_params, as the router relays it
OpenDecode = Callable[[str, Json, Json | None, dict[str, float]],
                      Awaitable[tuple[Instance, httpx.Response]]]


@dataclass
class Flow:
    """One request between prefill's answer and the end of decode's answer.

    It is handed what it uses of the router that started it, not the router: how to free
    what prefill holds (``release``), how to open decode's leg (``open_decode``), the
    failure counters it adds to, and whether timelines log at INFO."""

    release: Callable[[Json | None], Awaitable[None]]
    open_decode: OpenDecode
    counters: dict[str, float]  # the router's, which /stats reports
    log_timelines: bool
    transfer_id: str
    params: Json | None = None
    instance: Instance | None = None
    response: httpx.Response | None = None
    prefill_task: asyncio.Task | None = None
    _closing: asyncio.Future | None = None
    # wire.timeline's t_* readings of this request (time.monotonic(), the clock rule)
    marks: dict[str, float] = field(default_factory=dict)
    seed: first_token.FirstToken | None = None  # prefill's first token, sent first
    whole_answer: bool = False  # ... and it is the whole answer: no decode leg
    # a streamed seeded request's decode leg (path, body), opened after t1 went out
    decode_leg: tuple[str, dict[str, object]] | None = None

    def first_byte(self) -> None:
        """Decode's first body byte reached the router: log the request's timeline."""
        if "t_first_byte" in self.marks:
            return
        self.marks["t_first_byte"] = time.monotonic()
        level = logging.INFO if self.log_timelines else logging.DEBUG
        if logger.isEnabledFor(level):
            logger.log(level, "%s", timeline.format_line("router", self.transfer_id,
                                                         self.marks))

    async def abandon(self) -> None:
        """The request ends without a decode: cancel what runs, free what is held. Once
        decode accepted the request, its connector tells prefill itself."""
        if self.prefill_task is not None and not self.prefill_task.done():
            self.prefill_task.cancel()
        accepted = self.instance is not None
        await self.close()
        if not accepted:
            await self.release(self.params)

    def watch_prefill(self) -> None:
        """Concurrent mode: a failed prefill leg closes decode's answer at once (decode
        aborts the request) instead of letting decode wait for KV that never comes."""
        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                self._closing = asyncio.ensure_future(self.close())

        assert self.prefill_task is not None
        self.prefill_task.add_done_callback(done)

    async def _open_decode_leg(self, path: str, leg: dict[str, object]) -> None:
        """Open decode's leg of a seeded stream; a failed or cancelled one frees what
        prefill holds (decode never took the request)."""
        self.decode_leg = None
        try:
            self.instance, self.response = await self.open_decode(
                path, leg, self.params, self.marks)
        except BaseException as exc:  # a failed leg, or the client went away meanwhile
            if isinstance(exc, LegError):
                self.counters[f"failed_{exc.leg}"] += 1
            await self.release(self.params)
            raise

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
        if self.whole_answer:
            assert self.seed is not None
            return 200, self.seed.completion()
        assert self.response is not None and self.instance is not None
        try:
            data = await self.response.aread()
            self.first_byte()
            await self.check_prefill()
        except httpx.HTTPError as exc:
            if (error := self.prefill_error()) is not None:
                raise error from exc
            self.instance.failed += 1
            self.counters["failed_decode"] += 1
            raise LegError(502, "decode", self.instance.url, f"answer cut: {exc!r}") from exc
        finally:
            await self.close()
        try:
            parsed = json.loads(data)
        except ValueError:
            self.instance.failed += 1
            self.counters["failed_decode"] += 1
            raise LegError(502, "decode", self.instance.url,
                           f"answered 200 with a body that is not JSON: {data[:200]!r}"
                           ) from None
        self.instance.served += 1
        if self.seed is not None and isinstance(parsed, dict):
            parsed = first_token.completion(parsed, self.seed)
        return 200, parsed

    async def stream(self, body: Mapping[str, object]) -> AsyncIterator[bytes]:
        """Decode's SSE bytes as they come, after prefill's first token where it was
        seeded (usage moved to count it as generated); an error event if decode dies
        midway."""
        if self.seed is not None:
            self.marks["t_seed"] = time.monotonic()
            if self.whole_answer:
                for event in self.seed.whole_stream(body):
                    yield event
                return
            try:
                yield self.seed.event()
            except BaseException:  # the client left before decode's leg opened
                if self.decode_leg is not None:
                    self.decode_leg = None
                    self._closing = asyncio.ensure_future(self.release(self.params))
                raise
        if self.decode_leg is not None:
            try:
                await self._open_decode_leg(*self.decode_leg)
            except LegError as exc:
                yield sse_error(exc)
                return
        assert self.response is not None and self.instance is not None
        instance = self.instance
        chunks = self.response.aiter_raw()
        if self.seed is not None and first_token.wants_usage(body):
            chunks = first_token.usage_moved(chunks)
        try:
            async for chunk in chunks:
                self.first_byte()
                yield chunk
            await self.check_prefill()
            instance.served += 1
        except httpx.HTTPError as exc:
            if (error := self.prefill_error()) is not None:
                yield sse_error(error)
                return
            instance.failed += 1
            self.counters["failed_decode"] += 1
            yield sse_error(LegError(502, "decode", instance.url, f"stream cut: {exc!r}"))
        except LegError as exc:
            yield sse_error(exc)
        finally:
            await self.close()

"""The two legs of one disaggregated request, and what happens when either fails.

Sequential (default): prefill gets the request with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true, "transfer_id": <minted here>, "flagcx_leg":
true}`` (``wire.params.prefill_leg_params``); what it
returns in ``kv_transfer_params`` (host, exact side-channel port, TP size, engine id) goes
unchanged to decode with the client's original request. Where ``first_token.applies``,
prefill's token goes to the client at once and decode continues from prompt + [t1].
Concurrent: both legs start at once; decode's pull waits at prefill's side channel until
prefill finished (the router learns the prefill's engine id and TP size once, by the
connector's own handshake).

A failed leg reaches the client as an HTTP error naming the instance (never a hang, never
a 200 with empty text). A client that goes away cancels both legs (vLLM aborts a request
whose connection closed) and, when prefill already holds the KV, the router tells prefill
to free it instead of waiting for its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping

import httpx

from vllm_flagcx.router import first_token
from vllm_flagcx.router.flow import Flow
from vllm_flagcx.router.legs import (
    JSON_HEADERS,
    Instance,
    LegError,
    Pool,
    RouterConfigError,
    RouterSettings,
    check_advertised,
    decode_body,
    encode,
    json_object,
    prefill_body,
    prompt_ids_apply,
    prompt_token_ids,
    upstream_error,
)
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
    async def run_prefill(self, path: str, leg: Mapping[str, object], transfer_id: str,
                          marks: dict[str, float] | None = None,
                          instance: Instance | None = None
                          ) -> tuple[Instance, dict[str, object]]:
        """The prefill leg (``leg``: its request body) on ``instance`` (default: the
        least-loaded prefill): its instance and its answer."""
        instance = instance or self.prefill.pick()
        instance.in_flight += 1
        started = time.monotonic()
        if marks is not None:
            marks["t_prefill_sent"] = started
        try:
            response = await self.client.post(instance.url + path, content=encode(leg),
                                              headers=JSON_HEADERS,
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
        done = time.monotonic()
        if marks is not None:
            marks["t_prefill_done"] = done
        self.counters["prefill_seconds"] += done - started
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
        return instance, answer

    def held_params(self, instance: Instance, answer: Mapping[str, object], transfer_id: str
                    ) -> dict[str, object] | None:
        """The ``kv_transfer_params`` prefill returned for decode, or None (counted and
        logged: decode then computes the prompt itself)."""
        params = answer.get("kv_transfer_params")
        if isinstance(params, dict) and params:
            return params
        # Prefill holds nothing (not a kv_producer, or nothing to send): decode computes
        # the prompt itself. Counted, so a misconfigured prefill is visible in /stats.
        self.counters["decode_recomputed"] += 1
        logger.warning("prefill %s returned no kv_transfer_params for %s; decode "
                       "recomputes the prompt (is it started with kv_role=kv_producer?)",
                       instance.url, transfer_id)
        return None

    async def concurrent_params(self, instance: Instance, transfer_id: str) -> dict[str, object]:
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

    async def open_decode(self, path: str, body: dict[str, object],
                          params: dict[str, object] | None, marks: dict[str, float] | None = None,
                          prompt_ids: list[int] | None = None
                          ) -> tuple[Instance, httpx.Response]:
        """Send the decode leg; returns the open (streamed) response once headers came."""
        instance = self.decode.pick()
        if marks is not None:
            marks["t_decode_sent"] = time.monotonic()
        instance.in_flight += 1
        handed_over = False  # the caller owns the in-flight count once it has the response
        try:
            request = self.client.build_request(
                "POST", instance.url + path, headers=JSON_HEADERS,
                content=encode(decode_body(body, params, prompt_ids)))
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
            if marks is not None:
                marks["t_headers"] = time.monotonic()
            return instance, response
        finally:
            if not handed_over:
                instance.in_flight -= 1

    async def release(self, params: dict[str, object] | None) -> None:
        """Free what prefill holds for a request nobody will decode."""
        if not params or "remote_port" not in params:
            return
        from vllm_flagcx.wire.client import release_transfer

        try:  # prefill's answer, untrusted: only what parses is released
            remote = params_schema.parse_remote_prefill(params)
        except params_schema.TransferParamsError:
            return
        errors = await asyncio.to_thread(
            release_transfer, remote.remote_host, remote.remote_port, remote.remote_tp_size,
            remote.transfer_id, self.settings.release_timeout, self.settings.key)
        self.counters["released"] += 1
        if errors:
            logger.info("release of %s not acknowledged (%s); prefill's lease frees it",
                        params.get("transfer_id"), "; ".join(errors))

    # ------------------------------------------------------------------ one request
    async def start(self, path: str, body: dict[str, object]) -> Flow:
        """Both legs up to decode's response headers; raises LegError."""
        self.counters["requests"] += 1
        flow = Flow(self.release, self.open_decode, self.counters,
                    self.settings.log_timelines, transfer_id=f"flagcx-{uuid.uuid4().hex}")
        flow.marks["t_in"] = time.monotonic()
        try:
            if self.settings.mode == "concurrent":
                p_instance = self.prefill.pick()
                flow.params = await self.concurrent_params(p_instance, flow.transfer_id)
                # the prefill decode's params name: picking again could send the prompt
                # to another prefill, and decode would wait for KV that never comes
                flow.prefill_task = asyncio.create_task(self.run_prefill(
                    path, prefill_body(body, flow.transfer_id), flow.transfer_id,
                    flow.marks, p_instance))
                decode_leg, prompt_ids = body, None
            else:
                decode_leg, prompt_ids = await self._sequential_prefill(path, body, flow)
                if flow.whole_answer:
                    return flow  # prefill's token is the whole answer: no decode leg
                if flow.seed is not None and body.get("stream"):
                    # the client's stream starts with t1 now; decode's leg opens after it
                    flow.decode_leg = (path, decode_leg)
                    return flow
            flow.instance, flow.response = await self.open_decode(path, decode_leg, flow.params,
                                                                  flow.marks, prompt_ids)
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

    async def _sequential_prefill(self, path: str, body: dict[str, object], flow: Flow
                                  ) -> tuple[dict[str, object], list[int] | None]:
        """Prefill's leg, then what decode is sent: (its body, the prompt's token ids to
        put in it). With the first token seeded (``first_token``), decode's body already
        holds prompt + [t1]; a t1 that ends the answer sets ``flow.whole_answer``."""
        seeded = self.settings.first_token and first_token.applies(path, body)
        want_ids = seeded or (self.settings.prompt_token_ids and prompt_ids_apply(path, body))
        leg = (first_token.prefill_body(body, flow.transfer_id) if seeded
               else prefill_body(body, flow.transfer_id, want_ids))
        p_instance, answer = await self.run_prefill(path, leg, flow.transfer_id, flow.marks)
        ids = prompt_token_ids(answer) if want_ids else None
        seed = first_token.first_token(answer) if seeded and ids is not None else None
        if seeded and seed is None:  # prefill ran whole (seeded); decode gets the plain leg
            self.counters["first_token_unusable"] += 1
        if seed is not None and seed.is_whole_answer(body):
            flow.seed, flow.whole_answer = seed, True
            self.counters["first_token_whole_answers"] += 1
            params = answer.get("kv_transfer_params")
            await self.release(params if isinstance(params, dict) else None)
            return body, None
        flow.params = self.held_params(p_instance, answer, flow.transfer_id)
        check_advertised(p_instance, self.decode.instances, flow.params)
        if ids is not None:
            self.counters["decode_prompt_ids"] += 1
        if seed is None or ids is None:
            return body, ids
        flow.seed = seed
        self.counters["first_token_seeded"] += 1
        return first_token.decode_body(body, ids, seed), None

"""The router's upstreams and what it sends them: the instances behind it and the
least-loaded choice among them (``Pool``), what each leg of a disaggregated request is sent,
how the router is set, and how a failed leg reaches the client (an HTTP error, or the last
events of a stream, naming the leg and the instance). Pure: no network here; ``proxy`` runs
the legs.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from vllm_flagcx.wire import auth
from vllm_flagcx.wire import params as params_schema


class RouterConfigError(ValueError):
    """A router setting that cannot work; the message names it and the fix."""


@dataclass
class Instance:
    """One vLLM server. ``side_channel_port`` is the prefill connector's base port when
    given on the command line (prefill also returns it in ``kv_transfer_params``)."""

    url: str
    role: str
    side_channel_port: int | None = None
    in_flight: int = 0
    served: int = 0
    failed: int = 0

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    def snapshot(self) -> dict[str, object]:
        return {"url": self.url, "in_flight": self.in_flight, "served": self.served,
                "failed": self.failed}


def parse_instance(spec: list[str], role: str) -> Instance:
    """``URL [SIDE_CHANNEL_PORT]`` as given to ``--prefill`` / ``--decode``."""
    if not spec or len(spec) > 2:
        raise RouterConfigError(f"--{role} takes URL [SIDE_CHANNEL_PORT], got {spec!r}")
    url = spec[0].rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
        raise RouterConfigError(f"--{role} {spec[0]!r}: give a URL with scheme, host and "
                                "port, e.g. http://127.0.0.1:20001")
    port = None
    if len(spec) == 2:
        if not spec[1].isdigit() or not 0 < int(spec[1]) < 65536:
            raise RouterConfigError(f"--{role} {url} {spec[1]!r}: SIDE_CHANNEL_PORT must be "
                                    "a TCP port (the connector's side_channel_port)")
        port = int(spec[1])
    return Instance(url, role, port)


@dataclass
class Pool:
    """Instances of one role; ``pick`` takes the one with the fewest requests in flight,
    rotating among equals so idle instances share the load."""

    role: str
    instances: list[Instance]
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if not self.instances:
            raise RouterConfigError(f"give at least one --{self.role} URL")

    def pick(self) -> Instance:
        least = min(i.in_flight for i in self.instances)
        idle = [i for i in self.instances if i.in_flight == least]
        return idle[next(self._turn) % len(idle)]


# Sampling fields that could end the prefill leg early (before its one token is length
# capped), which would leave prefill holding nothing for decode.
_PREFILL_DROPS = ("stop", "stop_token_ids", "stream_options", "min_tokens", "n", "best_of")
# Fields whose answer reads the prompt's text or embeddings: their requests keep the text.
_PROMPT_AS_TEXT = ("echo", "prompt_logprobs", "prompt_embeds", "suffix")
MAX_PROMPT_IDS = 1 << 22  # prompt token ids taken from prefill's answer, at most


class LegError(Exception):
    """A leg that failed; ``status`` and ``detail`` become the client's HTTP error."""

    def __init__(self, status: int, leg: str, instance: str, message: str,
                 upstream: Any = None) -> None:
        super().__init__(message)
        self.status, self.leg, self.instance, self.upstream = status, leg, instance, upstream

    def body(self) -> dict[str, object]:
        error = {"message": f"{self.leg} {self.instance}: {self}", "type": f"{self.leg}_error",
                 "code": self.status}
        if self.upstream is not None:
            error["upstream"] = self.upstream
        return {"error": error}


@dataclass(frozen=True)
class RouterSettings:
    mode: str = "sequential"  # or "concurrent"
    connect_timeout: float = 10.0
    prefill_timeout: float = 600.0  # whole prefill leg
    decode_timeout: float = 600.0  # between two bytes of the decode answer
    release_timeout: float = 2.0
    key: auth.Key = field(default=None, repr=False)  # the router's credential (auth)
    log_timelines: bool = False  # one wire.timeline line per request at INFO (else DEBUG)
    # sequential /v1/completions: decode gets the prompt as prefill's token ids, not text
    prompt_token_ids: bool = True
    # sequential: prefill's first token goes to the client, decode continues from it
    # (router.first_token, where it applies)
    first_token: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("sequential", "concurrent"):
            raise RouterConfigError(f"--mode {self.mode!r}: use sequential or concurrent")
        for name in ("connect_timeout", "prefill_timeout", "decode_timeout",
                     "release_timeout"):
            if getattr(self, name) <= 0:
                raise RouterConfigError(f"--{name.replace('_', '-')} must be > 0")


def prompt_ids_apply(path: str, body: Mapping[str, object]) -> bool:
    """The decode leg may carry the prompt as prefill's token ids: a text completion of
    one text prompt whose answer does not echo or score the prompt's text."""
    return (path.rstrip("/").endswith("/v1/completions") and isinstance(body.get("prompt"), str)
            and not any(body.get(k) for k in _PROMPT_AS_TEXT))


def prompt_token_ids(answer: Mapping[str, object]) -> list[int] | None:
    """The prompt's token ids from prefill's answer (``return_token_ids``: its one
    choice's ``prompt_token_ids``), or None when absent or not a bounded, non-empty list
    of token ids (then decode gets the text, as before)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    ids = choices[0].get("prompt_token_ids")
    if (not isinstance(ids, list) or not 0 < len(ids) <= MAX_PROMPT_IDS
            or not all(type(i) is int and i >= 0 for i in ids)):
        return None
    return ids


def prefill_body(body: dict[str, object], transfer_id: str,
                 want_prompt_ids: bool = False) -> dict[str, object]:
    """The prefill leg's request: one token, not streamed, always length capped; with
    ``want_prompt_ids``, asking for the prompt's token ids (``return_token_ids``)."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    if want_prompt_ids:
        out["return_token_ids"] = True
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["ignore_eos"] = True  # an EOS first token must not end it as "stopped"
    out["kv_transfer_params"] = params_schema.prefill_leg_params(transfer_id)
    return out


def advertised_side_channel_problem(prefill_url_host: str, given_port: int | None,
                                    decode_hosts: list[str],
                                    params: dict[str, object] | None) -> str | None:
    """Why decode could not reach (or would reach the wrong) prefill side channel that
    prefill's returned ``kv_transfer_params`` name, or None. Sequential mode: what the
    operator told the router (``--prefill URL SIDE_CHANNEL_PORT``, the seed's form) must
    match what prefill advertises, and a loopback address is refused when a decode runs on
    another host (it would dial its own host: a fast refusal beats a late recompute)."""
    if not params or "remote_port" not in params:
        return None
    port, host = params.get("remote_port"), str(params.get("remote_host") or "")
    if given_port is not None and port != given_port:
        return (f"prefill advertises side channel port {port} but the router was given "
                f"{given_port} (--prefill URL {given_port}): set side_channel_port="
                f"{given_port} in prefill's kv_connector_extra_config, or give --prefill "
                f"URL {port}")

    def same_host(a: str, b: str) -> bool:
        return a == b or (params_schema.is_loopback(a) and params_schema.is_loopback(b))

    remote = [h for h in decode_hosts if not same_host(h, prefill_url_host)]
    if params_schema.is_loopback(host) and remote:
        return (f"prefill advertises its side channel at the loopback address {host}, but "
                f"decode runs on another host ({remote[0]}) and would dial itself: set "
                f"side_channel_host in prefill's kv_connector_extra_config to an address "
                f"decode can reach (e.g. {prefill_url_host})")
    return None


def check_advertised(prefill: Instance, decodes: list[Instance],
                     params: dict[str, object] | None) -> None:
    """LegError 502 naming prefill when ``advertised_side_channel_problem`` finds one."""
    problem = advertised_side_channel_problem(
        prefill.host, prefill.side_channel_port, [d.host for d in decodes], params)
    if problem is not None:
        prefill.failed += 1
        raise LegError(502, "prefill", prefill.url, problem)


def decode_body(body: dict[str, object], params: dict[str, object] | None,
                prompt_ids: list[int] | None = None) -> dict[str, object]:
    """The decode leg's request: the client's own, with prefill's ``kv_transfer_params``;
    with ``prompt_ids``, its prompt as those token ids (the very tokens prefill computed
    the KV for). Why: decode's API server otherwise tokenizes the text again on the
    first token's path, 2.5 / 18 / 76 ms for 1.5k / 12k / 48k-token prompts with the
    demo's tokenizer on the CI VM, against 0.5 / 2.8 / 7.7 ms to carry the ids as JSON."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if params:
        out["kv_transfer_params"] = params
    if prompt_ids is not None:
        out["prompt"] = prompt_ids
    return out


JSON_HEADERS = {"content-type": "application/json"}


def encode(body: Mapping[str, object]) -> bytes:
    """A leg's body as JSON, by msgspec: a 32k-token prompt's ids took 3-4 ms through the
    stdlib (httpx's ``json=``) and take 0.25 ms here, on every leg's path to first byte."""
    return msgspec.json.encode(body)


def json_object(response: httpx.Response, leg: str, url: str) -> dict[str, object]:
    """A 200 answer's JSON object; LegError 502 naming the leg when it is anything else
    (garbage from an upstream is that upstream's failure, not the router's 500). By
    msgspec: prefill's answer carries the prompt's token ids (3 ms for 32k through the
    stdlib, 1.2 ms here)."""
    try:
        answer = msgspec.json.decode(response.content)
    except (msgspec.MsgspecError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        raise LegError(502, leg, url, "answered HTTP 200 with a body that is not a JSON "
                       f"object: {response.text[:200]!r}")
    return answer


def upstream_error(response: httpx.Response) -> Any:
    """An upstream's error body as the client will see it (JSON, else the start of the
    text)."""
    try:
        return response.json()
    except ValueError:
        return response.text[:2000]


def sse_error(error: LegError) -> bytes:
    """A failed leg as the last events of a stream the client already receives."""
    return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()

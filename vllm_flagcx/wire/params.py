"""``kv_transfer_params``: what a request carries between the router, P and D.

Prefill returns them from ``request_finished``; the router forwards them to decode. They
are user-reachable input (a router, a client), so parsing names the bad field and the fix
instead of failing deep inside a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NewType, TypeVar


class TransferParamsError(ValueError):
    """kv_transfer_params that cannot be acted on."""


TransferId = NewType("TransferId", str)
"""The cross-engine key of one PD transfer (prefill's scheduler or a router mints it); not
vLLM's request id, which is local to each engine (``connector.metadata.RequestId``)."""


@dataclass(frozen=True)
class RemotePrefill:
    """Decode side: where the KV of this request waits, and how it was computed."""

    transfer_id: TransferId
    remote_host: str
    remote_port: int
    remote_tp_size: int
    remote_engine_id: str
    remote_block_sizes: tuple[int, ...]
    test_fault: str = ""  # connector.decode.faults (tests only; checked by the worker)
    # prompt tokens whose KV (and recurrent state) prefill holds; None from peers and
    # routers that predate it (concurrent mode: not known before prefill ran)
    remote_num_tokens: int | None = None


_T = TypeVar("_T")


def _require(params: Mapping[str, object], key: str, kind: type[_T], fix: str) -> _T:
    if key not in params:
        raise TransferParamsError(f"kv_transfer_params.{key} is missing; {fix}")
    value = params[key]
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise TransferParamsError(f"kv_transfer_params.{key} must be {kind.__name__}, got "
                                  f"{type(value).__name__} {value!r}; {fix}")
    return value


_FROM_PREFILL = "forward the kv_transfer_params the prefill response returned, unchanged"


CONCURRENT_REFUSAL = (
    "kv_transfer_params.remote_bootstrap_addr: the Mooncake-style concurrent contract "
    "(a router-minted transfer_id, prefill found through a bootstrap /query) is not "
    "supported by FlagCXConnector; run the router in its NIXL (serial) mode, which sends "
    "decode prefill's returned kv_transfer_params: vllm-router --kv-connector nixl (its "
    "default), llm-d --kv-connector=nixlv2")


def is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith(("127.", "::1", "[::1]"))


def loopback_hint(host: str) -> str:
    """What to add to a failed handshake with ``host`` when it is a loopback address:
    prefill's default ``side_channel_host`` cannot be reached from another host."""
    if not is_loopback(host):
        return ""
    return (f"; prefill advertised the loopback address {host}: if it runs on another "
            "host, set kv_connector_extra_config.side_channel_host on prefill to an "
            "address this host can reach")


def parse_remote_prefill(params: Mapping[str, object]) -> RemotePrefill:
    """Validate decode-side params (``do_remote_prefill``) from the router."""
    if not isinstance(params, Mapping):
        raise TransferParamsError(f"kv_transfer_params must be an object, got "
                                  f"{type(params).__name__}")
    if params.get("remote_bootstrap_addr") is not None and params.get("remote_host") is None:
        raise TransferParamsError(CONCURRENT_REFUSAL)
    transfer_id = _require(params, "transfer_id", str, _FROM_PREFILL)
    host = _require(params, "remote_host", str, _FROM_PREFILL)
    port = _require(params, "remote_port", int, _FROM_PREFILL)
    tp = _require(params, "remote_tp_size", int, _FROM_PREFILL)
    engine = _require(params, "remote_engine_id", str, _FROM_PREFILL)
    sizes = params.get("remote_block_sizes", [])
    if not transfer_id or not host or not engine:
        raise TransferParamsError("kv_transfer_params.transfer_id, remote_host and "
                                  f"remote_engine_id must be non-empty; {_FROM_PREFILL}")
    if not 0 < port < 65536:
        raise TransferParamsError(f"kv_transfer_params.remote_port={port} is not a TCP port; "
                                  f"{_FROM_PREFILL}")
    if tp < 1:
        raise TransferParamsError(f"kv_transfer_params.remote_tp_size={tp} must be >= 1; "
                                  f"{_FROM_PREFILL}")
    if not isinstance(sizes, (list, tuple)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise TransferParamsError("kv_transfer_params.remote_block_sizes must be a list of "
                                  f"positive ints, got {sizes!r}; {_FROM_PREFILL}")
    held = params.get(NUM_TOKENS)
    if held is not None and (type(held) is not int or held < 1):
        raise TransferParamsError(f"kv_transfer_params.{NUM_TOKENS} must be an int >= 1, "
                                  f"got {held!r}; {_FROM_PREFILL}")
    fault = params.get("flagcx_test_fault", "")
    if not isinstance(fault, str):
        raise TransferParamsError("kv_transfer_params.flagcx_test_fault must be a string "
                                  "(tests only)")
    return RemotePrefill(TransferId(transfer_id), host, port, tp, engine, tuple(sizes), fault, held)


REMOTE_PREFILL = "do_remote_prefill"  # decode: load this request's KV from prefill
REMOTE_DECODE = "do_remote_decode"  # prefill: hold this request's KV for a decode
NUM_TOKENS = "remote_num_tokens"  # prefill -> decode: the prompt tokens it holds KV for
# router -> prefill: decode will continue from prompt + [prefill's first token], so
# prefill computes every prompt token (no Mamba N-1 truncation): its sampled token is the
# true first token and the state it holds is the one after the whole prompt
FIRST_TOKEN_SEEDED = "first_token_seeded"
# decode -> the client (in the response's kv_transfer_params): why this request's KV was
# computed locally instead of loaded (e.g. a router in Mooncake mode): a correct answer
# that moved no KV is otherwise indistinguishable from PD working
NOT_LOADED = "flagcx_not_loaded"


# router -> prefill: this prefill leg is this project's router's (it mints the transfer
# id and forwards prefill's answer to decode). A leg that mints a transfer id without it
# is the Mooncake-style contract (vllm-router --kv-connector mooncake, llm-d mooncake,
# Dynamo's Mooncake protocol): its decode leg is refused (CONCURRENT_REFUSAL), so prefill
# frees the KV at once instead of holding it for a pull that cannot come
OUR_LEG = "flagcx_leg"
# prefill -> the router: why prefill did not hold this request's KV
NOT_HELD = "flagcx_not_held"
BOOTSTRAP_LEG_REFUSAL = (
    "kv_transfer_params.transfer_id minted by the router without flagcx_leg: the "
    "Mooncake-style contract, whose decode leg FlagCXConnector refuses; prefill freed this "
    "request's KV at once. Run the router in its NIXL (serial) mode: vllm-router "
    "--kv-connector nixl (its default), llm-d --kv-connector=nixlv2, or vllm-flagcx router")


def is_bootstrap_leg(params: Mapping[str, object]) -> bool:
    """A prefill leg of the Mooncake-style contract (see ``OUR_LEG``): NIXL-mode routers
    send no transfer id, ours marks its legs."""
    return params.get("transfer_id") is not None and params.get(OUR_LEG) is not True


def not_loaded_params(reason: str) -> dict[str, object]:
    """What decode returns for a request it computed locally because its params were
    refused: ``reason`` names the field and the fix (bounded: it crosses to the client)."""
    return {NOT_LOADED: reason[:1000]}


def wants_remote_prefill(params: Mapping[str, object]) -> bool:
    return bool(params.get(REMOTE_PREFILL))


def wants_remote_decode(params: Mapping[str, object]) -> bool:
    return bool(params.get(REMOTE_DECODE))


def seeds_first_token(params: Mapping[str, object]) -> bool:
    return params.get(FIRST_TOKEN_SEEDED) is True


def prefill_leg_params(transfer_id: str, seeded: bool = False) -> dict[str, object]:
    """What the router sends prefill: hold the KV under ``transfer_id``; ``seeded``:
    decode continues from prefill's first token (``FIRST_TOKEN_SEEDED``)."""
    out: dict[str, object] = {REMOTE_DECODE: True, REMOTE_PREFILL: False,
                              "transfer_id": transfer_id, OUR_LEG: True}
    if seeded:
        out[FIRST_TOKEN_SEEDED] = True
    return out


def remote_prefill_params(*, transfer_id: str, host: str, port: int, tp_size: int,
                          engine_id: str, block_sizes: tuple[int, ...],
                          num_tokens: int | None = None) -> dict[str, object]:
    """What prefill returns for decode (``request_finished_all_groups``); the router's
    concurrent mode builds the same from prefill's fact sheet before prefill answers
    (without ``num_tokens``: prefill has not run yet)."""
    out: dict[str, object] = {
        REMOTE_PREFILL: True,
        REMOTE_DECODE: False,
        "transfer_id": transfer_id,
        "remote_host": host,
        "remote_port": port,
        "remote_tp_size": tp_size,
        "remote_engine_id": engine_id,
        "remote_block_sizes": list(block_sizes),
    }
    if num_tokens is not None:
        out[NUM_TOKENS] = num_tokens
    return out

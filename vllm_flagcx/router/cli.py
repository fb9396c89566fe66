"""``vllm-flagcx router``: the xPyD proxy in front of prefill and decode vLLM servers.

    vllm-flagcx router --host 127.0.0.1 --port 8000 \\
        --prefill http://10.0.27.1:20001 8998 --decode http://10.0.27.10:20002

``--prefill`` and ``--decode`` repeat for several instances (least-loaded choice); the
optional number after a prefill URL is its connector's side-channel port (needed only by
``--mode concurrent``; sequential mode uses the port prefill returns).
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from vllm_flagcx.router.legs import Pool, RouterConfigError, parse_instance

if TYPE_CHECKING:
    from fastapi import FastAPI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-flagcx router", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", nargs="+", action="append", default=[],
                   metavar="URL [SIDE_CHANNEL_PORT]")
    p.add_argument("--decode", nargs="+", action="append", default=[], metavar="URL")
    p.add_argument("--mode", default="sequential", choices=("sequential", "concurrent"))
    p.add_argument("--connect-timeout", type=float, default=10.0)
    p.add_argument("--prefill-timeout", type=float, default=600.0)
    p.add_argument("--decode-timeout", type=float, default=600.0,
                   help="longest silence inside the decode answer, seconds")
    p.add_argument("--side-channel-secret-file", default=None,
                   help="file holding the router's credential (`--print-credential`), "
                        "or the side-channel secret itself (default: the environment "
                        "variable FLAGCX_SIDE_CHANNEL_SECRET, else none)")
    p.add_argument("--print-credential", action="store_true",
                   help="print the router's credential derived from the secret and exit: "
                        "it may release transfers, never pull KV or renew a lease")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-timelines", action="store_true",
                   help="log one flagcx-timeline line per request at INFO (else DEBUG): "
                        "where its time to first byte went (vllm_flagcx/wire/timeline.py)")
    p.add_argument("--no-prompt-token-ids", dest="prompt_token_ids", action="store_false",
                   help="sequential /v1/completions: send decode the prompt's text, not the "
                        "token ids prefill computed it as (the default saves decode a "
                        "second tokenization on the first token's path)")
    p.add_argument("--no-first-token", dest="first_token", action="store_false",
                   help="sequential /v1/completions: decode computes the first token "
                        "again instead of continuing from prefill's (the default sends "
                        "prefill's first token to the client at once)")
    return p


def build(args: argparse.Namespace) -> FastAPI:
    """The FastAPI app for parsed arguments (RouterConfigError names a bad flag)."""
    from vllm_flagcx.router.app import build_app
    from vllm_flagcx.router.legs import RouterSettings
    from vllm_flagcx.router.proxy import Proxy

    prefill = Pool("prefill", [parse_instance(s, "prefill") for s in args.prefill])
    decode = Pool("decode", [parse_instance(s, "decode") for s in args.decode])
    if any(i.side_channel_port is not None for i in decode.instances):
        raise RouterConfigError("--decode takes only a URL")
    from vllm_flagcx.wire import auth, curve

    try:
        key = curve.load_router_credential(args.side_channel_secret_file)
    except auth.AuthError as exc:
        raise RouterConfigError(_as_router_flag(exc)) from None
    settings = RouterSettings(mode=args.mode, connect_timeout=args.connect_timeout,
                              prefill_timeout=args.prefill_timeout,
                              decode_timeout=args.decode_timeout, key=key,
                              log_timelines=args.log_timelines,
                              prompt_token_ids=args.prompt_token_ids,
                              first_token=args.first_token)
    return build_app(Proxy(prefill, decode, settings))


def print_credential(secret_file: str | None) -> int:
    from vllm_flagcx.wire import auth, curve

    try:
        found = auth.read_secret(secret_file)
        if found is None:
            print(f"vllm-flagcx router --print-credential: no secret; {auth.HOW_TO_SET}")
            return 2
        print(curve.router_credential(auth.key_of(*found)).text())
    except auth.AuthError as exc:
        print(f"vllm-flagcx router: {_as_router_flag(exc)}")
        return 2
    return 0


def _as_router_flag(exc: Exception) -> str:
    """An error about the secret file, naming the router's flag for it."""
    from vllm_flagcx.wire import auth

    return str(exc).replace(f"kv_connector_extra_config.{auth.SECRET_FILE_KEY}",
                            "--side-channel-secret-file")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.print_credential:
        return print_credential(args.side_channel_secret_file)
    try:
        app = build(args)
    except RouterConfigError as exc:
        print(f"vllm-flagcx router: {exc}")
        return 2
    except ImportError as exc:
        print(f"vllm-flagcx router needs fastapi, uvicorn and httpx ({exc}); "
              "pip install 'vllm-flagcx[router]'")
        return 2
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0

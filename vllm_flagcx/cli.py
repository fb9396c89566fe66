"""``vllm-flagcx`` command line: one entry, one subcommand per job."""

from __future__ import annotations

import sys

_COMMANDS = {
    "doctor": ("vllm_flagcx.doctor", "report the installed vLLM's capabilities"),
    "router": ("vllm_flagcx.router.cli", "the xPyD proxy in front of prefill/decode servers"),
    "demo": ("vllm_flagcx.demo.run", "prefill + decode + router on this machine, end to end"),
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in _COMMANDS:
        asked_help = bool(args) and args[0] in ("-h", "--help")
        if args and not asked_help:
            print(f"vllm-flagcx: unknown command {args[0]!r}; choose one of: "
                  f"{', '.join(_COMMANDS)}", file=sys.stderr)
        print("usage: vllm-flagcx COMMAND [ARGS]\n\ncommands:",
              file=sys.stdout if asked_help else sys.stderr)
        for name, (_, helptext) in _COMMANDS.items():
            print(f"  {name:<10} {helptext}", file=sys.stdout if asked_help else sys.stderr)
        return 0 if asked_help else 2
    import importlib

    module = importlib.import_module(_COMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

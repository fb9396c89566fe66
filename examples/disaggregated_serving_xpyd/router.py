"""The design note's router command, unchanged, on vllm-flagcx's router:

    python3 router.py --host 0.0.0.0 --port 8000 \\
        --prefill http://10.0.27.1:20001 8998 --decode http://10.0.27.10:20002

A thin wrapper of ``vllm-flagcx router`` (same flags, ``--help`` lists them), kept where
vllm-plugin-FL users look for it.
"""

from __future__ import annotations

import sys

from vllm_flagcx.router.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

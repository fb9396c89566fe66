"""mypy catches a request id passed where a transfer id belongs, and the reverse, at the
owners of both (decode's ``Loads``, prefill's ``HeldSends`` and ``Sends``, the failure
``FailureLedger``, the side channel's messages): each swap below must be an error, each correct
call beside it none. Runs in ``tox -e lint``; exit 1 names a swap mypy let through."""

from __future__ import annotations

import sys

from mypy import api

SWAPS = '''
from vllm_flagcx.connector.common.metadata import RequestId, SendTask, TransferId
from vllm_flagcx.connector.decode.faults import FailureLedger
from vllm_flagcx.connector.decode.loads import Loads
from vllm_flagcx.connector.scheduler import HeldSends
from vllm_flagcx.connector.prefill.sends import Sends
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.params import RemotePrefill

from typing import Any

r, t = RequestId("r"), TransferId("t")
request: Any = None  # vLLM's Request
remote = RemotePrefill(t, "h", 1, 1, "e", ())
Loads().match(t, request, remote, 0)  # swap
Loads().match(r, request, remote, 0)
HeldSends().holds(r)  # swap
HeldSends().holds(t)
HeldSends().sent(t)  # swap
HeldSends().sent(r)
Sends().release(r, b"")  # swap
Sends().release(t, b"")
Sends().arm(SendTask(t, r, [], 0.0))  # swap
Sends().arm(SendTask(r, t, [], 0.0))
FailureLedger().record("recv", t, [], "")  # swap
FailureLedger().record("recv", r, [], "")
hs.Release(r)  # swap
hs.Release(t)
Loads().get("r")  # swap: a bare string is neither
'''


def main() -> int:
    stdout, _, _ = api.run(["--python-version", "3.10", "--ignore-missing-imports",
                            "--follow-imports=silent", "--no-error-summary", "-c", SWAPS])
    flagged = {int(line.split(":")[1]) for line in stdout.splitlines() if ": error:" in line}
    lines = SWAPS.splitlines()
    missed = [text for n, text in enumerate(lines, 1) if "# swap" in text and n not in flagged]
    wrong = [text for n, text in enumerate(lines, 1) if "# swap" not in text and n in flagged]
    for text in missed:
        print(f"id swap not caught by mypy: {text.strip()}")
    for text in wrong:
        print(f"correct call flagged by mypy: {text.strip()}")
    print(f"id swaps: {len(flagged)} caught, {len(missed)} missed, {len(wrong)} wrong")
    if not flagged:
        print(stdout)
    return 1 if missed or wrong or not flagged else 0


if __name__ == "__main__":
    sys.exit(main())

"""Side-by-side benchmarks (``python -m benchmarks``)."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def use_test_helpers() -> None:
    """Make the test kit importable as the package ``testkit`` (``testkit.peers`` spawns
    transport peers, ``testkit.vllm_harness`` builds the real vLLM Scheduler): the
    benchmarks drive the same parts the tests do instead of keeping copies."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))

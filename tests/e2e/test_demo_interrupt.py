"""The real ``vllm-flagcx demo`` interrupted the way tox interrupts it (SIGINT, SIGTERM
0.3 s later, SIGKILL 0.2 s after that) while its two vLLM engines start: no process of
either engine survives (measured before the fix: both servers reparented to PID 1,
~3.5 GB RSS). The same sequences against server-shaped trees: ``tests/test_demo_procs.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit import router_standin as rs

from vllm_flagcx.demo import procs

pytestmark = pytest.mark.skipif(os.environ.get("VLLM_FLAGCX_E2E") != "1",
                                reason="needs the e2e env (a CPU build of vLLM)")


def _engine_groups(workdir: Path) -> dict[int, int]:
    """{process group: live members} of the vLLM servers whose command line names
    ``workdir`` (their ``--model`` lives there)."""
    groups = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "vllm.entrypoints" in cmdline and str(workdir) in cmdline:
            pgid = os.getpgid(int(entry.name))
            groups[pgid] = len(procs.group_members(pgid))
    return groups


def test_tox_interrupt_sequence_during_engine_start_leaves_no_engine(tmp_path):
    demo = subprocess.Popen(
        [sys.executable, "-m", "vllm_flagcx.cli", "demo", "--workdir", str(tmp_path),
         "--base-port", str(rs.free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    groups: dict[int, int] = {}
    deadline = time.monotonic() + 240
    # Wait until both engines have spawned their engine core (2+ processes per group).
    while time.monotonic() < deadline and demo.poll() is None:
        groups = _engine_groups(tmp_path)
        if len(groups) == 2 and all(n >= 2 for n in groups.values()):
            break
        time.sleep(0.5)
    assert demo.poll() is None, demo.stdout.read().decode()[-3000:]
    assert len(groups) == 2, f"engines not started: {groups}"
    for sig, delay in ((signal.SIGINT, 0.0), (signal.SIGTERM, 0.3), (signal.SIGKILL, 0.2)):
        time.sleep(delay)
        if demo.poll() is None:
            demo.send_signal(sig)
    demo.wait(30)
    deadline = time.monotonic() + 60
    left = list(groups)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = [g for g in groups if procs.group_members(g)]
    assert left == [], f"engine processes left: {[procs.group_members(g) for g in left]}"

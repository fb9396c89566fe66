"""Process groups the demo starts, and the guarantee that none outlives the demo.

Each server runs in its own session, so its process group holds vLLM's API server, engine
core and worker. Stopping one means: SIGTERM the group, wait a bounded grace, SIGKILL what
is left, and check in ``/proc`` that no member remains (the leader having exited proves
nothing: vLLM's engine core is its child and may outlive it).

A reaper process guards against the demo itself dying without its cleanup code running.
tox answers Ctrl-C with SIGINT, then SIGTERM 0.3 s later, then SIGKILL 0.2 s after that; a
SIGKILLed demo runs no ``finally``. The reaper is a separate session, holds the read end of
a pipe the demo writes the live group ids to, and on end-of-file (the demo exited, however
it exited) stops every group still listed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

GRACE_SECONDS = 8.0


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(pgids: Iterable[int], grace: float = GRACE_SECONDS) -> list[int]:
    """SIGTERM every group at once, SIGKILL what is left after ``grace`` seconds; returns
    the groups that still have members after that (empty: all stopped)."""
    pending = [g for g in pgids if group_members(g)]
    for pgid in pending:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [g for g in pending if group_members(g)]
    for pgid in pending:
        _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [g for g in pending if group_members(g)]
    return pending


class Reaper:
    """The watchdog's client side: tell it which groups are live."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_flagcx.demo.procs"], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def _say(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ValueError):
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()

    def watch(self, pgid: int) -> None:
        self._say(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        self._say(f"-{pgid}")


_reaper: Reaper | None = None


def reaper() -> Reaper:
    """This process's reaper, started on first use (a dead one is replaced)."""
    global _reaper
    if _reaper is None or _reaper.proc.poll() is not None:
        _reaper = Reaper()
    return _reaper


def _watch_stdin() -> None:
    """The reaper's loop: track ``+pgid`` / ``-pgid`` lines until EOF, then stop the rest."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only EOF (the demo gone) ends the watch
    live: set[int] = set()
    for raw in sys.stdin.buffer:
        line = raw.strip().decode(errors="replace")
        with contextlib.suppress(ValueError):
            if line.startswith("+"):
                live.add(int(line[1:]))
            elif line.startswith("-"):
                live.discard(int(line[1:]))
    stop_groups(live)


if __name__ == "__main__":
    _watch_stdin()

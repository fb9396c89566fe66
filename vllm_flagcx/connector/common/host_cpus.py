"""Which CPUs this host lets the engine use, and the CPU-binding hint built on it.

``os.cpu_count()`` counts the machine; a container limited by a cpuset may use fewer. A
worker bound by vLLM to *all* the CPUs its container allows is not pinned, so the hint
(``cpu_binding_warning``) compares against the cgroup's effective cpuset, not the
machine's count. Pure parsing in ``parse_cpu_list``; file reading in ``allowed_cpus``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

# cgroup v2 (unified), then v1; inside a container's cgroup namespace both are the
# container's own set.
CPUSET_FILES = (Path("/sys/fs/cgroup/cpuset.cpus.effective"),
                Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus"))


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list syntax (``0-3,8,10-11``) as a set; empty text is no CPUs."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"CPU list {text.strip()!r}: {part!r} is not N or N-M") from None
        if high < low:
            raise ValueError(f"CPU list {text.strip()!r}: range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    return cpus


def allowed_cpus(files: tuple[Path, ...] = CPUSET_FILES) -> set[int]:
    """The cgroup's effective cpuset, or every CPU of the machine when none is readable."""
    for path in files:
        try:
            cpus = parse_cpu_list(path.read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def cpu_binding_warning(pinned: set[int], allowed: set[int], bind_setting: str | None,
                        host_memory: bool) -> str | None:
    """The operator hint for a CPU-backend worker bound by vLLM's automatic binding.

    ``auto`` binds every engine on a host to the same cores; two engines there (a
    single-host PD) then share one core for their busy loops, and the side channel starved
    for seconds to a minute on a 2-core machine. ``allowed``: the CPUs the host lets this
    engine use (``allowed_cpus``, a container's cpuset). None when nothing
    suggests a shared core.
    """
    if not host_memory or not pinned or pinned >= allowed or (bind_setting or "auto") != "auto":
        return None
    return (f"this CPU worker is bound to CPUs {sorted(pinned)} of {len(allowed)} by vLLM's "
            "automatic binding; if another engine (prefill or decode) runs on this host, "
            "give each its own CPUs with VLLM_CPU_OMP_THREADS_BIND (e.g. 0-15 and 16-31), "
            "or their shared cores starve the FlagCX side channel")


def unpin_this_thread() -> None:
    """Let this side-channel thread run on any CPU this host allows (``allowed_cpus``).

    vLLM's CPU worker pins its main thread (and so every thread it starts later) to one
    core shared with its OpenMP compute threads; a side-channel thread there starved for
    seconds behind busy engines (handshakes timed out). Best effort: a cgroup may forbid
    it, and then the thread keeps the worker's affinity.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, allowed_cpus())


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """This thread unpinned for the block, its affinity restored after.

    For what starts threads of its own from the worker's main thread: a ZMQ context's
    I/O thread inherits the affinity of the thread that creates its first socket, and one
    pinned to the OpenMP core answered a first handshake after more than 5 s on a busy
    2-core CI machine (measured: the decode gave up and recomputed).
    """
    saved = None
    if hasattr(os, "sched_getaffinity"):
        with contextlib.suppress(OSError):
            saved = os.sched_getaffinity(0)
    unpin_this_thread()
    try:
        yield
    finally:
        if saved is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, saved)

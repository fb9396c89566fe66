"""Start, watch and stop the demo's processes: vLLM servers and the router.

Each process gets its own session (so one signal stops its whole tree: vLLM's API server,
engine core and worker), a log file, and a bounded wait for ``/health``. ``procs`` makes
sure no group outlives the demo, whatever ends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_flagcx.demo import procs

HOST = "127.0.0.1"
CPU_CLASS_PATH = Path(__file__).resolve().parent / "cpu-class"
ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(?:\w+Error|\w*Exception)(?::|$)")


class DemoError(RuntimeError):
    """A demo step that failed; the message says which and where its log is."""


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = self.log.open("ab")  # a restart keeps the log of the run it replaces
        watcher = procs.reaper()
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                     env=child_env(self.env), start_new_session=True)
        out.close()
        watcher.watch(self.proc.pid)  # a new session: its group id is its pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def members(self) -> list[int]:
        """Live processes of this server's group (vLLM's engine core outlives its parent
        for a while, so the leader's exit alone proves nothing)."""
        return procs.group_members(self.proc.pid) if self.proc is not None else []

    def state(self) -> str:
        """Our own view of a starting server, for the progress line."""
        if self.proc is None:
            return f"{self.name}: not started"
        if not self.alive():
            return f"{self.name}: exited {self.proc.returncode}"
        try:
            size = self.log.stat().st_size
        except OSError:
            size = 0
        return (f"{self.name}: pid {self.proc.pid}, {len(self.members())} processes, "
                f"log {size // 1024} KiB, no /health yet")

    def first_error(self) -> str:
        """The first exception line in the log (the root cause: vLLM's last line is a
        generic "Engine core initialization failed"), else the last line."""
        try:
            lines = self.log.read_bytes()[-2_000_000:].decode(errors="replace").splitlines()
        except OSError:
            return ""
        for line in lines:
            bare = re.sub(r"^\(\w+ pid=\d+\)\s*", "", line.strip())  # vLLM's process prefix
            if ERROR_LINE.match(bare):
                return bare[:300]
        lines = [ln for ln in lines if ln.strip()]
        return lines[-1][-300:] if lines else ""

    def stop(self, grace: float = procs.GRACE_SECONDS) -> None:
        """Stop the whole group (SIGTERM, SIGKILL after ``grace``); DemoError if a member
        is still there afterwards."""
        stop_all([self], grace)

    def kill(self) -> None:
        """SIGKILL the whole tree at once (a crash, for the failure tests)."""
        if self.proc is not None:
            stop_all([self], grace=0)


def stop_all(servers: list[Server], grace: float = procs.GRACE_SECONDS) -> None:
    """Stop every server's group at once; DemoError naming any that survived."""
    started = [s for s in servers if s.proc is not None]
    left = procs.stop_groups([s.proc.pid for s in started], grace)  # type: ignore[union-attr]
    for s in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(1)  # type: ignore[union-attr]
        if s.proc.pid not in left:  # type: ignore[union-attr]
            procs.reaper().forget(s.proc.pid)  # type: ignore[union-attr]
    if left:
        raise DemoError(f"process groups {left} did not stop; kill them: kill -9 -PGID")


# The connector's own environment settings: a started server keeps them (dropping the
# secret silently made the engines serve an unauthenticated side channel).
PRODUCT_ENV = ("VLLM_FLAGCX_SIDE_CHANNEL_SECRET", "VLLM_FLAGCX_CUDA_BATCHED_COPY",
               "FLAGCX_SIDE_CHANNEL_SECRET")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a started server: ours, minus the test harness's
    ``VLLM_FLAGCX_*`` settings (vLLM warns about every unknown ``VLLM_`` variable, and
    that warning then looked like the engine's state) but with the connector's own
    (``PRODUCT_ENV``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_FLAGCX_") or k in PRODUCT_ENV}
    return {**env, **extra}


def split_cpus(parts: int, cpus: list[int] | None = None) -> list[str]:
    """Disjoint CPU lists (``VLLM_CPU_OMP_THREADS_BIND`` syntax), one per co-located engine.

    vLLM's CPU worker binds its main thread and OpenMP threads as if it owned the machine:
    two engines on one host both take the same core. On a 2-core machine that core then
    ran both workers' busy loops, and the prefill side channel starved behind them for
    seconds to a minute (decode's handshakes and pulls timed out). Giving each instance
    its own cores, as an operator does on a shared host, removes the contention.
    """
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < parts:
        return ["nobind"] * parts
    size = len(cpus) // parts
    return [",".join(str(c) for c in cpus[i * size:(i + 1) * size]) for i in range(parts)]


def engine_cpu_isa_env(cpu_isa: str, flags: frozenset[str] | None = None) -> dict[str, str]:
    """Environment that puts an engine on one of vLLM's CPU kernel libraries.

    ``cpu_isa``: ``vec`` (the default of the demo and the e2e tests: the highest class
    below AMX), a class name of ``compat.cpu_kernels`` (``avx2``, ``avx512``,
    ``avx512_bf16``, ``amx``) or ``auto`` (vLLM's own choice). A lower class than the CPU's
    is reached by hiding the higher features from vLLM's torch probes in the engine
    processes (``cpu-class/sitecustomize.py`` on the engine's ``PYTHONPATH``, so the engine
    core and workers it spawns inherit it) and capping torch's and oneDNN's kernels at that
    class. Why hide AMX by default: vllm-cpu 0.22.0's AMX path cannot run the demo's hybrid
    model (float32: the AMX-only conv1d weight prepack fails at load,
    ``causal_conv1d_fwd_kernel_impl not implemented for 'Float'``; bfloat16: the AMX GDN
    core dies on the first prompt, ``Input tensor dtype mismatch``). ``flags``: the CPU's
    (default: this machine's ``/proc/cpuinfo``)."""
    from vllm_flagcx.compat import cpu_kernels

    if cpu_isa == "auto":
        return {}
    try:
        wanted = cpu_kernels.resolve(cpu_isa, cpu_kernels.cpu_flags() if flags is None
                                     else flags)
    except cpu_kernels.CpuClassError as exc:
        raise DemoError(str(exc)) from None
    path = os.pathsep.join(p for p in (str(CPU_CLASS_PATH), os.environ.get("PYTHONPATH"))
                           if p)
    return {"PYTHONPATH": path, **cpu_kernels.engine_env(wanted, class_cache_root())}


def class_cache_root() -> Path:
    """Where engines on a chosen CPU class keep their compile caches, one folder per
    class (``compat.cpu_kernels.engine_env`` says why): ``VLLM_FLAGCX_CPU_CLASS_CACHE``,
    else ``$XDG_CACHE_HOME`` (or ``~/.cache``)/vllm-flagcx/cpu-class."""
    configured = os.environ.get("VLLM_FLAGCX_CPU_CLASS_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-flagcx" / "cpu-class"


def vllm_server(name: str, python: str, model: Path, port: int, log: Path,
                kv_config: dict[str, object] | None, extra: list[str] | None = None,
                cpus: str = "auto", dtype: str = "bfloat16", cpu_isa: str = "vec",
                max_model_len: int = 1024) -> Server:
    """``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; also
    works where the ``vllm`` console script cannot read its own dist metadata, as in the
    ``vllm-cpu`` distribution). ``cpus``: the engine's CPU list (``split_cpus``);
    ``cpu_isa``: ``engine_cpu_isa_env``."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "demo", "--seed", "0",
            "--host", HOST, "--port", str(port), "--max-model-len", str(max_model_len),
            "--dtype", dtype, "--max-num-seqs", "16", *(extra or [])]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
           **engine_cpu_isa_env(cpu_isa)}
    return Server(name, argv, port, log, env)


def router_server(python: str, port: int, log: Path, prefill: list[Server],
                  decode: list[Server], side_channel_port: int,
                  mode: str = "sequential") -> Server:
    argv = [python, "-m", "vllm_flagcx.cli", "router", "--host", HOST, "--port", str(port),
            "--mode", mode, "--log-timelines"]
    for i, p in enumerate(prefill):
        argv += ["--prefill", p.url, str(side_channel_port + 100 * i)]
    for d in decode:
        argv += ["--decode", d.url]
    return Server("router", argv, port, log)


# vLLM picks its internal ports (torch.distributed's store, ZMQ) by binding port 0 and
# letting go; two engines starting at once can be handed the same one and one dies with
# EADDRINUSE. That start is retried (a bounded number of times); nothing else is.
PORT_RACE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
PORT_RACE_RESTARTS = 2


def lost_a_port_race(server: Server, restarts_so_far: int) -> bool:
    """The server died of vLLM's port race (its log says so since the last start)."""
    try:
        tail = server.log.read_bytes()[-2_000_000:].decode(errors="replace")
    except OSError:
        return False
    since_start = tail.split(RESTART_MARK)[-1] if restarts_so_far else tail
    return bool(PORT_RACE.search(since_start))


RESTART_MARK = "\n=== vllm-flagcx: restarted after a port race ===\n"


def wait_healthy(servers: list[Server], timeout: float,
                 progress: Callable[[str], None] | None = None) -> float:
    """Block until every server answers /health; DemoError when one exits or time is up.
    A server that died of vLLM's own port race is restarted, at most
    ``PORT_RACE_RESTARTS`` times."""
    started = time.monotonic()
    restarts: dict[str, int] = {}
    while True:
        elapsed = time.monotonic() - started
        pending = [s for s in servers if not s.healthy()]
        if not pending:
            return elapsed
        for s in pending:
            if s.alive():
                continue
            done = restarts.get(s.name, 0)
            if done < PORT_RACE_RESTARTS and lost_a_port_race(s, done):
                restarts[s.name] = done + 1
                stop_all([s], grace=2)
                with s.log.open("a") as log:
                    log.write(RESTART_MARK)
                s.start()
                continue
            raise DemoError(f"{s.name} exited with {s.proc.returncode if s.proc else '?'}"
                            f" while starting: {s.first_error()}\n  full log: {s.log}")
        if elapsed > timeout:
            raise DemoError(f"{', '.join(s.name for s in pending)} not healthy after "
                            f"{timeout:.0f} s; see {pending[0].log}")
        if progress is not None:
            progress(f"[{elapsed:5.0f} s] " + "; ".join(s.state() for s in pending))
        time.sleep(2)


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """Start ``servers``; stop all of them on exit, Ctrl-C included.

    The teardown ignores SIGINT and SIGTERM while it runs: tox and terminals send a second
    signal within a second, and an interrupted teardown left both engines running."""
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        with signals_ignored():
            stop_all(servers)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside (main thread only; elsewhere a no-op)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT,
                                                                 signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def post_json(url: str, body: dict[str, object], timeout: float = 300) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def streamed_text(lines: Iterable[bytes]) -> str:
    """The completion's text from an OpenAI server-sent event stream (``stream: true``):
    each ``data:`` event's first choice's text, joined, up to ``[DONE]``. An event that
    carries an ``error`` (vLLM's mid-stream failure), or a stream without ``[DONE]``,
    raises ``DemoError`` naming it: a cut stream must not read as a shorter answer."""
    parts: list[str] = []
    for raw in lines:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return "".join(parts)
        event = json.loads(data)
        if "error" in event:
            raise DemoError(f"the stream carried an error: {str(event['error'])[:300]}")
        choices = event.get("choices") or []
        if choices:
            parts.append(choices[0].get("text") or "")
    raise DemoError("the stream ended without [DONE] (cut off)")


def post_stream(url: str, body: Mapping[str, object], timeout: float = 300
                ) -> tuple[str, float, float]:
    """POST ``body`` with ``stream: true``: (the joined text, seconds to the first event,
    seconds to the end), or ``DemoError`` with the server's answer when it is not HTTP
    200."""
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    first: list[float] = []

    def lines(r: Iterable[bytes]) -> Iterator[bytes]:
        for line in r:
            if not first and line.strip():
                first.append(time.monotonic() - started)
            yield line

    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            text = streamed_text(lines(r))
    except urllib.error.HTTPError as exc:
        raise DemoError(f"{url} answered HTTP {exc.code}: "
                        f"{exc.read().decode(errors='replace')[:300]}") from exc
    # a returned text saw its ``[DONE]`` line, so ``first`` holds a time
    return text, first[0], time.monotonic() - started


def get_text(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def python_for_vllm() -> str:
    return os.environ.get("VLLM_FLAGCX_DEMO_PYTHON", sys.executable)

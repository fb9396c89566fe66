"""Start, watch and stop the demo's processes: vLLM servers and the router.

Each process gets its own session (so one signal stops its whole tree: vLLM's API server,
engine core and worker), a log file, and a bounded wait for ``/health``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


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
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, start_new_session=True)
        out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def last_line(self) -> str:
        try:
            lines = self.log.read_bytes()[-4000:].decode(errors="replace").splitlines()
        except OSError:
            return ""
        lines = [ln for ln in lines if ln.strip()]
        return lines[-1][-110:] if lines else ""

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL the whole tree at once (a crash, for the failure tests)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


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


def vllm_server(name: str, python: str, model: Path, port: int, log: Path,
                kv_config: dict[str, Any] | None, extra: list[str] | None = None,
                cpus: str = "auto", dtype: str = "bfloat16") -> Server:
    """``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; also
    works where the ``vllm`` console script cannot read its own dist metadata, as in the
    ``vllm-cpu`` distribution). ``cpus``: the engine's CPU list (``split_cpus``)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "demo", "--seed", "0",
            "--host", HOST, "--port", str(port), "--max-model-len", "1024",
            "--dtype", dtype, "--max-num-seqs", "16", *(extra or [])]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus}
    return Server(name, argv, port, log, env)


def router_server(python: str, port: int, log: Path, prefill: list[Server],
                  decode: list[Server], side_channel_port: int,
                  mode: str = "sequential") -> Server:
    argv = [python, "-m", "vllm_flagcx.cli", "router", "--host", HOST, "--port", str(port),
            "--mode", mode]
    for i, p in enumerate(prefill):
        argv += ["--prefill", p.url, str(side_channel_port + 100 * i)]
    for d in decode:
        argv += ["--decode", d.url]
    return Server("router", argv, port, log)


def wait_healthy(servers: list[Server], timeout: float,
                 progress: Callable[[str], None] | None = None) -> float:
    """Block until every server answers /health; DemoError when one exits or time is up."""
    started = time.monotonic()
    while True:
        elapsed = time.monotonic() - started
        pending = [s for s in servers if not s.healthy()]
        if not pending:
            return elapsed
        for s in pending:
            if not s.alive():
                raise DemoError(f"{s.name} exited with {s.proc.returncode if s.proc else '?'}"
                                f" while starting; see {s.log}: {s.last_line()}")
        if elapsed > timeout:
            raise DemoError(f"{', '.join(s.name for s in pending)} not healthy after "
                            f"{timeout:.0f} s; see {pending[0].log}")
        if progress is not None:
            progress(f"[{elapsed:5.0f} s] starting {', '.join(s.name for s in pending)}: "
                     f"{pending[0].last_line()}")
        time.sleep(2)


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """Start ``servers``; stop all of them on exit, Ctrl-C included."""
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()


def post_json(url: str, body: dict[str, Any], timeout: float = 300) -> tuple[int, Any]:
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


def get_text(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def python_for_vllm() -> str:
    return os.environ.get("VLLM_FLAGCX_DEMO_PYTHON", sys.executable)

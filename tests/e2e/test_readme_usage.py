"""README's "Using it with vLLM" block, run as written: extracted from the file (as
``.ci/run`` extracts the test command), with ``MODEL`` set to the demo's model, in a
scratch directory. The answer the router gives must equal prefill's own answer to the
same request, and KV bytes must have arrived at decode (decode did not recompute).

Runs in the ``e2e`` tox env (``VLLM_FLAGCX_E2E=1``). The block runs vLLM's CPU engines on
the machine's own x86 class; on AMX machines it is skipped: vLLM's AMX path is not one
the e2e suite proves (docs/cpu-classes.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vllm_flagcx.demo import model as demo_model
from vllm_flagcx.demo import run as demo_run

pytestmark = pytest.mark.skipif(os.environ.get("VLLM_FLAGCX_E2E") != "1",
                                reason="real engines: tox -e e2e")
README = Path(__file__).resolve().parents[2] / "README.md"
START_SECONDS = 900


def usage_block() -> str:
    """The bash block after ``<!-- usage-command -->`` in README.md."""
    text = README.read_text()
    match = re.search(r"<!-- usage-command -->\s*```bash\n(.*?)\n```", text, re.S)
    assert match, "README.md has no bash block after <!-- usage-command -->"
    return match.group(1)


def test_the_usage_block_parses_and_names_its_ports():
    block = usage_block()
    assert subprocess.run(["bash", "-n", "-c", block]).returncode == 0
    for needed in ("kv_producer", "kv_consumer", "vllm-flagcx router", "side_channel_port"):
        assert needed in block, needed


def test_readme_usage_runs_as_written_and_pd_equals_prefills_answer(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("the README block uses curl, which this machine lacks")
    if demo_run.engine_class("auto") == "amx":
        pytest.skip("vLLM's AMX path is not proven by the e2e suite (docs/cpu-classes.md)")
    model = demo_model.write_model(tmp_path / "model", "sliding")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLLM_FLAGCX_")},
           "MODEL": str(model), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1",
           "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"]))}
    proc = subprocess.Popen(["bash", "-c", usage_block()], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=START_SECONDS)
        logs = {n: (tmp_path / f"{n}.log") for n in ("prefill", "decode", "router")}
        assert "{" in out, (out[-2000:], {n: p.read_text()[-2000:] for n, p in logs.items()
                                           if p.exists()})
        via_pd = json.loads(out[out.index("{"):])["choices"][0]["text"]
        mono = httpx.post("http://127.0.0.1:8100/v1/completions", timeout=120, json={
            "model": str(model), "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0}).json()["choices"][0]["text"]
        assert via_pd == mono
        deadline = time.monotonic() + 5
        while demo_run.metric("http://127.0.0.1:8200", "vllm:flagcx_bytes_transferred_sum") <= 0:
            assert time.monotonic() < deadline, "no KV bytes arrived at decode"
            time.sleep(0.2)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(5)

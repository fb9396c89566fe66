"""The product files one PD request runs code in, router to decode and back: a newcomer
reading a request reads these. Recorded with a profile hook on every thread (the side
channel's and the pullers' included) over one warm request: the real router in front of
stand-in engines (the seeded first-token path, streamed), and the real Schedulers with
the product's entry class over the same-host transport (hybrid where decode can load it,
TP 1 each: the entry reads its rank from vLLM's TP group, absent here; other TPs take
the same files). Startup is not counted: it runs once per engine, not per request.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
from testkit import pd_harness as pd
from testkit import router_standin as rs

import vllm_flagcx

PACKAGE = Path(vllm_flagcx.__file__).parent
# a ratchet a little above today's count (31-32 on vLLM 0.13, 0.22 and 0.34; 45 before files
# that belong together merged; what runs on a timer, the heartbeat, may or may not fall in
# the window): lower it as more merge (a reviewer can walk ~25); the test prints the list
MAX_FILES = 33


class _Recorder:
    """Package files whose code ran while ``on``; installed on every thread started
    after ``installed()`` opens and on this one."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()

    def _hook(self, frame, event, _arg):  # sys.setprofile's shape
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(str(PACKAGE)):
                self.files.add(str(Path(name).relative_to(PACKAGE.parent)))

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Recorder]:
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


def _router_files() -> set[str]:
    body = {"model": "demo", "prompt": [11, 12, 13], "max_tokens": 4, "temperature": 0,
            "stream": True}
    rec = _Recorder()
    with rec.installed(), \
            rs.upstream("prefill", text=" Once", prompt_ids=[11, 12, 13], token_ids=[42]) as p, \
            rs.upstream("decode", text="upon a time") as d, \
            rs.router([p], [d]) as (url, _), httpx.Client() as client:
        for recording in (False, True):  # the first request warms the connections
            rec.on = recording
            with client.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
                assert r.status_code == 200
                assert sum(ln.startswith("data: {") for ln in r.iter_lines()) == 4
            rec.on = False
    return rec.files


def _connector_files() -> set[str]:
    from vllm_flagcx.compat.capabilities import capabilities

    # the hybrid target where this vLLM can load it on decode (0.20+), else dense
    model = "dense" if capabilities().hybrid_async_load == "single_group" else "hybrid"
    rec = _Recorder()
    with rec.installed():
        port = pd.free_port()
        p = pd.build_instance("kv_producer", 1, port, seed=1, via_entry=True,
                              transport="local", model=model)
        d = pd.build_instance("kv_consumer", 1, port + 5, seed=2, via_entry=True,
                              transport="local", model=model)
        try:
            pd.run_pd(p, d, prompts=[37])  # warm: handshakes, connections
            rec.on = True
            records = pd.run_pd(p, d, prompts=[70])
            rec.on = False
            assert all(r["params"] for r in records.values())
            pd.assert_attention_bytes_moved(p, d, records)
        finally:
            p.shutdown()
            d.shutdown()
    return rec.files


def test_one_pd_request_enters_few_product_files():
    files = sorted(_router_files() | _connector_files())
    listing = "\n".join(files)
    print(f"{len(files)} product files on one PD request's path:\n{listing}")
    assert any(f.startswith("vllm_flagcx/router/") for f in files)
    assert any(f.startswith("vllm_flagcx/connector/decode/") for f in files)
    assert any(f.startswith("vllm_flagcx/connector/prefill/") for f in files)
    assert len(files) <= MAX_FILES, listing

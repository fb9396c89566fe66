"""The REAL ctypes binding of FlagCX's P2P C ABI, against a C stand-in built here.

The stand-in (tests/flagcx_standin/flagcx_standin.c) exports the same symbols with the same
semantics (server, region-table exchange, writes by absolute address into the peer
process); FlagCX itself needs an accelerator runtime and an RDMA NIC.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import peers
import pytest

from vllm_flagcx.connector import plans, regions
from vllm_flagcx.transport import flagcx as fx

SOURCE = Path(__file__).parent / "flagcx_standin" / "flagcx_standin.c"


def _build(out: Path, *defines: str) -> Path:
    subprocess.run(["gcc", "-shared", "-fPIC", "-pthread", "-O2", *defines, "-o", str(out),
                    str(SOURCE)], check=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the FlagCX stand-in")
    d = tmp_path_factory.mktemp("flagcx")
    return {"good": _build(d / "libflagcx.so"),
            "old": _build(d / "libflagcx_old.so", "-DSTANDIN_VERSION=1200"),
            "partial": _build(d / "libflagcx_partial.so", "-DOMIT_BATCH_WRITE")}


def test_missing_library_and_missing_setting(monkeypatch, tmp_path):
    with pytest.raises(fx.FlagCXLoadError, match="cannot load libflagcx from"):
        fx.FlagCXLibrary(tmp_path / "nope.so")
    for var in ("FLAGCX_LIB_PATH", "FLAGCX_PATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(fx.FlagCXLoadError, match="flagcx_library, or FLAGCX_LIB_PATH"):
        fx.library_path(None)
    monkeypatch.setenv("FLAGCX_PATH", "/opt/flagcx")
    assert fx.library_path(None) == Path("/opt/flagcx/build/lib/libflagcx.so")
    monkeypatch.setenv("FLAGCX_LIB_PATH", "/x/libflagcx.so")
    assert fx.library_path(None) == Path("/x/libflagcx.so")
    assert fx.library_path("/explicit.so") == Path("/explicit.so")


def test_missing_symbol_names_it_with_versions(libs):
    with pytest.raises(fx.FlagCXLoadError) as err:
        fx.FlagCXLibrary(libs["partial"])
    text = str(err.value)
    assert "lacks flagcxP2pRpcBatchWriteSync" in text and "FlagCX 0.13.0" in text
    assert ">= 0.13.0" in text


def test_old_version_is_refused(libs):
    with pytest.raises(fx.FlagCXLoadError, match=r"is FlagCX 0\.12\.0; 0\.13\.0 or newer"):
        fx.FlagCXLibrary(libs["old"])


def test_importing_the_connector_never_loads_the_library(libs):
    code = ("import os, vllm_flagcx.connector, vllm_flagcx.transport.flagcx\n"
            "print(any('flagcx.so' in l for l in open('/proc/self/maps')))")
    env = {"FLAGCX_LIB_PATH": str(libs["good"]), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_split_large_descriptors():
    src = np.array([0, 1000], dtype=np.uint64)
    dst = np.array([5000, 9000], dtype=np.uint64)
    length = np.array([25, 10], dtype=np.uint64)
    s, d, n = fx.split_large(src, dst, length, limit=10)
    assert s.tolist() == [0, 10, 20, 1000] and d.tolist() == [5000, 5010, 5020, 9000]
    assert n.tolist() == [10, 10, 5, 10]


@pytest.fixture
def decode_process(libs):
    size = 1 << 20
    with peers.spawned(peers.decode_side, size, "flagcx", str(libs["good"])) as (
            conn, (desc, base)):
        yield conn, desc, base, size


def test_two_processes_write_through_the_binding(libs, decode_process):
    conn, desc, d_base, size = decode_process
    block = 4096
    src_buf = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    p = fx.FlagCXTransport(fx.FlagCXLibrary(libs["good"]))
    p.register(src_buf.ctypes.data, size)

    def region(base):
        return regions.mla(layer="l", group=0, base=base, block_stride=block,
                           num_blocks=size // block, page_bytes=block)

    p_ids, d_ids = [3, 4, 5, 6, 40, 100], [10, 11, 12, 13, 2, 90]
    plan = plans.plan_transfer(region(src_buf.ctypes.data), region(d_base), [p_ids], [d_ids],
                               plans.RankPair(0, 1, 0, 1))
    handle = p.connect(desc)
    assert p.write(handle, plan.src, plan.dst, plan.length).ok
    outside = p.write(handle, plan.src[:1], np.array([d_base + size], dtype=np.uint64),
                      plan.length[:1])
    assert not outside.ok and "outside the peer's registered regions" in outside.error
    conn.send("done")
    got = np.frombuffer(conn.recv(), dtype=np.uint8).reshape(-1, block)
    want = src_buf.reshape(-1, block)
    for pb, db in zip(p_ids, d_ids, strict=True):
        np.testing.assert_array_equal(got[db], want[pb])
    p.close()


def test_write_failure_is_reported(libs, decode_process, monkeypatch):
    conn, desc, d_base, _ = decode_process
    monkeypatch.setenv("FLAGCX_STANDIN_FAIL_WRITE_FROM", "0")
    src = np.zeros(64, dtype=np.uint8)
    p = fx.FlagCXTransport(fx.FlagCXLibrary(libs["good"]))
    p.register(src.ctypes.data, 64)
    result = p.write(p.connect(desc), np.array([src.ctypes.data], dtype=np.uint64),
                     np.array([d_base], dtype=np.uint64), np.array([64], dtype=np.uint64))
    assert not result.ok and "flagcxResult 2" in result.error
    conn.send("done")
    conn.recv()
    p.close()


def test_auto_picks_flagcx_only_when_the_library_loads(libs, monkeypatch):
    from vllm_flagcx.connector.entry import transport_factory_path

    def extra(values):
        return lambda key, default=None: values.get(key, default)

    monkeypatch.delenv("FLAGCX_LIB_PATH", raising=False)
    monkeypatch.delenv("FLAGCX_PATH", raising=False)
    assert transport_factory_path(extra({})).endswith("local:create_transport")
    good = extra({"flagcx_library": str(libs["good"])})
    assert transport_factory_path(good).endswith("flagcx:create_transport")
    old = extra({"flagcx_library": str(libs["old"])})
    assert transport_factory_path(old).endswith("local:create_transport")


@pytest.mark.parametrize("silent_loss", [False, True])
def test_connector_over_the_flagcx_binding(libs, monkeypatch, silent_loss):
    """FlagCXConnector's worker role with transport='flagcx' (the real binding over the
    stand-in engine): bytes arrive; a silent slice loss is caught by the integrity check."""
    import pd_harness as pd
    import vllm_harness as harness

    if silent_loss:
        monkeypatch.setenv("FLAGCX_STANDIN_SILENT_SKIP", "1")
    port = pd.free_port()
    extra = {"flagcx_library": str(libs["good"])}
    p = pd.build_instance("kv_producer", 1, port, model="dense", via_entry=True,
                          transport="flagcx", extra=extra, seed=11)
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", via_entry=True,
                          transport="flagcx", extra=extra, seed=12)
    try:
        assert p.workers[0].transport.name == "flagcx"
        records = pd.run_pd(p, d, prompts=[33])
        rec = next(iter(records.values()))
        assert rec["d_req"] in pd.finished_ids(d)
        integrity_failures = d.workers[0].stats["integrity_failures"]
        if silent_loss:
            assert integrity_failures == 1 and d.workers[0].ledger.counts["recv"] == 1
        else:
            assert integrity_failures == 0
            send = next(iter(p.send_tasks.values()))
            recv = d.recv_tasks[rec["d_req"]]
            layer = p.ranks[0].config.kv_cache_groups[0].layer_names[0]
            for pb, db in zip(send.block_ids[0], recv.block_ids[0], strict=True):
                np.testing.assert_array_equal(pd.attention_block_bytes(d, layer, db),
                                              pd.attention_block_bytes(p, layer, pb))
        for inst in (p, d):
            assert not inst.scheduler.has_requests()
            assert harness.blocks_in_use(inst.scheduler) == 0
    finally:
        p.shutdown()
        d.shutdown()

"""The REAL ctypes binding of FlagCX's P2P C ABI, against a C stand-in built here.

The stand-in (tests/flagcx_standin/flagcx_standin.c) exports the same symbols with the same
semantics (server, region-table exchange, writes by absolute address into the peer
process) and answers as the real facade does (-1 for every failure, "Not implemented.",
version 10000); FlagCX's engine itself needs an RDMA NIC. The real library, built from
its sources: ``test_flagcx_real.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from testkit import peers

from vllm_flagcx.layout import plans, regions
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
            "release": _build(d / "libflagcx_release.so", "-DOMIT_REGISTER_HOST"),
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


def test_missing_required_symbol_is_named(libs):
    with pytest.raises(fx.FlagCXLoadError) as err:
        fx.FlagCXLibrary(libs["partial"])
    text = str(err.value)
    assert "lacks flagcxP2pRpcBatchWriteSync" in text and "v0.13.0" in text
    assert "flagcxGetVersion 10000 (1.0.0)" in text  # shown as it is, not as a gate


def test_release_without_register_host_loads_and_registers_host_memory(libs):
    """M1: flagcxP2pRpcRegisterHost is in no release; the binding must load one, and use
    RegisterHost for host caches only where the library has it."""
    release = fx.FlagCXLibrary(libs["release"])
    assert release.optional == set()
    assert release.version == "flagcxGetVersion 10000 (1.0.0)"  # M2: every release says so
    buf = np.zeros(4096, dtype=np.uint8)
    t = fx.FlagCXTransport(release, rdma_sysfs=None, host_memory=True)
    t.register(buf.ctypes.data, buf.size)  # falls back to flagcxP2pRpcRegister
    t.close()
    good = fx.FlagCXLibrary(libs["good"])
    assert good.optional == {"flagcxP2pRpcRegisterHost"}
    counter = __import__("ctypes").c_int.in_dll(good.lib, "host_registrations")
    before = counter.value
    t = fx.FlagCXTransport(good, rdma_sysfs=None, host_memory=True)
    t.register(buf.ctypes.data, buf.size)
    assert counter.value == before + 1
    t.close()


def test_no_rdma_device_is_refused_before_the_engine_exists(libs, tmp_path):
    """M5: with libibverbs and no RDMA device the real engine is created and its first
    registration segfaults; the transport looks first and names the fix."""
    with pytest.raises(fx.FlagCXLoadError, match=r"no RDMA device.*transport='local'"):
        fx.FlagCXTransport(fx.FlagCXLibrary(libs["good"]), rdma_sysfs=tmp_path)
    (tmp_path / "mlx5_0").mkdir()
    assert fx.require_rdma_device(tmp_path) == ["mlx5_0"]
    fx.FlagCXTransport(fx.FlagCXLibrary(libs["good"]), rdma_sysfs=tmp_path).close()


def test_failure_text_says_failed_and_what_was_asked(libs, monkeypatch):
    """M3: -1 and "Not implemented." for every failure: the message names the call, the
    memory and the size instead."""
    monkeypatch.setenv("FLAGCX_STANDIN_REFUSE_REGISTER", "1")
    t = fx.FlagCXTransport(fx.FlagCXLibrary(libs["good"]), rdma_sysfs=None)
    with pytest.raises(fx.TransportError) as err:
        t.register(0x1000, 8192)
    text = str(err.value)
    assert "flagcxP2pRpcRegister(address 0x1000, 8192 bytes, device memory) failed" in text
    assert "returned -1" in text and "Not implemented." in text
    t.close()


def test_get_conn_to_a_silent_peer_is_bounded_by_our_timeout(libs, monkeypatch):
    monkeypatch.setenv("FLAGCX_STANDIN_GETCONN_DELAY", "5")
    t = fx.FlagCXTransport(fx.FlagCXLibrary(libs["good"]), rdma_sysfs=None,
                           connect_timeout=0.5)
    import time

    started = time.monotonic()
    with pytest.raises(fx.TransportError, match="did not answer within"):
        t.connect(b"127.0.0.1:9")
    assert time.monotonic() - started < 3


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
    p = fx.FlagCXTransport(fx.FlagCXLibrary(libs["good"]), rdma_sysfs=None)
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
    assert not outside.ok and "failed (returned -1" in outside.error
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
    p = fx.FlagCXTransport(fx.FlagCXLibrary(libs["good"]), rdma_sysfs=None)
    p.register(src.ctypes.data, 64)
    result = p.write(p.connect(desc), np.array([src.ctypes.data], dtype=np.uint64),
                     np.array([d_base], dtype=np.uint64), np.array([64], dtype=np.uint64))
    assert not result.ok and "1 descriptors, 64 bytes) failed (returned -1" in result.error
    conn.send("done")
    conn.recv()
    p.close()


def test_auto_picks_flagcx_only_when_the_library_loads(libs, monkeypatch):
    from vllm_flagcx.connector.common.settings import ConnectorSettings
    from vllm_flagcx.connector.common.transport_choice import chosen_transport

    def chosen(values):
        return chosen_transport(ConnectorSettings.from_extra(values))

    monkeypatch.delenv("FLAGCX_LIB_PATH", raising=False)
    monkeypatch.delenv("FLAGCX_PATH", raising=False)
    assert chosen({}) == "local"
    assert chosen({"flagcx_library": str(libs["good"]), "flagcx_rdma_check": False}) == "flagcx"
    assert chosen({"flagcx_library": str(libs["partial"]), "flagcx_rdma_check": "off"}) == "local"
    if not fx.rdma_devices():  # no RDMA device here: auto keeps the same-host transport
        assert chosen({"flagcx_library": str(libs["good"])}) == "local"


@pytest.mark.parametrize("rdma_off", [False, 0, "0", "no", "off", "false"])
def test_the_library_is_loaded_once_and_every_spelling_of_off_reaches_the_transport(
        libs, monkeypatch, rdma_off):
    """``transport: auto`` probes libflagcx and the transport then uses the same load (it
    used to be loaded and checked twice); ``flagcx_rdma_check`` spelled any way the
    settings accept as off is off for the transport too (it used to re-read the raw value,
    where only "false" meant off, so auto chose flagcx and the transport then refused)."""
    from vllm_flagcx.connector.common.settings import ConnectorSettings
    from vllm_flagcx.connector.common.transport_choice import chosen_transport, make_transport

    loads = []
    real_init = fx.FlagCXLibrary.__init__

    def counting_init(self, path):
        loads.append(path)
        real_init(self, path)

    monkeypatch.setattr(fx, "_LOADED", {})
    monkeypatch.setattr(fx.FlagCXLibrary, "__init__", counting_init)
    settings = ConnectorSettings.from_extra({
        "flagcx_library": str(libs["good"]), "flagcx_rdma_check": rdma_off,
        "handshake_timeout": "7"})
    assert chosen_transport(settings) == "flagcx"
    transport = make_transport(settings, None, 0, host_memory=True)
    assert transport.library is fx.load_library(libs["good"])
    assert transport.connect_timeout == 7.0
    assert len(loads) == 1
    transport.close()
    if not fx.rdma_devices():  # here the check, left on, refuses: so it was off above
        on = ConnectorSettings.from_extra({"flagcx_library": str(libs["good"]),
                                           "transport": "flagcx", "flagcx_rdma_check": "on"})
        with pytest.raises(fx.FlagCXLoadError, match="RDMA"):
            make_transport(on, None, 0, host_memory=True)
    with pytest.raises(fx.FlagCXLoadError):
        fx.load_library(libs["good"].parent / "missing.so")
    assert libs["good"].parent / "missing.so" not in fx._LOADED


@pytest.mark.parametrize("silent_loss", [False, True])
def test_connector_over_the_flagcx_binding(libs, monkeypatch, silent_loss):
    """FlagCXConnector's worker role with transport='flagcx' (the real binding over the
    stand-in engine): bytes arrive; a silent slice loss is caught by the integrity check."""
    from testkit import pd_harness as pd
    from testkit import vllm_harness as harness

    if silent_loss:
        monkeypatch.setenv("FLAGCX_STANDIN_SILENT_SKIP", "1")
    port = pd.free_port()
    extra = {"flagcx_library": str(libs["good"]), "flagcx_rdma_check": False}  # stand-in
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

"""The negative controls' knob (``connector.decode.faults``): off unless the decode instance
allows it, named values only, and each fault really changes what decode holds (real vLLM
Schedulers and the connector's workers, ``pd_harness``)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from testkit import pd_harness as pd

from vllm_flagcx.connector.decode import faults
from vllm_flagcx.layout.regions import Region


def test_fault_is_refused_where_faults_are_off_and_must_be_named():
    assert faults.requested_fault("", enabled=False) == ""
    with pytest.raises(faults.FaultKnobError, match="test_faults=true"):
        faults.requested_fault("drop_all", enabled=False)
    with pytest.raises(faults.FaultKnobError, match="use one of"):
        faults.requested_fault("bogus", enabled=True)
    assert faults.requested_fault("corrupt_block", True) == "corrupt_block"


def test_corrupt_first_block_touches_only_that_block_of_group_zero():
    buf = np.zeros(4 * 64, dtype=np.uint8)
    base = buf.ctypes.data_as(ctypes.c_void_p).value
    regions = [Region("a", "a", 0, "full_attention", base, 64, 2, 32),
               Region("b", "b", 1, "sliding_window", base + 128, 64, 2, 32)]
    written = faults.corrupt_first_block(regions, [[1], [0]],
                                              faults.memory_filler(host_memory=True))
    assert written == 32
    assert (buf[64:96] == faults.GARBAGE_BYTE).all()
    assert not buf[:64].any() and not buf[96:].any()


def _pd_with_fault(fault: str, enabled: bool = True):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense", seed=1,
                          test_faults=enabled)
    records = pd.run_prefill(p, [48])
    for rec in records.values():
        rec["params"] = {**rec["params"], faults.PARAM: fault}
    pd.run_decode(p, d, records)
    return p, d, records


@pytest.mark.parametrize("fault", faults.FAULTS)
def test_each_fault_leaves_decode_holding_other_bytes_than_prefill(fault):
    p, d, records = _pd_with_fault(fault)
    try:
        rec = next(iter(records.values()))
        layer = p.ranks[0].config.kv_cache_groups[0].layer_names[0]
        p_block = next(iter(p.send_tasks.values())).block_ids[0][0]
        d_block = d.recv_tasks[rec["d_req"]].block_ids[0][0]
        assert not np.array_equal(pd.attention_block_bytes(p, layer, p_block),
                                  pd.attention_block_bytes(d, layer, d_block))
        assert sum(sum(w.ledger.counts.values()) for w in d.workers) == 0  # silent
        assert not pd.busy(p) and not pd.busy(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_control_without_a_fault_decode_holds_prefills_bytes():
    p, d, records = _pd_with_fault("")
    try:
        rec = next(iter(records.values()))
        layer = p.ranks[0].config.kv_cache_groups[0].layer_names[0]
        p_block = next(iter(p.send_tasks.values())).block_ids[0][0]
        d_block = d.recv_tasks[rec["d_req"]].block_ids[0][0]
        assert np.array_equal(pd.attention_block_bytes(p, layer, p_block),
                              pd.attention_block_bytes(d, layer, d_block))
    finally:
        p.shutdown()
        d.shutdown()


def test_fault_asked_where_faults_are_off_fails_the_receive():
    p, d, _ = _pd_with_fault("drop_all", enabled=False)
    try:
        assert sum(sum(w.ledger.counts.values()) for w in d.workers) == 1
        assert not pd.busy(p) and not pd.busy(d)
    finally:
        p.shutdown()
        d.shutdown()

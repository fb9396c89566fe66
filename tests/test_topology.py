"""Our TP arithmetic, and a cross-check against vLLM's own helper where it exists."""

from __future__ import annotations

import itertools

import pytest

from vllm_flagcx.compat.probe import optional
from vllm_flagcx.layout import topology as t

CASES = [(lt, rt, h) for lt, rt in itertools.product([1, 2, 4, 8], repeat=2)
         for h in (1, 2, 4, 8, 16)]


def test_tp_ratio_signed():
    assert t.tp_ratio(4, 2) == 2
    assert t.tp_ratio(2, 8) == -4
    assert t.tp_ratio(3, 3) == 1
    with pytest.raises(t.TopologyError, match="one must divide the other"):
        t.tp_ratio(3, 2)
    with pytest.raises(t.TopologyError, match="local_tp must be a positive integer"):
        t.tp_ratio(0, 2)


@pytest.mark.parametrize(("local_tp", "remote_tp", "heads"), CASES)
def test_targets_cover_exactly_the_local_heads(local_tp, remote_tp, heads):
    for rank in range(local_tp):
        lo, hi = t.head_range(rank, local_tp, heads)
        covered = set()
        targets = t.target_remote_ranks(rank, local_tp, remote_tp, heads)
        for remote in targets:
            r_lo, r_hi = t.head_range(remote, remote_tp, heads)
            span = set(range(max(lo, r_lo), min(hi, r_hi)))
            assert span, f"remote {remote} holds none of rank {rank}'s heads"
            assert not (span & covered), "two targets for the same heads"
            covered |= span
        assert covered == set(range(lo, hi))


def test_replication_and_mla():
    assert t.is_kv_replicated(8, 2) and not t.is_kv_replicated(2, 2)
    assert t.replicates_kv_cache(1, 8, is_mla=True)
    assert t.target_remote_ranks(0, 1, 4, 2) == [0, 2]  # P replicates: one per head group
    assert t.target_remote_ranks(3, 4, 8, 1, is_mla=True) == [6]
    hs = t.head_slice(sender_rank=1, sender_tp=4, receiver_rank=0, receiver_tp=2,
                      num_kv_heads=8)
    assert hs == t.HeadSlice(src_head_offset=0, dst_head_offset=2, num_heads=2)
    assert t.head_slice(0, 4, 1, 2, 8) is None


def test_block_size_ratio():
    assert t.block_size_ratio(64, 16) == 4
    assert t.block_size_ratio(16, 16) == 1
    with pytest.raises(t.TopologyError, match="must divide each other"):
        t.block_size_ratio(48, 32)


@pytest.fixture(scope="module")
def attn_backend():
    from testkit import vllm_harness as harness

    from vllm_flagcx.compat import attention

    return attention.current_attn_backends(harness.make_vllm_config())[0]


def _vllm_targets(helper_cls, backend, local_rank, local_tp, remote_tp, heads):
    """vLLM's own answer, through whichever constructor form the installed helper has."""
    import inspect

    params = inspect.signature(helper_cls).parameters
    if hasattr(helper_cls, "handshake_target_ranks"):  # 0.20+ TransferTopology
        kwargs = dict(tp_rank=local_rank, tp_size=local_tp, block_size=16, engine_id="local",
                      is_mla=False, is_mamba=True, total_num_kv_heads=heads,
                      attn_backends=[backend])
        topo = helper_cls(**{k: v for k, v in kwargs.items() if k in params})
        return topo.handshake_target_ranks(remote_tp)
    if local_tp % remote_tp:  # 0.13 TpKVTopology: D_TP >= P_TP only
        return None
    topo = helper_cls(tp_rank=local_rank, remote_tp_size={"local": local_tp}, is_mla=False,
                      total_num_kv_heads=heads, attn_backend=backend,
                      engine_id="local", remote_block_size={"local": 16})
    return [topo.get_target_remote_rank(remote_tp)]


@pytest.mark.parametrize(("local_tp", "remote_tp", "heads"), CASES)
def test_matches_vllm_helper(local_tp, remote_tp, heads, attn_backend):
    helper = optional("vllm_tp_topology")
    if helper is None:
        pytest.skip("no TP helper in this vLLM build")
    for rank in range(local_tp):
        try:
            theirs = _vllm_targets(helper, attn_backend, rank, local_tp, remote_tp, heads)
        except (TypeError, AttributeError, AssertionError) as exc:
            pytest.fail(f"vLLM helper could not be built: {exc}")
        if theirs is None:
            continue
        ours = t.target_remote_ranks(rank, local_tp, remote_tp, heads)
        assert t.positional_remote_ranks(rank, local_tp, remote_tp) == list(theirs)
        # Where KV is not replicated the head-aware answer is vLLM's positional one; with
        # replication ours is the de-duplicated subset.
        assert set(ours) <= set(theirs)
        if not t.is_kv_replicated(remote_tp, heads):
            assert ours == list(theirs)

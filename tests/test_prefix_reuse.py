"""Prefix reuse on decode after PD (docs/prefix-reuse.md), on vLLM's real Scheduler and
KVCacheManager with prefix caching: what decode's prefix cache serves to a follow-up that
shares the first L tokens of a PD-loaded prompt, against the same prompt computed on
decode itself (monolithic), and the rule a prefix-aware router applies to decode's KV
events (``testkit.prefix_rule``) predicting every hit. A router that indexes every
stored hash alike over-counts after PD (the control: the rule is needed).

The sliding + full-attention model: vLLM gives decode its null block for the positions
behind the window of a remote-loaded prompt (``SlidingWindowManager`` skips external
tokens outside the window), so only the last window's sliding blocks exist there.
"""

from __future__ import annotations

from typing import Any

import pytest
from testkit import pd_harness as pd
from testkit import prefix_rule
from testkit import vllm_harness as harness
from testkit.pd_caches import SLIDING_WINDOW

PROMPT = 100  # tokens: 6 full blocks of 16, the window (32) far behind the start
SHARED = (16, 32, 48, 64, 80, 96, 100)  # follow-ups share this much of it, then differ


class _Collected:
    """Stand-in for vLLM's ZMQ event publisher (tests/e2e subscribe to the real one):
    keeps the batches the Scheduler publishes."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        return None


def _with_events(instance: Any) -> _Collected:
    collected = _Collected()
    instance.scheduler.kv_cache_manager.block_pool.enable_kv_cache_events = True
    instance.scheduler.kv_event_publisher = collected
    return collected


def _groups(instance: Any, events: list) -> dict[int, prefix_rule.GroupIndex]:
    """Each group's cached hashes as a router keeps them from BlockStored/BlockRemoved;
    its window from the event where vLLM sets it (0.34: ``kv_cache_spec_sliding_window``),
    else from the model's config, as a router configured for the model knows it."""
    cached: dict[int, set] = {}
    windows = {g: getattr(group.kv_cache_spec, "sliding_window", None) for g, group in
               enumerate(instance.scheduler.kv_cache_config.kv_cache_groups)}
    for event in events:
        group = getattr(event, "group_idx", None)
        if group is None:
            pytest.skip("this vLLM's KV events name no KV cache group")
        kind = type(event).__name__
        if kind == "BlockStored":
            cached.setdefault(group, set()).update(event.block_hashes)
            if getattr(event, "kv_cache_spec_kind", None) is not None:
                windows[group] = event.kv_cache_spec_sliding_window
        elif kind == "BlockRemoved":
            cached.setdefault(group, set()).difference_update(event.block_hashes)
    return {g: prefix_rule.GroupIndex(windows.get(g), pd.BLOCK, frozenset(hashes))
            for g, hashes in cached.items()}


def _external(block_hash):
    """A request's block hash as the events carry it (bytes, or an int by setting)."""
    from vllm.v1.core import kv_cache_utils

    convert = getattr(kv_cache_utils, "maybe_convert_block_hash", None)
    return convert(block_hash) if convert is not None else block_hash


def _follow_up(shared: int, hasher):
    base = harness.prompt_ids(PROMPT)
    tail = [(t + 1) % 400 + 3 for t in harness.prompt_ids(PROMPT + 20)[shared:]]
    return harness.make_request(0, max_tokens=1, hasher=hasher, prompt=base[:shared] + tail)


def _measure(instance: Any, events: list, hasher: Any) -> list[tuple[int, int, int, int]]:
    """(shared, decode's real hit, the rule's, the naive index's) per follow-up, tokens."""
    groups = _groups(instance, events)
    rows = []
    for shared in SHARED:
        request = _follow_up(shared, hasher)
        hit = instance.scheduler.kv_cache_manager.get_computed_blocks(request)[1]
        hashes = list(request.block_hashes)[:(request.num_tokens - 1) // pd.BLOCK]
        keys = [_external(h) for h in hashes]
        rows.append((shared, hit, prefix_rule.hit_blocks(keys, groups) * pd.BLOCK,
                     prefix_rule.naive_hit_blocks(keys, groups) * pd.BLOCK))
    return rows


def test_decode_keeps_after_pd_what_the_rule_over_its_events_predicts():
    from vllm_flagcx.compat.probe import FEATURES_BY_KEY

    if FEATURES_BY_KEY["hybrid_async_load"].probe() == "single_group":
        pytest.skip("vLLM 0.13-0.16 refuse a multi-group decode (test_failed_recv_recovery)")
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="sliding")
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="sliding",
                          prefix_caching=True)
    mono = pd.build_instance("kv_consumer", 1, pd.free_port(), model="sliding",
                             prefix_caching=True)
    hasher = harness.block_hasher(pd.BLOCK)
    try:
        pd_events, mono_events = _with_events(d), _with_events(mono)
        records = pd.run_prefill(p, prompts=[PROMPT])
        pd.run_decode(p, d, records, hasher=hasher)
        pd.assert_attention_bytes_moved(p, d, records)
        local = harness.make_request(PROMPT, max_tokens=3, hasher=hasher)
        mono.scheduler.add_request(local)
        while mono.scheduler.has_requests():
            mono.step()
        after_pd = _measure(d, pd_events.events, hasher)
        after_mono = _measure(mono, mono_events.events, hasher)
    finally:
        for instance in (p, d, mono):
            instance.shutdown()
    print("\nshared  hit after PD  after monolithic  (tokens; window", SLIDING_WINDOW, ")")
    for (shared, hit, _, _), (_, mono_hit, _, _) in zip(after_pd, after_mono, strict=True):
        print(f"{shared:6d}  {hit:12d}  {mono_hit:16d}")
    for rows in (after_pd, after_mono):
        assert [hit for _, hit, _, _ in rows] == [rule for _, _, rule, _ in rows], rows
    # monolithic: every shared full block is served; after PD only a follow-up that
    # reaches the loaded window (multi-turn: the whole prompt and more) is
    assert [hit for _, hit, _, _ in after_mono] == [s // pd.BLOCK * pd.BLOCK for s in SHARED]
    assert [hit for _, hit, _, _ in after_pd] == [0, 0, 0, 0, 0, 96, 96]
    # the control: counting every stored hash alike promises hits decode does not have
    assert any(naive > hit for _, hit, _, naive in after_pd)

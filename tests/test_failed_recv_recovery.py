"""A failed receive recomputes from a clean block table, for every KV cache group kind.

Real vLLM Schedulers (prefill and decode) with FlagCXConnector, the connector's workers,
a stand-in transport (``transport_standin``). For each model (sliding-window + full
attention, the GDN hybrid, dense), each failure decode can meet (prefill unreachable, a
write that fails, an integrity failure, an expired lease) and prefix caching on and off,
at prompt lengths beyond the sliding window: every decode request finishes; when it is
scheduled to recompute, no group's block table holds the null block (before the fix, the
sliding group's out-of-window entries were already the null block, the prompt was
recomputed over them, and a second pass tripped vLLM's ``can_fit_full_sequence``
assertion); both schedulers end empty; a second pass runs clean.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re

import pytest
from testkit import pd_harness as pd
from testkit import vllm_harness as harness
from testkit.transport_standin import Faults
from testkit.vllm_reads import failure_policy

from vllm_flagcx.compat.capabilities import capabilities
from vllm_flagcx.compat.kv_cache import SpecKind, group_facts, strip_null_blocks
from vllm_flagcx.compat.vllm_writes import (
    NATIVE,
    SCHEDULER_FAILED_SET,
    SCHEDULER_FLAG,
    recovery_probe,
)

FAILURES = {
    "prefill_unreachable": dict(d_port_shift=1, lease=2.0),
    "write_fails": dict(p_faults=Faults(fail_write_from=0)),
    "integrity_check_fails": dict(p_faults=Faults(silent_skip_from=0)),
    "lease_expired": dict(lease=0.3, d_delay=0.8),
}
PROMPTS = [130, 37]  # 130 tokens: 9 blocks, window 32 tokens (2 blocks)


def _run_twice(model, prefix_caching, p_faults=None, d_port_shift=0, lease=30.0,
               d_delay=0.0, hands_over=True):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model=model, faults=p_faults,
                          lease_seconds=lease, num_blocks=64)
    d = pd.build_instance("kv_consumer", 1, port + 5, model=model, recv_timeout=3.0, seed=1,
                          num_blocks=64, prefix_caching=prefix_caching, hands_over=hands_over)
    passes = []
    try:
        for _ in range(2):
            records = pd.run_prefill(p, PROMPTS)
            if d_delay:
                _wait_for_expiry(p, len(records), d_delay)
            pd.run_decode(p, d, records, remote_port_shift=d_port_shift,
                          hasher=harness.block_hasher(pd.BLOCK) if prefix_caching else None)
            passes.append(records)
        return p, d, passes
    except BaseException:
        p.shutdown()
        d.shutdown()
        raise


def _wait_for_expiry(p, count: int, delay: float) -> None:
    """Let prefill's leases run out and prefill expire them before decode sees the requests.

    Sleeping alone raced: prefill expires leases in its own steps, and decode's arrival
    heartbeat renews any lease not yet expired, so under CPU load a request sometimes
    loaded after all."""
    import time

    before = sum(w.stats["num_kv_expired_reqs"] for w in p.workers)
    time.sleep(delay)
    deadline = time.monotonic() + 10
    while sum(w.stats["num_kv_expired_reqs"] for w in p.workers) < before + count:
        assert time.monotonic() < deadline, "prefill never expired the leases"
        p.step()
        time.sleep(0.02)


def _first_needed_block(facts, computed: int) -> int:
    """The first block the tokens still to compute will read: every block for full
    attention; the window before ``computed`` for a sliding-window group (blocks before it
    are the null block by design, e.g. after a legitimate local prefix-cache hit); only the
    last for Mamba (its state lives in one block)."""
    if facts.kind is SpecKind.SLIDING_WINDOW:
        return max(0, computed - facts.sliding_window) // facts.block_size
    if facts.kind is SpecKind.MAMBA:
        return -1
    return 0


def _recovery_supported() -> bool:
    """Multi-group decode runs here: vLLM finishes multi-group remote loads (0.13 does
    not, and the connector refuses decode there: test_mamba_and_config) and the build
    has a request-level recovery path."""
    from vllm_flagcx.compat.probe import FEATURES_BY_KEY

    return (FEATURES_BY_KEY["hybrid_async_load"].probe() != "single_group"
            and recovery_probe() in (NATIVE, SCHEDULER_FAILED_SET))


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache",
                                                                "prefix-cache"])
@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("model", ["sliding", "hybrid", "dense"])
def test_failed_receive_recomputes_over_a_clean_block_table(model, failure, prefix_caching):
    if model != "dense" and not _recovery_supported():
        pytest.skip("this build has no request-level recovery; decode of multi-group "
                    "models is refused here (test_refusals)")
    if model == "hybrid" and prefix_caching:
        pytest.skip("hybrid + prefix caching on decode: see "
                    "test_hybrid_prefix_caching_decode_is_refused_where_vllm_asserts")
    p, d, passes = _run_twice(model, prefix_caching, **FAILURES[failure])
    _assert_recomputed_cleanly(model, failure, p, d, passes)


@pytest.mark.parametrize("model", ["hybrid", "dense"])
def test_a_failed_receive_recomputes_without_the_handed_over_scheduler(model):
    """Under vLLM's own Scheduler (no ``--scheduler-cls``) 0.13-0.28 offer the connector
    no failure set: the request recomputes from token 0 over the blocks allocated for its
    load, which is right without sliding-window groups. Same checks as above."""
    if model != "dense" and not _recovery_supported():
        pytest.skip("multi-group decode is refused on this build")
    p, d, passes = _run_twice(model, False, hands_over=False, **FAILURES["write_fails"])
    _assert_recomputed_cleanly(model, "write_fails", p, d, passes)
    assert d.scheduler.connector.scheduler.recovery.mode in (NATIVE, None)


def _assert_recomputed_cleanly(model, failure, p, d, passes) -> None:
    """Every decode request finished (an error where vLLM's policy fails it), each failed
    once, and every schedule of a recompute reads no null block; both sides end idle."""
    groups_facts = group_facts(d.ranks[0].config)
    # vLLM's kv_load_failure_policy ("fail" is 0.22+'s default) applies where vLLM itself
    # handles the failure: block-level reports (dense) and 0.34's failed_recving. 0.18-0.22
    # have no request-level fail path for a connector: there the request recomputes.
    policy = failure_policy(d.scheduler.vllm_config.kv_transfer_config)
    fails = policy == "fail" and (model == "dense" or recovery_probe() == NATIVE)
    try:
        finished = pd.finished_ids(d)
        for records in passes:
            for rec in records.values():
                assert rec["d_req"] in finished, (failure, rec)
                if fails:
                    assert finished[rec["d_req"]] == "error", (failure, finished)
                    continue
                assert finished[rec["d_req"]] != "error", (failure, finished)
                schedules = d.scheduled_blocks.get(rec["d_req"], [])
                assert schedules, f"{rec['d_req']} was never scheduled"
                for computed, groups in schedules:
                    for facts, ids in zip(groups_facts, groups, strict=True):
                        needed = ids[_first_needed_block(facts, computed):]
                        assert strip_null_blocks(needed) == needed, (
                            f"{model}/{failure}: group {facts.index} of {rec['d_req']} "
                            f"recomputes from token {computed} over the null block: {ids}")
        failures = sum(sum(w.ledger.counts.values()) for w in d.workers)
        assert failures == sum(len(r) for r in passes)
        assert not pd.busy(p) and not pd.busy(d)
    finally:
        p.shutdown()
        d.shutdown()


def test_sliding_model_transfer_still_moves_the_window():
    """The control: without a failure the same model's requests load their KV (no
    recompute), so the test above exercises the failure path, not a model that never
    loads."""
    if not _recovery_supported():
        pytest.skip("multi-group decode is refused on this build")
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="sliding", num_blocks=64)
    d = pd.build_instance("kv_consumer", 1, port + 5, model="sliding", num_blocks=64)
    try:
        records = pd.run_pd(p, d, PROMPTS)
        assert all(rec["d_req"] in pd.finished_ids(d) for rec in records.values())
        assert sum(sum(w.ledger.counts.values()) for w in d.workers) == 0
        assert sum(w.observations.total("bytes_transferred")[1] for w in d.workers) > 0
    finally:
        p.shutdown()
        d.shutdown()


def test_hybrid_prefix_caching_decode_is_refused_where_vllm_asserts():
    """0.22's scheduler asserts on remote loads in mamba_cache_mode="align" (what prefix
    caching selects for hybrid models): a decode instance is refused at startup naming the
    flag; builds without the assertion start (and prefill is never refused)."""
    from vllm_flagcx.compat.kv_cache import HybridRemoteLoadUnsupported

    def build(role):
        config = harness.make_vllm_config(model=harness.HYBRID_MODEL, hma=True, kv_role=role,
                                          extra_config={"side_channel_port": pd.free_port()})
        if not hasattr(config.cache_config, "mamba_cache_mode"):
            pytest.skip("this build has no mamba_cache_mode")
        # What vLLM resolves for a hybrid model with prefix caching (0.34 asserts the pair
        # while validating a config built with prefix caching on, so set both after).
        config.cache_config.enable_prefix_caching = True
        config.cache_config.mamba_cache_mode = "align"
        kv = harness.hybrid_kv_cache_config()
        for group in kv.kv_cache_groups:  # builds whose Mamba specs carry the mode (0.34)
            if hasattr(group.kv_cache_spec, "mamba_cache_mode"):
                group.kv_cache_spec = dataclasses.replace(group.kv_cache_spec,
                                                          mamba_cache_mode="align")
        return harness.make_scheduler(config, kv)

    scheduler_cls = harness.scheduler_class()
    asserts = "num_external_computed_tokens == 0" in inspect.getsource(
        scheduler_cls._mamba_block_aligned_split) if hasattr(
        scheduler_cls, "_mamba_block_aligned_split") else False
    build("kv_producer").shutdown()
    from vllm_flagcx.compat.probe import FEATURES_BY_KEY

    if FEATURES_BY_KEY["hybrid_async_load"].probe() == "single_group":  # 0.13-0.16
        with pytest.raises(HybridRemoteLoadUnsupported, match="ONE KV cache group"):
            build("kv_consumer")
    elif asserts:
        with pytest.raises(HybridRemoteLoadUnsupported, match="--no-enable-prefix-caching"):
            build("kv_consumer")
    else:
        build("kv_consumer").shutdown()


@pytest.mark.parametrize("num_blocks", [40, 48])
def test_burst_of_failed_receives_in_a_tight_decode_pool_all_finish(num_blocks):
    """vLLM frees a failed load's blocks and the request then waits to recompute at the
    head of the queue of block holders, which the scheduler drains first and in order
    (0.34's ``kv_holding_waiting``, 0.18-0.22's ``skipped_waiting``). With a pool too
    tight for its recompute, admission stopped there every step while the loaded requests
    behind it held the blocks: 17 of 30 stuck for good here on 0.22 (34 of 50 on 0.34 in
    the issue). The request now yields ("not yet") while a block holder waits
    (``SchedulerHalf._yields``). Every request must finish, on every build.

    The pool fits each request's local recompute (every token's blocks in every group:
    130 tokens need 9 x 4 of the 39 usable blocks); a smaller one fits a loaded request
    but never its recompute, which vLLM cannot run at all."""
    if not _recovery_supported():
        pytest.skip("this build has no request-level recovery; decode of multi-group "
                    "models is refused here (test_refusals)")
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="hybrid", num_blocks=400,
                          faults=Faults(fail_write_at=frozenset(range(0, 40, 3))))
    # recompute: the path that must yield (under 0.34's default "fail" the failed
    # requests end in an error at once and hold nothing)
    policy = "recompute" if capabilities().kv_load_failure_policy_default != "absent" else None
    d = pd.build_instance("kv_consumer", 1, port + 5, model="hybrid", recv_timeout=3.0,
                          seed=1, num_blocks=num_blocks, failure_policy=policy)
    try:
        records = pd.run_prefill(p, [70 + 7 * (i % 9) for i in range(30)], timeout=120)
        assert all(r["params"] for r in records.values())
        pd.run_decode(p, d, records, max_tokens=4, timeout=240)
        finished = pd.finished_ids(d)
        stuck = [r["d_req"] for r in records.values() if r["d_req"] not in finished]
        assert not stuck, f"{len(stuck)} of {len(records)} decode requests never finished"
        failed = sum(d.workers[0].ledger.counts.values())
        assert failed > 0  # the burst happened
        # ... and reached the scheduler half as vLLM's worker reports it (0.34 too: the
        # worker meta next to failed_recving), so the yield rule above really ran
        assert d.scheduler.connector.scheduler.recomputed_after_failure == failed
        assert not pd.busy(p) and not pd.busy(d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("model", ["sliding", "hybrid"])
@pytest.mark.parametrize("hands_over", [True, False], ids=["flagcx-scheduler", "vllm-scheduler"])
def test_only_a_scheduler_that_hands_itself_over_recovers_a_sliding_window_decode(
        model, hands_over):
    """0.13-0.28 give a connector no handle on its scheduler (and no frame walk finds one):
    a sliding-window decode starts only under ``compat.schedulers`` (``--scheduler-cls``,
    named in the refusal), which hands itself to the connector. vLLM's own Scheduler
    still runs every other model (a failed load recomputes over its allocated blocks:
    ``test_a_failed_receive_recomputes_without_the_handed_over_scheduler``); 0.30+ report
    failures natively and needs neither."""
    if not _recovery_supported():
        pytest.skip("multi-group decode is refused on this build")
    native = recovery_probe() == NATIVE
    build = functools.partial(pd.build_instance, "kv_consumer", 1, pd.free_port(),
                              model=model, hands_over=hands_over)
    if model == "sliding" and not hands_over and not native:
        with pytest.raises(RuntimeError, match=re.escape(SCHEDULER_FLAG)):
            build()
        return
    d = build()
    try:
        mode = d.scheduler.connector.scheduler.recovery.mode
        assert mode == (NATIVE if native else SCHEDULER_FAILED_SET if hands_over else None)
    finally:
        d.shutdown()


def test_the_scheduler_hands_itself_to_flagcx_inside_vllms_multi_connector():
    """NVIDIA Dynamo wraps the connector in vLLM's MultiConnector, which builds it inside
    the same scheduler ``__init__``: the handed-over scheduler still reaches it."""
    if not _recovery_supported():
        pytest.skip("multi-group decode is refused on this build")
    d = pd.build_instance("kv_consumer", 1, pd.free_port(), model="sliding", multi=True)
    try:
        [flagcx] = d.scheduler.connector._connectors
        recovery = flagcx.scheduler.recovery
        assert recovery.mode == recovery_probe()
        assert recovery.mode == NATIVE or recovery._scheduler() is d.scheduler
    finally:
        d.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_scheduler_flag_names_vllms_scheduler_of_either_mode_handing_itself_over(
        async_scheduling):
    """The ``--scheduler-cls`` value the refusal names imports and builds vLLM's scheduler
    of the engine's mode (async scheduling is vLLM 0.2x's default on GPUs: a sync
    scheduler there would run under the async engine loop), which hands itself to the
    FlagCXConnector it constructs, and to no later one."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_flagcx.compat.vllm_writes import handed_over_scheduler

    module, _, name = SCHEDULER_FLAG.split()[-1].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    config = harness.make_vllm_config(kv_role="kv_consumer",
                                      extra_config={"side_channel_port": pd.free_port()})
    config.scheduler_config.async_scheduling = async_scheduling
    scheduler = harness.make_scheduler(config, harness.dense_kv_cache_config(), cls)
    try:
        assert isinstance(scheduler, AsyncScheduler) == async_scheduling
        recovery = scheduler.connector.scheduler.recovery
        assert recovery.mode == recovery_probe()
        assert recovery.mode == NATIVE or recovery._scheduler() is scheduler
        assert handed_over_scheduler() is None
    finally:
        scheduler.shutdown()

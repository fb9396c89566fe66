"""The evidence functions the bf16 PD checks assert with (testkit/evidence.py)."""

from __future__ import annotations

from testkit import evidence


def _run(tokens, tops):
    return {"logprobs": {"tokens": tokens, "top_logprobs": tops}}


def test_first_difference_reads_the_gap_and_both_top_k():
    pd = _run(["a", "b"], [{"a": -0.1}, {"b": -0.7, "c": -0.75}])
    mono = _run(["a", "c"], [{"a": -0.1}, {"c": -0.6, "b": -0.8}])
    diff = evidence.first_difference(pd, mono)
    assert diff["index"] == 1 and abs(diff["gap"] - 0.2) < 1e-9
    assert diff["pd_top"] == {"b": -0.7, "c": -0.75}
    assert evidence.first_difference(pd, pd) is None


def test_a_pick_outside_the_monolithic_top_k_is_an_infinite_gap():
    diff = evidence.first_difference(_run(["x"], [{"x": -1.0}]), _run(["y"], [{"y": -1.0}]))
    assert diff["gap"] == float("inf")


def test_drift_is_the_largest_difference_over_shared_tokens_per_position():
    pd = _run(["a", "b"], [{"a": -1.0, "b": -2.0}, {"b": -0.5, "q": -3.0}])
    mono = _run(["a", "b"], [{"a": -1.25, "b": -2.0}, {"b": -0.5, "z": -1.0}])
    assert evidence.drift(pd, mono, 1) == [0.25, 0.0]
    assert evidence.drift(pd, _run(["a"], [{"k": 0.0}]), 0) == [float("inf")]


def test_typical_drift_is_the_median_so_one_spike_does_not_move_it():
    assert evidence.typical_drift([0.03, 0.04, 0.72, 0.02, 0.05]) == 0.04
    assert evidence.typical_drift([0.5, 0.6, 0.7, 0.02]) == 0.55
    assert evidence.typical_drift([0.1, 0.3]) == 0.2
    assert evidence.typical_drift([]) == 0.0


def test_divergence_counts_a_token_only_one_run_lists_by_its_lower_bound():
    pd = _run(["a"], [{"a": -1.0, "b": -3.0}])
    mono = _run(["c"], [{"c": -1.0, "b": -3.005}])
    # drift sees only "b" (0.005); "a" is in PD's top at -1 and below -3.005 in mono's
    assert abs(evidence.drift(pd, mono, 0)[0] - 0.005) < 1e-9
    assert abs(evidence.divergence(pd, mono, 0)[0] - 2.005) < 1e-9
    same = _run(["a"], [{"a": -1.0, "b": -3.0}])
    assert evidence.divergence(same, same, 0) == [0.0]


def test_until_parting_measures_up_to_the_first_difference_or_over_everything():
    pd = _run(["a", "b", "c"], [{"a": -1.0}, {"b": -1.0}, {"c": -1.0}])
    mono = _run(["a", "x", "c"], [{"a": -1.5}, {"x": -1.0}, {"c": -1.0}])
    diff, measured = evidence.until_parting(pd, mono, evidence.drift)
    assert diff["index"] == 1 and measured == [0.5, float("inf")]
    diff, measured = evidence.until_parting(pd, pd, evidence.drift)
    assert diff is None and measured == [0.0, 0.0, 0.0]


def test_parting_measure_reads_the_median_divergence_until_the_outputs_part():
    pd = _run(["a", "b", "c"], [{"a": -1.0}, {"b": -1.0}, {"c": -1.0}])
    mono = _run(["a", "b", "x"], [{"a": -1.02}, {"b": -1.5}, {"x": -1.0, "c": -1.01}])
    parting = evidence.parting(pd, mono)
    assert parting.index == 2
    assert [round(x, 6) for x in parting.per_position] == [0.02, 0.5, 0.01]
    assert abs(parting.typical - 0.02) < 1e-9
    assert parting.within_rounding
    assert not evidence.parting(pd, _run(["q"], [{"q": -0.1}])).within_rounding

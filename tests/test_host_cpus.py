"""host_cpus: the cgroup cpuset that decides whether vLLM's binding pinned a worker."""

from __future__ import annotations

import os

import pytest

from vllm_flagcx.connector.common.host_cpus import allowed_cpus, cpu_binding_warning, parse_cpu_list


def test_parse_cpu_list_reads_the_kernel_syntax():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    assert parse_cpu_list("\n") == set()


@pytest.mark.parametrize("text, fragment", [("0-a", "'0-a' is not N or N-M"),
                                            ("4-2", "range '4-2' runs backwards")])
def test_parse_cpu_list_names_the_bad_part(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_cpu_list(text)


def test_allowed_cpus_takes_the_first_readable_cpuset(tmp_path):
    v2, v1 = tmp_path / "cpuset.cpus.effective", tmp_path / "cpuset.effective_cpus"
    v1.write_text("2-3\n")
    assert allowed_cpus((v2, v1)) == {2, 3}  # v2 absent: v1
    v2.write_text("4,6\n")
    assert allowed_cpus((v2, v1)) == {4, 6}
    v2.write_text("\n")  # an empty v2 file (no cpuset controller): skip it
    assert allowed_cpus((v2, v1)) == {2, 3}


def test_allowed_cpus_falls_back_to_the_machine(tmp_path):
    bad = tmp_path / "garbled"
    bad.write_text("x-y")
    assert allowed_cpus((tmp_path / "absent", bad)) == set(range(os.cpu_count() or 1))


def test_a_worker_bound_to_its_whole_container_gets_no_hint(tmp_path):
    """The false positive this module removes: a 2-CPU container on a 64-CPU machine,
    vLLM's auto binding takes both of the container's CPUs: nothing is shared."""
    cpuset = tmp_path / "cpuset.cpus.effective"
    cpuset.write_text("10-11\n")
    assert cpu_binding_warning({10, 11}, allowed_cpus((cpuset,)), None, True) is None
    assert cpu_binding_warning({10, 11}, set(range(64)), None, True) is not None
    assert cpu_binding_warning({10}, allowed_cpus((cpuset,)), None, True) is not None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_registration_logs_the_hint_for_a_worker_pinned_to_a_shared_core(monkeypatch, caplog):
    """The wiring the worker's setup runs at registration: pinned to 1 of 4 allowed CPUs
    under vLLM's automatic binding, a CPU worker logs the hint; GPU memory, or an explicit
    binding, logs nothing."""
    from vllm_flagcx.connector.common import host_cpus, worker_setup

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(host_cpus, "allowed_cpus", lambda *a: {0, 1, 2, 3})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    def ours():
        return [r.getMessage() for r in caplog.records if r.name == "vllm_flagcx"]

    with caplog.at_level("WARNING", logger="vllm_flagcx"):
        worker_setup.warn_on_cpu_binding(host_memory=False)
        assert not ours()
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
        worker_setup.warn_on_cpu_binding(host_memory=True)
        assert not ours()
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
        worker_setup.warn_on_cpu_binding(host_memory=True)
    # (a handler vLLM's logging setup left on the logger may capture it twice)
    assert ours() and all("bound to CPUs [0] of 4" in m for m in ours())

"""host_cpus: the cgroup cpuset that decides whether vLLM's binding pinned a worker."""

from __future__ import annotations

import os

import pytest

from vllm_flagcx.connector.host_cpus import allowed_cpus, cpu_binding_warning, parse_cpu_list


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

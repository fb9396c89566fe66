"""matrix/builds.toml is the single source: tox.ini and docs/porting.md derive from it."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from vllm_flagcx.compat.moved import MOVED_NAMES
from vllm_flagcx.compat.probe import FEATURES
from vllm_flagcx.matrix import build_by_env, build_for_version, builds, e2e_settings, render

REPO = Path(__file__).resolve().parent.parent


def test_rendered_files_are_current():
    for rel, make in render.OUTPUTS.items():
        assert (REPO / rel).read_text() == make(), f"{rel} is stale: run matrix.render"


def test_tox_envs_equal_matrix_builds():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini")
    env_list = [e.strip() for e in tox["tox"]["env_list"].split(",")]
    assert env_list == ["lint", *[b.env for b in builds()], "novllm", "e2e", "bench"]
    e2e = e2e_settings()
    for env in ("e2e", "demo"):
        section = tox[f"testenv:{env}"]
        assert e2e["dist"] in section["commands_pre"]
        assert e2e["requirements"] in section["commands_pre"]
    for build in builds():
        section = tox[f"testenv:{build.env}"]
        assert f"VLLM_FLAGCX_INSTALL = {build.install}" in section["set_env"]
    newest = max(builds(), key=lambda b: tuple(map(int, b.version.split("."))))
    assert f"VLLM_FLAGCX_INSTALL = {newest.install}" in tox["testenv:doctor"]["set_env"]


def test_required_builds_present():
    versions = {b.env: b.version for b in builds()}
    assert versions == {"vllm013": "0.13.0", "vllm020": "0.20.0", "vllm0202": "0.20.2",
                        "vllm021": "0.21.0", "vllm022": "0.22.0", "vllm024": "0.24.0",
                        "vllm025": "0.25.0", "vllm028": "0.28.0", "vllm030": "0.30.0",
                        "vllm034": "0.34.0"}


def test_a_focused_build_runs_its_suite_and_every_file_of_it_exists():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini")
    focused = [b for b in builds() if b.focused]
    assert {b.env for b in focused} == {"vllm021", "vllm024", "vllm025", "vllm028", "vllm030"}
    for build in focused:
        command = tox[f"testenv:{build.env}"]["commands"]
        assert all(test in command for test in build.tests), build.env
        assert all((REPO / test).is_file() for test in build.tests)
    for build in builds():  # the five main builds run everything (the [testenv] command)
        if not build.focused:
            assert "commands" not in tox[f"testenv:{build.env}"], build.env


def test_an_unknown_suite_is_refused_by_name(monkeypatch):
    import vllm_flagcx.matrix as matrix

    data = {**matrix.load(), "build": [{**matrix.load()["build"][0], "suite": "quick"}]}
    monkeypatch.setattr(matrix, "load", lambda: data)
    matrix.builds.cache_clear()
    try:
        with pytest.raises(ValueError, match="suite 'quick' is not in \\[suites\\]"):
            matrix.builds()
    finally:
        monkeypatch.undo()
        matrix.builds.cache_clear()


def test_vendor_builds_and_lookup_by_vendor_version():
    assert build_by_env("vllm020").simulate.expect_vendor == "hygon"
    assert build_by_env("vllm0202").simulate.expect_vendor == "metax"
    assert build_for_version("0.20.0+das.opt1.dtk2504").env == "vllm020"
    assert build_for_version("0.20.2+maca3.2.1").env == "vllm0202"
    assert build_for_version("0.23.0") is None


def test_every_profile_covers_every_capability():
    keys = {m.key for m in MOVED_NAMES} | {f.key for f in FEATURES}
    for build in builds():
        assert set(build.profile) == keys, build.env


def test_porting_checklist_lists_every_capability():
    text = render.render_porting()
    for key in [m.key for m in MOVED_NAMES] + [f.key for f in FEATURES]:
        assert f"| `{key}` |" in text


def test_sweep_installs_the_transformers_line_vllm_asks_for():
    from vllm_flagcx.matrix import load
    from vllm_flagcx.matrix.sweep import overlay_for

    overlays = load()["sweep"]["overlays"]
    old = "transformers!=5.0.*,!=5.1.*,!=5.2.*,!=5.3.*,!=5.4.*,!=5.5.0,>=4.56.0"  # 0.21.0
    assert overlay_for(["torch==2.11.0", old], overlays)[0] == "transformers==4.57.6"
    assert overlay_for(["transformers>=5.10.4"], overlays)[0] == "transformers==5.22.2"
    assert overlay_for([], overlays) == overlays[0]
    with pytest.raises(ValueError, match="transformers>=9"):
        overlay_for(["transformers>=9"], overlays)


def test_sweep_reads_pytests_counts_and_what_changed_between_minors():
    from vllm_flagcx.matrix.sweep import merge, profile_changes, suite_counts

    assert suite_counts("x\n2 failed, 170 passed, 5 skipped, 1 error in 80.12s (0:01:20)\n") == {
        "passed": 170, "failed": 2, "skipped": 5, "errors": 1}
    assert suite_counts("crashed before the summary") == {
        "passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    rows = [{"version": "0.21.0", "profile": {"a": "1", "b": "x"}},
            {"version": "0.22.0", "profile": {"a": "1", "b": "y"}},
            {"version": "0.23.0", "profile": {"a": "2", "b": "y", "c": "new"}}]
    assert profile_changes(rows) == [[], ["b"], ["a", "c"]]
    merged = merge([rows[2], rows[0]], [{"version": "0.21.0", "passed": 3}, {"version": "0.9.0"}])
    assert [r["version"] for r in merged] == ["0.9.0", "0.21.0", "0.23.0"]
    assert merged[1] == {"version": "0.21.0", "passed": 3}


def test_the_committed_sweep_has_a_result_for_every_minor_it_names():
    """matrix/sweep.json (tox -e sweep) holds one row per version of [sweep], each with its
    suite's counts or the error that stopped it; a minor 0.13-0.34 missing from [sweep]
    fails here too."""
    from packaging.version import Version

    from vllm_flagcx.matrix import load
    from vllm_flagcx.matrix.sweep import read_rows

    versions = load()["sweep"]["versions"]
    assert {Version(v).release[:2] for v in versions} == {(0, m) for m in range(13, 35)}
    rows = {r["version"]: r for r in read_rows()}
    assert set(rows) == set(versions)
    for row in rows.values():
        assert row.get("passed", 0) + row.get("failed", 0) + row.get("errors", 0) > 0 or (
            "error" in row), row["version"]

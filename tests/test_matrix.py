"""matrix/builds.toml is the single source: tox.ini and docs/porting.md derive from it."""

from __future__ import annotations

import configparser
from pathlib import Path

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
                        "vllm022": "0.22.0", "vllm034": "0.34.0"}


def test_vendor_builds_and_lookup_by_vendor_version():
    assert build_by_env("vllm020").simulate.expect_vendor == "hygon"
    assert build_by_env("vllm0202").simulate.expect_vendor == "metax"
    assert build_for_version("0.20.0+das.opt1.dtk2504").env == "vllm020"
    assert build_for_version("0.20.2+maca3.2.1").env == "vllm0202"
    assert build_for_version("0.21.0") is None


def test_every_profile_covers_every_capability():
    keys = {m.key for m in MOVED_NAMES} | {f.key for f in FEATURES}
    for build in builds():
        assert set(build.profile) == keys, build.env


def test_porting_checklist_lists_every_capability():
    text = render.render_porting()
    for key in [m.key for m in MOVED_NAMES] + [f.key for f in FEATURES]:
        assert f"| `{key}` |" in text

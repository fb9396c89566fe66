"""What works with this package's ``[router]`` extras alone, no vLLM and no torch (the
``novllm`` tox env installs the wheel that way): the doctor and the demo say that vLLM is
missing and how to get it; ``VLLM_PLUGINS`` that leaves this plugin out is named; an
unknown subcommand is named. The router's own tests (``test_router.py``) run there too."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from vllm_flagcx.compat.plugin import ENTRY_POINT_NAME, plugins_note

needs_no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                                   reason="vLLM is installed here (tox -e novllm runs this)")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_flagcx.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@needs_no_vllm
def test_doctor_without_vllm_names_the_supported_builds_and_the_fix():
    from vllm_flagcx.matrix import builds

    out = _cli("doctor")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "no vLLM is installed" in out.stdout
    for build in builds():
        assert build.version in out.stdout
    assert "pip install vllm==" in out.stdout


@needs_no_vllm
def test_doctor_json_without_vllm():
    out = _cli("doctor", "--json")
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert report["vllm_version"] is None and report["supported_builds"]


@needs_no_vllm
def test_demo_without_vllm_says_how_to_run_it():
    out = _cli("demo")
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    assert "no vLLM is installed" in out.stdout and "tox -e demo" in out.stdout


def test_unknown_command_is_named():
    out = _cli("bogus")
    assert out.returncode == 2
    assert "unknown command 'bogus'" in out.stderr and "doctor" in out.stderr


def test_vllm_plugins_that_leaves_this_plugin_out_is_named_with_the_fix():
    assert plugins_note({}) is None
    assert plugins_note({"VLLM_PLUGINS": f"fl,{ENTRY_POINT_NAME}"}) is None
    note = plugins_note({"VLLM_PLUGINS": "fl"})
    assert note is not None
    assert "VLLM_PLUGINS='fl'" in note and f"fl,{ENTRY_POINT_NAME}" in note
    assert "kv_connector_module_path" in note


def test_entry_point_name_matches_pyproject():
    """The note names the plugin vLLM would need in VLLM_PLUGINS: the entry point's name."""
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not run from a checkout")
    points = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    assert ENTRY_POINT_NAME in points["vllm.general_plugins"]

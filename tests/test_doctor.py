"""`vllm-flagcx doctor` on the installed build, and with a capability removed."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from vllm_flagcx import doctor
from vllm_flagcx.compat import capabilities as capabilities_mod
from vllm_flagcx.compat import probe


def test_doctor_passes_on_this_build(matrix_build):
    out = io.StringIO()
    assert doctor.main([], out=out) == 0
    text = out.getvalue()
    assert f"matrix build: {matrix_build.env}" in text
    assert "MISSING" not in text and "DIFFERS" not in text
    assert "all required capabilities found" in text


def test_doctor_json(matrix_build):
    out = io.StringIO()
    assert doctor.main(["--json"], out=out) == 0
    data = json.loads(out.getvalue())
    assert data["matrix_build"] == matrix_build.env
    assert data["missing_required"] == [] and data["profile_mismatches"] == {}
    assert data["release"] == matrix_build.version
    assert len(data["capabilities"]) == len(matrix_build.profile)


def test_doctor_names_a_removed_capability(monkeypatch):
    base = sys.modules[probe.MOVED_BY_KEY["SupportsHMA"].candidates[0].split(":")[0]]
    monkeypatch.delattr(base, "SupportsHMA")
    capabilities_mod.clear_caches()
    try:
        out = io.StringIO()
        assert doctor.main([], out=out) == 1
        text = out.getvalue()
        line = next(ln for ln in text.splitlines() if "SupportsHMA" in ln)
        assert "MISSING" in line and "provide:" in line
        assert "required capability(ies) MISSING: SupportsHMA" in text
    finally:
        monkeypatch.undo()
        capabilities_mod.clear_caches()


def test_doctor_console_script_runs():
    proc = subprocess.run([sys.executable, "-m", "vllm_flagcx.cli", "doctor", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["missing_required"] == []


@pytest.mark.parametrize("argv", [[], ["nope"]])
def test_cli_usage(argv, capsys):
    from vllm_flagcx import cli

    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "doctor" in captured.err  # usage errors go to stderr
    if argv:
        assert f"unknown command {argv[0]!r}" in captured.err


def test_doctor_names_missing_dependencies_instead_of_a_traceback(monkeypatch):
    """After ``pip install --no-deps .`` the doctor used to die on ``import packaging``."""
    import importlib.util
    import io

    from vllm_flagcx import doctor as doctor_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "packaging" else real(name, *a))
    out = io.StringIO()
    assert doctor_module.main([], out=out) == 1
    assert "not installed: packaging" in out.getvalue()
    assert "pip install packaging" in out.getvalue()

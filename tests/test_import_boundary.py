"""Only vllm_flagcx/compat may import vLLM; importing the package stays cheap."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_flagcx"
MATRIX = PACKAGE.parent / "matrix"


def _vllm_imports(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names = [str(node.args[0].value)]
        else:
            continue
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            lines.append(node.lineno)
    return lines


def test_no_vllm_import_outside_compat():
    offenders = []
    for path in sorted([*PACKAGE.rglob("*.py"), *MATRIX.rglob("*.py")]):
        if PACKAGE / "compat" in path.parents:
            continue
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{n}" for n in _vllm_imports(path)]
    assert offenders == [], f"vLLM imported outside vllm_flagcx/compat: {offenders}"


def test_boundary_check_catches_an_import(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text("import os\nfrom vllm.config import VllmConfig\nimport vllm_flagcx\n")
    assert _vllm_imports(sample) == [2]


def _modules_after_import(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    return set(out.stdout.split())


def test_package_import_is_cheap():
    loaded = _modules_after_import(
        "import vllm_flagcx, vllm_flagcx.compat, vllm_flagcx.matrix, vllm_flagcx.cli")
    heavy = {m for m in loaded if m.split(".")[0] in {"vllm", "torch", "zmq", "transformers"}}
    assert heavy == set()


def test_router_and_side_channel_client_import_neither_vllm_nor_torch():
    """The router sends Release and the concurrent-mode handshake through the connector's
    side-channel client; with the [router] extras alone (no vLLM, no torch) that must
    work, and where vLLM is installed it must not be loaded (28 s under load, measured)."""
    loaded = _modules_after_import(
        "import vllm_flagcx.router.proxy, vllm_flagcx.router.app, vllm_flagcx.router.cli\n"
        "from vllm_flagcx.wire import client, handshake")
    heavy = {m for m in loaded if m.split(".")[0] in {"vllm", "torch", "transformers"}}
    assert heavy == set()
    assert "vllm_flagcx.connector.entry" not in loaded


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_connector_import_is_side_effect_free():
    """vLLM imports the connector module from its config code: no transport, no side
    channel, no thread may come with it."""
    code = ("import threading, sys\nbefore = threading.active_count()\n"
            "import vllm_flagcx.connector\n"
            "vllm_flagcx.connector.FlagCXConnector  # what vLLM's loader reads\n"
            "print('THREADS', threading.active_count() - before)\n"
            "print('MODULES', ' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.splitlines()  # vLLM may log here too
    fields = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out
              if line.startswith(("THREADS ", "MODULES "))}
    loaded = set(fields["MODULES"].split())
    assert "vllm_flagcx.connector" in loaded
    assert int(fields["THREADS"]) <= 0  # vLLM's own imports may start none of ours
    assert not any(m.startswith("vllm_flagcx.transport.") for m in loaded)
    assert "vllm_flagcx.connector.worker" not in loaded

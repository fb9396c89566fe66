"""Only vllm_flagcx/compat may import vLLM; importing the package stays cheap."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.imports import layer_offenders

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


# Which vllm_flagcx packages each package may import (itself always). Lower layers never
# import higher ones: layout is the pure floor, wire holds the contracts that cross a
# process boundary, compat wraps vLLM, transport moves bytes, the connector is built on
# all of them; the router speaks only wire.
LAYERS = {
    "layout": set(),
    "wire": {"layout"},
    "compat": {"layout", "wire"},
    "transport": {"layout"},
    "connector": {"layout", "wire", "compat", "transport"},
    "router": {"wire"},
    "demo": {"router", "wire", "compat"},
}


def test_no_package_imports_a_layer_above_it():
    assert layer_offenders(PACKAGE, LAYERS, "vllm_flagcx") == []


def test_every_package_has_a_layer_and_is_shipped():
    import tomllib

    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS), "give a new package its place in LAYERS"
    shipped = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    listed = set(shipped["tool"]["setuptools"]["packages"])
    every = {_module_name(p.parent / "__init__.py", PACKAGE)
             for p in PACKAGE.rglob("__init__.py")}
    assert every <= listed, f"pyproject.toml packages lacks {sorted(every - listed)}"


def test_kv_transfer_params_keys_are_spelled_in_the_schema_only():
    """One schema (``wire.params``) for the router, prefill and decode: no other module
    writes the keys as string literals (docstrings may mention them)."""
    keys = {"do_remote_prefill", "do_remote_decode"}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "wire" / "params.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and node.value in keys:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert offenders == [], offenders


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks (never run: not a dependency cycle)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def module_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of ``root``'s package it imports, lazily (inside a function)
    or not; ``from pkg import mod`` names the module, not the package's ``__init__``."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_lines(tree)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs or {node.module}
        graph[name] = (deps & modules.keys()) - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other round a circle (Tarjan's SCCs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circle_inside_the_package():
    """A circle (even through a lazy import in a function) means neither module can be
    read, tested or moved alone; issue 26 removed compat's probe <-> capabilities <->
    version one."""
    assert import_cycles(module_graph(PACKAGE)) == []


def test_the_circle_check_sees_a_lazy_circle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg import a\n")
    assert import_cycles(module_graph(pkg)) == [["pkg.a", "pkg.b"]]

"""Which packages a source file imports, read from its syntax tree (nothing is imported):
the layer checks of ``test_import_boundary`` and the role checks of ``test_connector_roles``
ask the same question one package level apart."""

from __future__ import annotations

import ast
from pathlib import Path


def subpackages_imported(path: Path, package: str = "vllm_flagcx") -> set[str]:
    """The direct subpackages of ``package`` (dotted) that ``path`` imports with absolute
    imports at any depth, e.g. ``{"wire"}`` for ``from vllm_flagcx.wire.auth import x``."""
    prefix = package.split(".")
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module
                 and node.level == 0 else [])
        for name in names:
            parts = name.split(".")
            if parts[:len(prefix)] == prefix and len(parts) > len(prefix):
                found.add(parts[len(prefix)])
    return found


def layer_offenders(root: Path, allowed: dict[str, set[str]], package: str) -> list[str]:
    """``"<file> imports [...]"`` for every file under ``root/<sub>`` that imports a
    subpackage of ``package`` other than itself and ``allowed[sub]``."""
    offenders = []
    for sub, may in allowed.items():
        for path in sorted((root / sub).rglob("*.py")):
            extra = subpackages_imported(path, package) - may - {sub}
            if extra:
                where = path.relative_to(root.parent)
                offenders.append(f"{where} imports {sorted(extra)}")
    return offenders

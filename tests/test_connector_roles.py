"""The connector by role: the folder listing tells where a pull is served (``prefill/``) and
where it is made (``decode/``); what both need is in ``common/``. Prefill and decode never
import each other, common imports neither, and only ``entry`` (what vLLM calls),
``scheduler`` (the scheduler half) and ``worker`` (a worker's composition) sit on top."""

from __future__ import annotations

import ast
from pathlib import Path

CONNECTOR = Path(__file__).resolve().parent.parent / "vllm_flagcx" / "connector"

# The connector by role: which of its subpackages each may import. Prefill (where a pull
# is served) and decode (where it is made) never import each other; what both need is in
# common, which imports neither.
ROLES = {"prefill": {"common"}, "decode": {"common"}, "common": set()}


def _role_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module
                 and node.level == 0 else [])
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["vllm_flagcx", "connector"] and len(parts) > 2:
                found.add(parts[2])
    return found


def test_prefill_and_decode_never_import_each_other():
    offenders = []
    for role, allowed in ROLES.items():
        for path in sorted((CONNECTOR / role).rglob("*.py")):
            extra = _role_imports(path) - allowed - {role}
            if extra:
                where = path.relative_to(CONNECTOR.parent.parent)
                offenders.append(f"{where} imports {sorted(extra)}")
    assert offenders == [], offenders
    top = {p.stem for p in CONNECTOR.glob("*.py")} - {"__init__"}
    assert top == {"entry", "scheduler", "worker"}, "give a new connector module its role"


def test_the_role_check_catches_a_cross_import(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("from vllm_flagcx.connector.decode.puller import Puller\n"
                      "import vllm_flagcx.connector.common.counters\n")
    assert _role_imports(sample) == {"decode", "common"}

"""The connector by role: the folder listing tells where a pull is served (``prefill/``) and
where it is made (``decode/``); what both need is in ``common/``. Prefill and decode never
import each other, common imports neither, and only ``entry`` (what vLLM calls),
``scheduler`` (the scheduler half) and ``worker`` (a worker's composition) sit on top."""

from __future__ import annotations

from pathlib import Path

from testkit.imports import layer_offenders, subpackages_imported

CONNECTOR = Path(__file__).resolve().parent.parent / "vllm_flagcx" / "connector"

# The connector by role: which of its subpackages each may import. Prefill (where a pull
# is served) and decode (where it is made) never import each other; what both need is in
# common, which imports neither.
ROLES = {"prefill": {"common"}, "decode": {"common"}, "common": set()}


def test_prefill_and_decode_never_import_each_other():
    assert layer_offenders(CONNECTOR, ROLES, "vllm_flagcx.connector") == []
    top = {p.stem for p in CONNECTOR.glob("*.py")} - {"__init__"}
    assert top == {"entry", "scheduler", "worker"}, "give a new connector module its role"


def test_the_role_check_catches_a_cross_import(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("from vllm_flagcx.connector.decode.puller import Puller\n"
                      "import vllm_flagcx.connector.common.counters\n")
    assert subpackages_imported(sample, "vllm_flagcx.connector") == {"decode", "common"}
    assert subpackages_imported(sample) == {"connector"}

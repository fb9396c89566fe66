"""compat as a layer: one cached, typed capabilities object, and "required" meaning "called".

The porting checklist (``vllm-flagcx doctor``, docs/porting.md) demands every required name
and feature of a vendor build, so a required entry the connector never uses makes a working
build look unsupported, and a used entry marked optional lets a build pass the doctor and fail
at run time. The rules below read the package's source (AST), so they fail when either drifts.
"""

from __future__ import annotations

import ast
import pathlib
import typing

import pytest

from vllm_flagcx.compat import capabilities as caps_module
from vllm_flagcx.compat.capabilities import Capabilities, capabilities
from vllm_flagcx.compat.moved import MOVED_NAMES
from vllm_flagcx.compat.probe import FEATURES, FEATURES_BY_KEY, FeatureProbe

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "vllm_flagcx"
TABLES = {"moved.py", "probe.py", "capabilities.py"}


def _calls(tree: ast.AST, func: str) -> set[str]:
    """String arguments of calls to ``func("KEY")``."""
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == func and node.args and isinstance(node.args[0], ast.Constant)}


def _capability_reads(tree: ast.AST) -> set[str]:
    """Attributes read as ``capabilities().NAME``."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "capabilities"}


def _package_trees() -> list[ast.AST]:
    return [ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")
            if path.name not in TABLES]


def _probe_functions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse((PACKAGE / "compat" / "probe.py").read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _usage() -> tuple[set[str], set[str], set[str], set[str]]:
    """(names resolved, names looked up as optional, features read, names a read feature
    inspects) by the package."""
    trees = _package_trees()
    features = set().union(*(_capability_reads(t) for t in trees))
    resolved = set().union(*(_calls(t, "resolve") for t in trees))
    optional = set().union(*(_calls(t, "optional") for t in trees))
    functions = _probe_functions()
    inspected: set[str] = set()
    for key in features:  # a feature's probe uses the names it inspects
        fn = functions[FEATURES_BY_KEY[key].probe.__name__]
        resolved |= _calls(fn, "resolve")
        optional |= _calls(fn, "optional")
        inspected |= _calls(fn, "resolve") | _calls(fn, "optional")
    for helper in ("_scheduler_source", "installed_platform_traits"):
        resolved |= _calls(functions[helper], "resolve")
    return resolved, optional, features, inspected


def test_the_object_has_one_typed_attribute_per_feature():
    attributes = {name for name, value in vars(Capabilities).items()
                  if isinstance(value, caps_module.cached_property)}
    assert attributes == set(FEATURES_BY_KEY)


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.key)
def test_each_label_is_one_its_type_allows(feature: FeatureProbe):
    label = getattr(capabilities(), feature.key)
    hint = typing.get_type_hints(getattr(Capabilities, feature.key).func)["return"]
    if hint is not str:
        assert label in typing.get_args(hint), (feature.key, label, hint)


def test_each_feature_is_probed_once(monkeypatch):
    counted = []
    original = FEATURES_BY_KEY["mamba_type"]

    def counting() -> str:
        counted.append(1)
        return original.probe()

    monkeypatch.setitem(FEATURES_BY_KEY, "mamba_type",
                        FeatureProbe(original.key, original.group, counting, original.required,
                                     original.provide))
    caps_module.clear_caches()
    try:
        assert capabilities().mamba_type == capabilities().mamba_type == original.probe()
        assert counted == [1]
    finally:
        monkeypatch.undo()
        caps_module.clear_caches()


def test_no_feature_is_probed_outside_the_capabilities_object():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name in TABLES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "FEATURES_BY_KEY":
                offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


def test_every_required_name_is_used_and_every_resolved_name_is_required():
    resolved, optional, _, inspected = _usage()
    required = {m.key for m in MOVED_NAMES if m.required}
    assert required - (resolved | optional) == set(), "required but never used"
    # An optional name may be resolved only behind the feature whose probe inspects it
    # (``if capabilities().current_attn_backends == "list": resolve(...)``).
    unguarded = resolved - required - inspected
    assert unguarded == set(), "resolved (a hard failure where absent) but optional"
    assert (optional - resolved) & required == set(), "looked up as optional but required"


def test_every_required_feature_is_read_by_the_package():
    _, _, features, _ = _usage()
    required = {f.key for f in FEATURES if f.required}
    assert required - features == set(), "required but never read: the doctor would demand it"


def test_every_required_feature_is_read_by_the_product():
    """"Required" means the connector calls it: a feature only the tests read is
    informational, so the porting checklist never calls a working vendor build
    unsupported for it (issue 26)."""
    _, _, read_by_product, _ = _usage()
    required = {f.key for f in FEATURES if f.required}
    assert required - read_by_product == set(), "required, but the product never reads it"

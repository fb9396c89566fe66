"""The probes, run against the installed real vLLM, find what matrix/builds.toml states."""

from __future__ import annotations

import pytest

from vllm_flagcx.compat import capabilities as capabilities_mod
from vllm_flagcx.compat import probe
from vllm_flagcx.compat.moved import MOVED_NAMES


def test_profile_equals_matrix_expectation(matrix_build):
    found = probe.profile()
    diff = {k: (matrix_build.profile.get(k), found.get(k))
            for k in set(found) | set(matrix_build.profile)
            if found.get(k) != matrix_build.profile.get(k)}
    assert diff == {}, f"(expected, found) per capability on {matrix_build.env}: {diff}"


def test_installed_version_is_the_env_build(matrix_build):
    from vllm_flagcx.compat.version import installed_version

    assert installed_version().matches(f"=={matrix_build.version}")


@pytest.mark.parametrize("entry", [m for m in MOVED_NAMES if m.required], ids=lambda m: m.key)
def test_every_required_name_resolves(entry):
    assert probe.resolve(entry.key) is not None


def test_every_capability_probe_runs():
    failures = [r for r in probe.capability_reports() if r.where.startswith("probe failed")]
    assert failures == []
    missing = [r.key for r in probe.capability_reports() if r.required and not r.found]
    assert missing == []


def test_the_connector_base_is_this_vllms_own():
    """The portable base subclasses the installed vLLM's connector base and HMA mixin, and
    the worker metadata type is vLLM's class where the build has one (0.18+), else the
    shim of ours that is never sent."""
    from vllm_flagcx.compat import connector_api
    from vllm_flagcx.compat.probe import optional

    assert issubclass(connector_api.PortableConnectorBase, connector_api.KVConnectorBase_V1)
    assert issubclass(connector_api.PortableConnectorBase, connector_api.SupportsHMA)
    native = optional("KVConnectorWorkerMetadata")
    assert connector_api.KVConnectorWorkerMetadata is (
        native or connector_api._WorkerMetadataShim)


def test_missing_name_error_says_what_to_provide(monkeypatch):
    from vllm_flagcx.compat.moved import MOVED_BY_KEY, MovedName

    fake = MovedName("NotInVllm", "connector", ("vllm.no_such_module:Thing",), True,
                     "a Thing for the test")
    monkeypatch.setitem(MOVED_BY_KEY, "NotInVllm", fake)
    with pytest.raises(probe.MissingCapability) as err:
        probe.resolve("NotInVllm")
    text = str(err.value)
    assert "NotInVllm" in text and "vllm.no_such_module:Thing" in text
    assert "a Thing for the test" in text
    capabilities_mod.clear_caches()


def test_worker_metadata_shim_where_absent(matrix_build):
    from vllm_flagcx.compat import connector_api

    if matrix_build.profile["KVConnectorWorkerMetadata"] == "absent":
        assert connector_api.KVConnectorWorkerMetadata.__name__ == "_WorkerMetadataShim"
    else:
        assert connector_api.KVConnectorWorkerMetadata is probe.resolve(
            "KVConnectorWorkerMetadata")
    assert (connector_api.KVConnectorTransferResults is None) == (
        matrix_build.profile["KVConnectorTransferResults"] == "absent")

"""Version strings with vendor local parts, and vendor classification from real Platforms."""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_flagcx.compat import version as v


@pytest.mark.parametrize(("raw", "release", "local"), [
    ("0.20.0+das.opt1.dtk2504", (0, 20, 0), "das.opt1.dtk2504"),
    ("0.28.1+dtk2604.torch2110.20260101.gabc123", (0, 28, 1), "dtk2604.torch2110.20260101.gabc123"),
    ("0.20.2+maca3.2.1", (0, 20, 2), "maca3.2.1"),
    ("0.13.0", (0, 13, 0), None),
    ("0.23.0rc1", (0, 23, 0), None),
])
def test_parse_local_parts(raw, release, local):
    parsed = v.parse_vllm_version(raw)
    assert parsed.release == release
    assert parsed.local == local


def test_local_part_equality_vs_specifier():
    # The trap the compat layer exists for: exact Version equality fails on vendor builds,
    # a specifier (as pip applies it) matches.
    assert Version("0.20.0+das") != Version("0.20.0")
    assert SpecifierSet("==0.20.0").contains(Version("0.20.0+das"))
    parsed = v.parse_vllm_version("0.20.0+das.opt1.dtk2504")
    assert parsed.matches("==0.20.0")
    assert parsed.at_least("0.20") and not parsed.at_least("0.21")


def test_prerelease_counts_as_its_release_for_api_gates():
    assert Version("0.23.0rc1") < Version("0.23")
    assert v.parse_vllm_version("0.23.0rc1").at_least("0.23")


@pytest.mark.parametrize("raw", ["dev", "", "not-a-version"])
def test_unparsable_is_read_as_a_dev_release_below_every_feature(raw):
    parsed = v.parse_vllm_version(raw)
    assert parsed.unreadable and parsed.version.is_devrelease
    assert not parsed.at_least("0.1")


def test_installed_version_reads_dunder_first(monkeypatch, matrix_build):
    import vllm

    monkeypatch.setattr(vllm, "__version__", matrix_build.simulate.version_string)
    got = v.installed_version()
    assert got.raw == matrix_build.simulate.version_string
    assert ".".join(map(str, got.release)) == matrix_build.version


def test_installed_version_falls_back_to_metadata(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "dev")
    assert v.installed_version().release != (0, 0, 0)


def test_installed_distribution_is_found():
    assert v.installed_distribution() in v.KNOWN_DISTRIBUTIONS


def _vendor_platform(traits):
    """A real vLLM Platform subclass presenting the vendor traits of a matrix build."""
    from vllm.platforms.interface import Platform, PlatformEnum

    cuda_alike = traits.is_cuda_alike
    return type("SimulatedVendorPlatform", (Platform,), {
        "_enum": PlatformEnum[traits.platform_enum],
        "device_name": traits.device_name,
        "device_type": "cuda",
        "dispatch_key": "CUDA",
        "is_cuda_alike": lambda self: cuda_alike,
    })()


def test_vendor_of_simulated_build(matrix_build):
    """Each env simulates its matrix vendor (Hygon on vllm020, MetaX on vllm0202...)."""
    sim = matrix_build.simulate
    platform = _vendor_platform(sim)
    traits = v.platform_traits(platform)
    assert traits.device_name == sim.device_name
    assert traits.enum_name == sim.platform_enum
    vendor = v.classify_vendor(traits, v.parse_vllm_version(sim.version_string))
    assert vendor == sim.expect_vendor


def test_hygon_and_metax_platform_classification():
    from vllm.platforms.interface import PlatformEnum

    hygon = _vendor_platform(type("T", (), {"platform_enum": "ROCM", "device_name": "hip",
                                            "is_cuda_alike": True})())
    metax = _vendor_platform(type("T", (), {"platform_enum": "OOT", "device_name": "maca",
                                            "is_cuda_alike": True})())
    assert hygon.is_rocm() and not hygon.is_cuda()
    assert metax._enum == PlatformEnum.OOT and not metax.is_cuda() and metax.is_cuda_alike()
    upstream = v.parse_vllm_version("0.20.2")
    assert v.classify_vendor(v.platform_traits(hygon), upstream) == "hygon"
    assert v.classify_vendor(v.platform_traits(metax), upstream) == "metax"
    plain_rocm = v.PlatformTraits("rocm", "ROCM", True)
    assert v.classify_vendor(plain_rocm, upstream) == "rocm"
    # A Hygon build is recognised from its version string even on a generic ROCm platform.
    assert v.classify_vendor(plain_rocm, v.parse_vllm_version("0.20.0+das.opt1")) == "hygon"


def test_installed_platform_is_read():
    from vllm_flagcx.compat import probe

    traits = probe.installed_platform_traits()
    assert traits.enum_name in {"CPU", "UNSPECIFIED", "CUDA", "ROCM", "OOT"}


def test_an_override_names_the_release_and_doctor_says_where_the_version_came_from(
        monkeypatch):
    from vllm_flagcx.compat import version

    monkeypatch.setenv(version.VERSION_OVERRIDE_ENV, "0.30.0")
    assert version.installed_version().release == (0, 30, 0)
    assert version.VERSION_OVERRIDE_ENV in version.version_source()
    monkeypatch.delenv(version.VERSION_OVERRIDE_ENV)
    assert version.version_source() in ("vllm.__version__",) or \
        version.version_source().startswith("metadata of")


def test_an_unparsable_version_is_decided_by_features_not_read_as_zero(monkeypatch):
    """A vendor string packaging cannot read (vllm-ascend's pattern) must not send the
    HMA default down the pre-0.22 branch: the trace in VllmConfig decides, and agrees
    with the branch this build's real version takes; doctor names the fix."""
    import io

    from vllm_flagcx import doctor
    from vllm_flagcx.compat import probe, version

    real = probe._hma_default()
    monkeypatch.setenv(version.VERSION_OVERRIDE_ENV, "ascend-v0.x~rc")
    assert version.installed_version().release == (0, 0, 0)
    assert probe._hma_default() == real
    out = io.StringIO()
    doctor.render(doctor.collect(), out)
    assert "does not parse" in out.getvalue() and version.VERSION_OVERRIDE_ENV in out.getvalue()

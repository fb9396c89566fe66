"""The supported vLLM builds, as data (``builds.toml``), and their loader.

Installed as ``vllm_flagcx.matrix`` (pyproject maps this folder), so the doctor can tell
which supported build it is looking at. tox.ini and docs/porting.md are rendered from the
same data by ``python -m vllm_flagcx.matrix.render``; a test fails when they drift.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from packaging.version import InvalidVersion, Version

BUILDS_FILE = Path(__file__).with_name("builds.toml")


@dataclass(frozen=True)
class VendorTraits:
    """What a vendor build looks like from inside vLLM, for the tests to simulate."""

    version_string: str
    device_name: str
    platform_enum: str
    is_cuda_alike: bool
    expect_vendor: str


@dataclass(frozen=True)
class Build:
    env: str
    version: str
    label: str
    simulate: VendorTraits
    overlay: tuple[str, ...] = ()
    profile: dict[str, str] = field(default_factory=dict)
    tests: tuple[str, ...] = ()  # what its tox env runs; () is the whole suite

    @property
    def focused(self) -> bool:
        return bool(self.tests)

    @property
    def pin(self) -> str:
        return f"vllm=={self.version}"

    @property
    def install(self) -> str:
        """What tox installs with --no-deps over the shared base for this build."""
        return " ".join((self.pin, *self.overlay))


@functools.lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    with BUILDS_FILE.open("rb") as handle:
        return tomllib.load(handle)


@functools.lru_cache(maxsize=1)
def builds() -> tuple[Build, ...]:
    data = load()
    common = dict(data.get("common_profile", {}))
    out = []
    for raw in data["build"]:
        profile = {**common, **raw.get("profile", {})}
        suite = raw.get("suite", "all")
        if suite != "all" and suite not in data.get("suites", {}):
            raise ValueError(f"build {raw['env']}: suite {suite!r} is not in [suites] of "
                           f"{BUILDS_FILE.name} (or write suite = \"all\")")
        out.append(Build(env=raw["env"], version=raw["version"], label=raw["label"],
                         simulate=VendorTraits(**raw["simulate"]),
                         overlay=tuple(raw.get("overlay", ())), profile=profile,
                         tests=tuple(data["suites"][suite]) if suite != "all" else ()))
    return tuple(out)


def build_by_env(env: str) -> Build:
    for build in builds():
        if build.env == env:
            return build
    known = ", ".join(b.env for b in builds())
    raise KeyError(f"no build {env!r} in {BUILDS_FILE.name}; known: {known}")


def build_for_version(raw: str) -> Build | None:
    """The supported build with the same release as ``raw`` (local parts ignored)."""
    try:
        release = Version(raw).release
    except InvalidVersion:
        return None
    for build in builds():
        if Version(build.version).release == release:
            return build
    return None


def tox_settings() -> dict[str, Any]:
    return dict(load()["tox"])


def bench_settings() -> dict[str, Any]:
    """The benchmark env: extra packages (charts) and the default arguments."""
    return dict(load()["bench"])


def e2e_settings() -> dict[str, Any]:
    """The real-engine env: which build, which distribution, its requirements, its tests."""
    return dict(load()["e2e"])


def e2e_newest_settings() -> dict[str, Any]:
    """Real engines on the newest CPU build: its distribution, overlay, extra deps, tests."""
    return dict(load()["e2e_newest"])

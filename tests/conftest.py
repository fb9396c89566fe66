"""Test session setup: offline hub, the CPU platform (``cpu_platform``), and the matrix
build under test."""

from __future__ import annotations

import os

import pytest
from testkit import cpu_platform  # noqa: F401 - offline env and the CPU platform, before vLLM loads


@pytest.fixture(scope="session")
def matrix_build():
    """The matrix build this tox env tests (from VLLM_FLAGCX_MATRIX_ENV or the version)."""
    from vllm_flagcx.compat.version import installed_version_string
    from vllm_flagcx.matrix import build_by_env, build_for_version

    env = os.environ.get("VLLM_FLAGCX_MATRIX_ENV")
    if env and env.startswith("vllm"):
        return build_by_env(env)
    build = build_for_version(installed_version_string())
    if build is None:
        pytest.skip("installed vLLM is not a build of matrix/builds.toml")
    return build

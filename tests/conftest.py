"""Test session setup: offline hub, the CPU platform (``cpu_platform``), and the matrix
build under test."""

from __future__ import annotations

import os
import tempfile

import pytest
from testkit import cpu_platform  # noqa: F401 - offline env and the CPU platform, before vLLM loads

from vllm_flagcx.wire.endpoints import SOCKET_DIR_ENV

# Each test session its own side-channel socket directory (0700, short path): concurrent
# sessions on one machine never meet on a socket; engines this session starts inherit it.
os.environ.setdefault(SOCKET_DIR_ENV, tempfile.mkdtemp(prefix="fx-"))


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

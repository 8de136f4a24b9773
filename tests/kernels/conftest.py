"""Fixtures for the copy-kernel tests: the host-shim executable, built once per session."""

from __future__ import annotations

import shutil

import pytest

from tests.kernels.shim import ShimRunner, build_shim


@pytest.fixture(scope="session")
def shim(tmp_path_factory: pytest.TempPathFactory) -> ShimRunner:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the host-shim proof needs a C++ compiler")
    out = tmp_path_factory.mktemp("kvcopy_shim")
    return ShimRunner(build_shim(out), out)

"""Settings for every test: fused kernels compiled ahead go to a cache of the session's own (each one
compiles once per session, in a child process), not the user's (``~/.cache/gradzip/kernels``), unless
``GRADZIP_KERNEL_CACHE`` names one (scripts/gpu_check.sh shares its benchmarks' with the tests)."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    before = os.environ.get("GRADZIP_KERNEL_CACHE")
    if before:
        yield before
        return
    os.environ["GRADZIP_KERNEL_CACHE"] = str(tmp_path_factory.mktemp("kernels"))
    yield os.environ["GRADZIP_KERNEL_CACHE"]
    del os.environ["GRADZIP_KERNEL_CACHE"]

"""Settings for every test: fused kernels compiled ahead go to a cache of the session's own (each one
compiles once per session, in a child process; pytest-xdist's workers share it, as a machine's ranks
do), not the user's (``~/.cache/gradzip/kernels``), unless ``GRADZIP_KERNEL_CACHE`` names one
(scripts/gpu_check.sh shares its benchmarks' with the tests).

Tests marked ``slow`` (repetitions, and sweeps of every kernel form, method or world size whose
representatives the default run keeps) run only with ``GRADZIP_SLOW=1``: the default run stays within CI's time."""
from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GRADZIP_SLOW") == "1":
        return
    slow = pytest.mark.skip(reason="slow tier (repetitions; every kernel form, method, world size): set GRADZIP_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(slow)


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    before = os.environ.get("GRADZIP_KERNEL_CACHE")
    if before:
        yield before
        return
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one cache for the run's workers, as for a machine's ranks
        root = root.parent
    (root / "kernels").mkdir(exist_ok=True)
    os.environ["GRADZIP_KERNEL_CACHE"] = str(root / "kernels")
    yield os.environ["GRADZIP_KERNEL_CACHE"]
    del os.environ["GRADZIP_KERNEL_CACHE"]

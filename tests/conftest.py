"""Settings for every test: fused kernels compiled ahead go to a cache of the session's own (each one
compiles once per session, in a child process; pytest-xdist's workers share it, as a machine's ranks
do), not the user's (``~/.cache/gradzip/kernels``), unless ``GRADZIP_KERNEL_CACHE`` names one
(scripts/gpu_check.sh shares its benchmarks' with the tests).

Tests marked ``slow`` (repetitions, and sweeps of every kernel form, method or world size whose
representatives the default run keeps) run only with ``GRADZIP_SLOW=1``: the default run stays within CI's time."""
from __future__ import annotations

import os

import pytest
import torch

# Several pytest-xdist workers share the machine's cores: each computes on one thread, as a machine's
# training ranks do, instead of each running a thread per core that waits on the others' work.  Only the
# workers themselves: what they start keeps its own default (a kernel compiled ahead is compiled for
# the threads its process has, and users' processes have a thread per core).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GRADZIP_SLOW") == "1":
        return
    slow = pytest.mark.skip(reason="slow tier (repetitions; every kernel form, method, world size): set GRADZIP_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(slow)


#: Files whose tests share a session-scoped launch with another file's (tests/stacks/conftest.py's
#: ``gpt_plan``): pytest-xdist's ``--dist loadfile`` gives them to that file's worker, so it runs once.
SHARED_LAUNCHES = {"tests/stacks/test_resume.py": "tests/stacks/test_gpt_features.py"}

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # no pytest-xdist: its hook below would be unknown to pytest
    LoadFileScheduling = None

if LoadFileScheduling is not None:
    class _FilesSharingLaunches(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_LAUNCHES.get(scope, scope)

    def pytest_xdist_make_scheduler(config, log):
        return _FilesSharingLaunches(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    before = os.environ.get("GRADZIP_KERNEL_CACHE")
    if before:
        yield before
        return
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # a local xdist worker's: one cache for the run's workers, as
        root = root.parent                # for a machine's ranks
    (root / "kernels").mkdir(exist_ok=True)
    os.environ["GRADZIP_KERNEL_CACHE"] = str(root / "kernels")
    yield os.environ["GRADZIP_KERNEL_CACHE"]
    del os.environ["GRADZIP_KERNEL_CACHE"]

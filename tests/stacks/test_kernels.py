"""gradzip's fused kernels in a user's DDP job: the GPT script under torchrun with the kernels on for
every tensor of at least 1024 elements (their defaults, 2^20 and 2^24 elements, are far above any
model these tests can train), and again with them off (``GRADZIP_FUSED=0``).

The kernels then run where users meet them: compiled on gradzip's communication thread of two real
processes, on DDP's bucket views, with gloo between them and state carried across steps.  Each run
must complete, end with bit-identical parameters on both ranks and learn; and the runs with kernels
must end bit for bit where the runs without them end, except for the quantisers whose kernels draw
their random numbers from a counter hash instead of torch's generator.
"""
import pytest

from .launch import Plan
from .methods import METHODS, deterministic, kept_unless_slow, params
from .test_gpt_features import check_gpt_run

#: Methods with a kernel on the route of these steps (the test checks that it ran).  Top-k's kernel
#: serves its sampled pre-selection, which only tensors of 2^16 elements and more take.
WITH_KERNELS = ("threshold", "adaptive_threshold", "dgc", "powersgd", "qsgd", "terngrad", "natural",
                "signsgd", "signum", "efsignsgd", "onebit")
#: Their kernels make uniforms from (index, seed) by a hash; the reference path calls torch.rand.
OWN_DRAWS = ("qsgd", "terngrad", "natural")
#: The default run launches the methods with a kernel on these steps' route; GRADZIP_SLOW=1 every method.
KERNEL_METHODS = kept_unless_slow(WITH_KERNELS)


@pytest.fixture(scope="session")
def kernels_plan(chars, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels")
    runs = [{"name": f"{feature}/{method}", "method": method, "params": params(method), "feature": feature,
             "deadline": 240}
            for method in KERNEL_METHODS for feature in ("fused", "unfused")]
    return Plan("gpt_ddp.py", runs, folder, timeout=540, budget=540).execute()


@pytest.mark.parametrize("method", [m if m in WITH_KERNELS else pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def test_with_and_without_kernels(kernels_plan, method):
    fused, unfused = kernels_plan.result(f"fused/{method}"), kernels_plan.result(f"unfused/{method}")
    for result in (fused, unfused):
        check_gpt_run(result, method)
    assert not any(rep["kernel_launches"] for rep in unfused.reports), unfused.reports[0]["kernel_launches"]
    if method in WITH_KERNELS:
        assert all(rep["kernel_launches"] for rep in fused.reports), f"{method}: no kernel ran"
    if deterministic(method) and method not in OWN_DRAWS:
        fused.assert_same_params(unfused)


def test_launches_exit_cleanly(kernels_plan):
    kernels_plan.assert_exit_codes()


#: Methods whose bucket route has kernels compiled ahead, with error feedback (encoding and residual).
AHEAD = {"qsgd": ("_qsgd_bucket_encode", "_bucket_residual")}


@pytest.fixture(scope="session")
def ahead_plan(chars, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ahead")
    runs = [{"name": f"{feature}/{method}", "method": method, "params": {**params(method), "feedback": "residual"},
             "feature": feature, "deadline": 300}
            for method in AHEAD for feature in ("ahead", "eager")]
    return Plan("gpt_ddp.py", runs, folder, timeout=600, budget=600).execute()


@pytest.mark.parametrize("method", list(AHEAD))
def test_kernels_compiled_ahead_in_a_users_job(ahead_plan, method):
    """The bucket route with its kernels compiled ahead (both ranks asking at once: one compiles, the other
    waits for its package) against the same job without kernels: both train, ranks bit-identical, and the
    same final parameters bit for bit, the kernels having run on every rank."""
    ahead, eager = ahead_plan.result(f"ahead/{method}"), ahead_plan.result(f"eager/{method}")
    for result in (ahead, eager):
        check_gpt_run(result, method)
    for rep in ahead.reports:
        assert all(rep["ahead_runs"].get(name) for name in AHEAD[method]), rep["ahead_runs"]
    ahead.assert_same_params(eager)
    ahead_plan.assert_exit_codes()

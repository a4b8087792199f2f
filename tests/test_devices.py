"""The one seam between the CPU and the GPU paths (:mod:`gradzip.devices`): the library outside the lab
asks its predicates instead of testing a device's type itself."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from gradzip import devices

PACKAGE = pathlib.Path(devices.__file__).parent
#: The lab (models, trainer, benchmarks, cost model, test helpers) picks devices for a run: not the seam's.
LAB = ("harness", "bench", "costmodel.py", "advise.py", "cli.py", "netem.py", "launcher.py", "testing.py")
#: A branch on a device's kind: ``x.device.type == ...``, ``device.type != ...``, ``t.is_cuda``, ``is_cpu``.
BRANCH = re.compile(r"\.type\s*(==|!=|in\b|not in\b)|\.is_cuda\b|\.is_cpu\b|\bdevice_type\s*(==|!=)")


def _library_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name != "devices.py" and relative.parts[0] not in LAB:
            yield relative, path


def test_no_device_branch_outside_the_seam():
    found = [f"{relative}:{number}: {line.strip()}" for relative, path in _library_files()
             for number, line in enumerate(path.read_text().splitlines(), 1) if BRANCH.search(line)]
    assert not found, "device branches outside gradzip/devices.py:\n" + "\n".join(found)


def test_the_pattern_finds_what_it_should():  # the check above cannot pass by matching nothing
    for line in ['if g.device.type == "cpu":', "if flag.is_cuda:", 'x.device.type != "cpu" or n', "device.type in CPUS"]:
        assert BRANCH.search(line), line
    assert list(_library_files()) and not BRANCH.search("layout.dtype == torch.float32")


#: Predicates that say where a GPU's form is taken (the others say where a CPU's is).
GPU_FORMS = {"cuda", "looks_up_rows_at_once", "runs_kernels_ahead", "optimises_ahead"}


@pytest.mark.parametrize("name", [n for n in devices.__all__ if n not in GPU_FORMS])
def test_every_cpu_fast_path_is_taken_on_a_cpu(name):
    predicate = getattr(devices, name)
    assert predicate(torch.zeros(1)) and predicate(torch.device("cpu")) and predicate("cpu")
    assert not predicate(torch.device("meta")) and not predicate("cuda")


def test_one_lookup_for_every_row_is_a_gpu_form():
    assert devices.looks_up_rows_at_once("cuda") and not devices.looks_up_rows_at_once(torch.zeros(1))


@pytest.mark.parametrize("n", [0, 1, 7, 1001])
def test_trits_decode_the_same_either_way(n, monkeypatch):
    """Ternary signs decoded and voted by one lookup per byte (a GPU's form) or one per digit (a CPU's)."""
    from gradzip.compressors.sign import decode_trits, encode_trits, vote_of_trits
    gen = torch.Generator().manual_seed(n)
    xs = [torch.randn(n, generator=gen).mul_(torch.randint(0, 2, (n,), generator=gen)) for _ in range(3)]
    packed = [encode_trits(x) for x in xs]
    results = []
    for at_once in (False, True):
        monkeypatch.setattr(devices, "looks_up_rows_at_once", lambda where: at_once)
        results.append(([decode_trits(p, n) for p in packed], vote_of_trits(packed, (n,))))
    (one, vote_one), (other, vote_other) = results
    assert all(torch.equal(a, b) for a, b in zip(one, other)) and torch.equal(vote_one, vote_other)
    assert torch.equal(one[0], torch.sign(xs[0]).to(torch.int8))  # and they are the signs


def test_cuda_is_cuda():
    assert devices.cuda("cuda:1") and devices.cuda(torch.device("cuda")) and not devices.cuda(torch.zeros(1))


def _bucketed_cases():
    """test_buckets' cases on its odd small bucket, and each method's default on one past the sizes where
    large temporaries reuse buffers and a CPU checks its input chunk by chunk."""
    from .test_buckets import BUCKETED, CASES, IDS, SHAPES
    large = [(600, 500), *SHAPES]
    return ([(name, params, SHAPES) for name, params in CASES] + [(name, {}, large) for name in BUCKETED],
            IDS + [f"{name}-large" for name in BUCKETED])


@pytest.mark.parametrize("name, params, shapes", _bucketed_cases()[0], ids=_bucketed_cases()[1])
def test_the_bucket_route_in_the_gpus_forms_equals_the_cpus(name, params, shapes, monkeypatch):
    """Every predicate of the seam as on a GPU (but no streams or pinned memory), on this CPU: the
    bucket route's results and state equal the CPU forms' from the same state, up to float-sum order,
    so that the code a GPU runs is run, and checked, by every CPU test run.  Its kernels compiled ahead
    are off (a package for a GPU cannot be made here; tests/test_ahead_kernels.py checks them against
    these reference paths)."""
    from unittest import mock

    monkeypatch.setenv("GRADZIP_FUSED", "0")

    from gradzip.state import GradzipState
    states = [GradzipState(name, bucketed=True, **params) for _ in range(2)]  # the same draws by counter
    numels = [torch.Size(s).numel() for s in shapes]
    asked = []

    def gpu(where):
        asked.append(where)
        return "cuda"
    for step in range(3):
        flat = torch.randn(sum(numels), generator=torch.Generator().manual_seed(step))
        outs = []
        for gpu_forms, state in enumerate(states):
            named = [(f"layer{i}", v.view(s)) for i, (v, s) in enumerate(zip(flat.clone().split(numels), shapes))]
            with mock.patch.multiple(devices, _type=gpu if gpu_forms else (lambda where: "cpu"),
                                     cuda=lambda where: False):
                outs.append(torch.cat([g.reshape(-1) for g in state.exchange(named, out=[g for _, g in named])]))
        close = torch.isclose(outs[1], outs[0], rtol=1e-4, atol=1e-5, equal_nan=True)
        assert int((~close).sum()) <= 0.001 * close.numel(), f"step {step}: {int((~close).sum())} differ"
    for key, slot in states[0].tensors.items():
        for what, value in slot.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                torch.testing.assert_close(states[1].tensors[key][what], value, rtol=1e-4, atol=1e-5)
    if not asked:
        pytest.skip(f"{name}'s exchange asks the seam nothing: one form on every device")


def test_a_kernel_compiled_ahead_is_named_for_its_machine():
    """Not a predicate: what a package in the kernel cache was compiled for (a CPU's kind here)."""
    import platform

    from torch._inductor import cpu_vec_isa
    target = f"cpu-{platform.machine()}-{cpu_vec_isa.pick_vec_isa()}"
    assert devices.compile_target(torch.zeros(1)) == devices.compile_target("cpu") == target

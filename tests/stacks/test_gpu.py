"""The GPU tier: the same user scripts on CUDA with NCCL, 2 workers where there are 2 GPUs, and NCCL at
world size 1.  Skipped without CUDA."""
import pytest
import torch
import torch.distributed as dist

from .conftest import GPT_FEATURES, gpt_runs
from .launch import Plan, load_result, torchrun
from .methods import METHODS
from .test_ddp_tutorial import check_tutorial_run, launch_tutorial
from .test_gpt_features import check_gpt_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                                   reason="needs CUDA and NCCL")]


def workers() -> int:
    """2 workers with 2 GPUs or more; NCCL cannot put two ranks on one GPU."""
    return 2 if torch.cuda.device_count() >= 2 else 1


@pytest.mark.parametrize("nproc", [1, 2], ids=["world_size_1", "world_size_2"])
@pytest.mark.parametrize("method", METHODS)
def test_tutorial_script_nccl(method, nproc, tmp_path):
    if nproc > torch.cuda.device_count():
        pytest.skip(f"{nproc} NCCL workers need {nproc} GPUs")
    launch = launch_tutorial(method, tmp_path, "--device", "cuda", nproc=nproc)
    check_tutorial_run(method, tmp_path, launch, nproc=nproc)


@pytest.fixture(scope="module")
def gpt_cuda_plan(chars, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_cuda")
    return Plan("gpt_ddp.py", gpt_runs(GPT_FEATURES, METHODS), folder, args=("--device", "cuda"), nproc=workers(),
                timeout=480).execute()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("feature", GPT_FEATURES)
def test_gpt_feature_cuda(gpt_cuda_plan, feature, method):
    check_gpt_run(gpt_cuda_plan.result(f"{feature}/{method}"), method, world_size=workers(), loss_scaled=feature == "fp16")


def test_gpt_cuda_launches_exit_cleanly(gpt_cuda_plan):
    gpt_cuda_plan.assert_exit_codes()


def test_lightning_strategy_comm_hook_on_cuda(chars, tmp_path):
    pytest.importorskip("lightning")
    n = workers()
    launch = torchrun("lightning_gpt.py", "--out", tmp_path, "--register", "strategy", "--device", "cuda",
                      "--devices", n, nproc=n, timeout=300, log=tmp_path / "launch.log")
    assert launch.ok, launch.describe()
    result = load_result(tmp_path, "lightning", nproc=n)
    result.assert_ranks_identical()
    result.assert_learned()
    result.assert_gradzip_exchanged(world_size=n)
    result.assert_compressed()


# -- the bucket route on CUDA --------------------------------------------------------------------------

def _bucketed_cases():
    from gradzip.compressors import compressors, make

    from ..test_buckets import CASES
    return [(name, params) for name, params in CASES if make(name).bucketed] + \
        [(name, {}) for name in compressors() if not make(name).bucketed]


#: Methods whose payload size depends on the data: they may read one count per bucket.
DATA_SIZED = {"threshold", "dropping", "adaptive_threshold", "dgc"}


def _state_to_cuda(*states) -> None:
    """Every tensor of the states' per-tensor slots moved to the GPU (their starting state made on CPU)."""
    for state in states:
        for slot in state.tensors.values():
            for key in slot:
                slot[key] = slot[key].cuda()


def _cuda_bucket(seed: int, dtype=torch.float32):
    from ..test_buckets import SHAPES
    gen = torch.Generator().manual_seed(seed)
    numels = [torch.Size(s).numel() for s in SHAPES]
    flat = torch.randn(sum(numels), generator=gen).to(device="cuda", dtype=dtype)
    return [(f"layer{i}", v.view(s)) for i, (v, s) in enumerate(zip(torch.split(flat, numels), SHAPES))]


@pytest.mark.parametrize("name, params", _bucketed_cases(), ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_bucket_exchange_sync_debug(name, params):
    """Every method's exchange of a CUDA bucket under torch.cuda.set_sync_debug_mode('error'): a method
    on the bucket route never waits for the device (a data-sized one reads at most one count per
    bucket, checked under 'warn'); the others (per-tensor route) are reported, not failed."""
    import warnings

    from gradzip.state import GradzipState
    state = GradzipState(name, **params)
    for step in range(2):  # the layout's device tensors are made once, at the first exchange
        named = _cuda_bucket(step)
        state.exchange(named, out=[g for _, g in named])
    bucketed = bool(state._route.buckets)
    if not bucketed:
        pytest.skip(f"{name} takes the per-tensor route on CUDA")
    named = _cuda_bucket(5)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn" if name in DATA_SIZED else "error")
        try:
            state.exchange(named, out=[g for _, g in named])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) <= (1 if name in DATA_SIZED else 0), [str(w.message) for w in syncs]
    torch.cuda.synchronize()
    assert all(torch.isfinite(g).all() for _, g in named)


def _resumed_from_cpu(name, params, steps):
    """(a state after ``steps`` exchanges of CUDA buckets, a fresh one that loaded its state_dict as
    ``register(resume=...)`` does: saved, then read with map_location="cpu")."""
    import io

    from gradzip.state import GradzipState
    going = GradzipState(name, **params)
    for step in range(steps):
        named = _cuda_bucket(step)
        going.exchange(named, out=[g for _, g in named])
    buffer = io.BytesIO()
    torch.save(going.state_dict(), buffer)
    buffer.seek(0)
    resumed = GradzipState(name, **params)
    resumed.load_state_dict(torch.load(buffer, map_location="cpu", weights_only=True))
    return going, resumed


@pytest.mark.parametrize("bucketed", [True, False], ids=["bucket_route", "per_tensor_route"])
@pytest.mark.parametrize("name, params", [("topk", {}), ("efsignsgd", {}), ("qsgd", {"feedback": "residual"}),
                                          ("powersgd", {"dense_steps": 0}),
                                          ("dgc", {"min_numel": 0, "warmup_epochs": 0, "ratio": 0.1})],
                         ids=["topk", "efsignsgd", "qsgd", "powersgd", "dgc"])
def test_state_loaded_on_cpu_continues_on_cuda(name, params, bucketed):
    """A state_dict saved from CUDA and loaded with map_location="cpu" (as ``register(resume=...)`` loads
    it) into a state no process group places (world size 1): its tensors follow the gradients to the GPU
    at the next exchange, which continues bit for bit as the state that was never saved."""
    going, resumed = _resumed_from_cpu(name, {"bucketed": bucketed, **params}, steps=2)
    for step in range(2, 4):
        named, again = _cuda_bucket(step), _cuda_bucket(step)
        going.exchange(named, out=[g for _, g in named])
        resumed.exchange(again, out=[g for _, g in again])
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, again)), f"{name}: differs at step {step}"
    assert all(v.is_cuda for slot in resumed.tensors.values() for v in slot.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("name, params", [c for c in _bucketed_cases() if c[0] not in DATA_SIZED],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_bucket_route_against_per_tensor_on_cuda(name, params):
    """On CUDA the bucket route's aggregates equal the per-tensor route's (CPU-style reference run on
    the same CUDA tensors) up to float-sum order; random methods are compared in expectation on CPU."""
    from gradzip.compressors import make
    from gradzip.state import GradzipState

    from ..test_buckets import _same_starting_state
    if not make(name).bucketed or not make(name).deterministic or params.get("warm_start") is False:
        pytest.skip("per-tensor route, or random draws that differ by route")
    bucketed = GradzipState(name, bucketed=True, **params)
    reference = GradzipState(name, bucketed=False, **params)
    _same_starting_state((bucketed, reference), torch.float32)
    _state_to_cuda(bucketed, reference)
    for step in range(3):
        named = _cuda_bucket(step)
        want = reference.exchange([(k, g.clone()) for k, g in named])
        got = bucketed.exchange(named, out=[g for _, g in named])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, params", [c for c in _bucketed_cases()],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_bucket_route_two_ranks_on_one_gpu(name, params):
    """Two ranks (threads) on one GPU: bit-identical aggregates every step."""
    from gradzip.state import GradzipState

    from ..workers import run_threads

    def rank_run(rank, transport):
        state = GradzipState(name, transport=transport, **params)
        outs = []
        for step in range(3):
            named = _cuda_bucket(10 * step + rank)
            state.exchange(named, out=[g for _, g in named])
            outs.append(torch.cat([g.reshape(-1) for _, g in named]).cpu())
        return outs

    a, b = run_threads(2, rank_run)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_bucket_draws_by_counter_on_cuda_equal_cpu():
    """Counter-based draws depend on index and seed alone: CUDA's equal the CPU's bit for bit (the eager
    path converts in place, each element read and written at its own address)."""
    from gradzip import kernels
    for n, seed in ((1, 0), (1000, 7), (3_000_001, 123456789)):
        cpu = kernels.counter_uniforms(torch.empty(n), torch.tensor(seed, dtype=torch.int32))
        cuda = kernels.counter_uniforms(torch.empty(n, device="cuda"),
                                        torch.tensor(seed, dtype=torch.int32, device="cuda"))
        assert torch.equal(cuda.cpu(), cpu), n


@pytest.mark.parametrize("name, params", [c for c in _bucketed_cases()],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_bucket_route_on_cuda_equals_on_cpu(name, params):
    """The bucket route on CUDA and on CPU from the same state: random draws are by counter, so even the
    random methods agree, up to float-sum order (a stochastic rounding that a last-bit difference flips
    may differ: at most 0.1% of the elements).  Sketch's medians of shared buckets tie exactly at the
    k-th largest in most steps, and ``topk`` breaks such ties its own way on each device (the same on
    every rank of one): there, an element that differs is a pick on one device only (0 on the other),
    and every tensor has as many picks on both."""
    from gradzip.compressors import make
    from gradzip.state import GradzipState

    from ..test_buckets import _same_starting_state
    if not make(name).bucketed:
        pytest.skip("per-tensor route")
    on_cpu = GradzipState(name, bucketed=True, **params)
    on_cuda = GradzipState(name, bucketed=True, **params)
    _same_starting_state((on_cpu, on_cuda), torch.float32)
    _state_to_cuda(on_cuda)
    for step in range(3):
        named = _cuda_bucket(step)
        want = on_cpu.exchange([(k, g.cpu()) for k, g in named])
        got = on_cuda.exchange(named, out=[g for _, g in named])
        for g, w in zip(got, want):
            close = torch.isclose(g.cpu(), w, rtol=1e-4, atol=1e-4, equal_nan=True)
            differ = int((~close).sum())
            if name == "sketch":
                swapped = (g.cpu()[~close] == 0) ^ (w[~close] == 0)
                assert bool(swapped.all()) and int(g.count_nonzero()) == int(w.count_nonzero()), \
                    f"sketch step {step}: {differ} of {close.numel()} differ, not only by tied picks"
            else:
                assert differ <= 0.001 * close.numel(), f"{name} step {step}: {differ} of {close.numel()} differ"


def _ahead_cases():
    from ..test_ahead_kernels import CASES, IDS
    return [pytest.param(*case, id=case_id) for case, case_id in zip(CASES, IDS)]


@pytest.fixture
def kernels_fresh(monkeypatch):
    """As tests/test_ahead_kernels.py's own fixture: no failure left by an earlier test, and nothing of
    this test's still compiling into the next."""
    from gradzip import kernels
    monkeypatch.setattr(kernels, "_failure", None)
    for kernel in kernels.KERNELS:
        monkeypatch.setattr(kernel, "failed_ahead", None)
    yield
    kernels.settle()


@pytest.mark.parametrize("method, params, names", _ahead_cases())
def test_bucket_kernels_compiled_ahead_on_cuda(method, params, names, monkeypatch, kernels_fresh):
    """On CUDA the bucket route's kernels compiled ahead (Triton, eager numerics) give the reference
    paths' aggregates and state bit for bit, and an exchange that runs them never waits for the device."""
    from gradzip.state import GradzipState

    from ..test_ahead_kernels import bucket, compare_with_reference
    compare_with_reference(method, params, names, monkeypatch, device="cuda")
    state = GradzipState(method, bucketed=True, **params)
    for step in range(2):  # a residual's kernel from the second step on
        state.exchange(bucket(step, "cuda"))
    named = bucket(2, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.exchange(named, out=[g for _, g in named])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_links_timed_by_nccl_on_cuda_tensors(tmp_path):
    """The cost model's link timing (what ``gradzip advise`` runs under torchrun) on a group of NCCL alone,
    which takes CUDA tensors only: on the rank's GPU, each allreduce waited for before it is timed."""
    from gradzip import costmodel

    from ..workers import one_rank_group
    device = torch.device("cuda", 0)
    with one_rank_group("nccl", tmp_path, device_id=device):
        points = costmodel.time_allreduces(sizes=(1 << 10, 1 << 22), repeats=2, device=device)
    assert [(w, b) for w, b, _ in points] == [(1, 1 << 10), (1, 1 << 22)]
    assert all(seconds > 0 for _, _, seconds in points)


def test_state_loaded_on_cpu_keeps_autos_measurements_on_the_host():
    """auto's own per-tensor state (its measurements and schedule, read by the host every step) stays in
    host memory when a state loaded onto the CPU follows its gradients to the GPU; its candidate's
    error feedback goes with them."""
    params = {"candidates": "topk:ratio=0.01", "warmup": 0, "trials": 1, "verify": 0}
    _, resumed = _resumed_from_cpu("auto", params, steps=4)
    for step in range(4, 7):
        named = _cuda_bucket(step)
        resumed.exchange(named, out=[g for _, g in named])
        assert all(torch.isfinite(g).all() for _, g in named)
    where = {(name, v.device.type) for slot in resumed.tensors.values() for name, v in slot.items()
             if isinstance(v, torch.Tensor)}
    assert where and all((t == "cpu") == name.startswith("auto_") for name, t in where), where


def test_auto_agrees_through_a_group_of_nccl_alone(tmp_path):
    """auto's agreements (its measurements: host memory) go through the collective on the gradients' GPU:
    a group of NCCL alone takes no CPU tensor.  One rank, its transport the process group's own."""
    from gradzip.collectives import ProcessGroupTransport
    from gradzip.state import GradzipState

    from ..workers import one_rank_group
    with one_rank_group("nccl", tmp_path, device_id=torch.device("cuda", 0)):
        state = GradzipState("auto", transport=ProcessGroupTransport(), candidates="topk:ratio=0.01;qsgd",
                             warmup=0, trials=1, verify=1)
        for step in range(12):  # explore, agree, decide, verify
            named = _cuda_bucket(step)
            state.exchange(named, out=[g for _, g in named])
            assert all(torch.isfinite(g).all() for _, g in named)
        assert state.stats()["exchanges"] > 0 and all(state.compressor.describe(state.tensors)["choices"].values())
        state.close()


# -- streams: what gradzip's stream writes or reads, ordered against the caller's ----------------------

#: About 0.1 s of one GPU's time (``torch.cuda._sleep`` counts clock cycles): long beside the host's work.
_SLEEP_CYCLES = 200_000_000


@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
def test_overlapped_diloco_merges_the_outer_step_it_waited_for(inline):
    """Under ``overlap`` the outer step writes theta_g on gradzip's stream; the merge copies it into the
    replica on the caller's.  Held back on the GPU just before its writes, the outer step still comes
    before the merge: the future the merge waits on carries the tensors written, so the caller's stream
    waits for them (a bool would carry no device to wait for).  ``inline``: issued from ``step()``, as
    on NCCL, rather than from gradzip's thread."""
    import gradzip

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = gradzip.DiLoCo(model, inner, sync_every=2, overlap=True, outer_momentum=0.0)
    diloco.state.issues_inline = inline

    class HeldBack(dict):
        def __getitem__(self, name):  # the outer step's writes, on gradzip's stream, wait on the GPU
            if torch.cuda.current_stream() != torch.cuda.default_stream():
                torch.cuda._sleep(_SLEEP_CYCLES)
            return super().__getitem__(name)

    diloco.theta = HeldBack(diloco.theta)
    before = {n: t.clone() for n, t in diloco.theta.items()}
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):  # the second step starts the exchange, the third merges it
        inner.zero_grad()
        model(x).square().mean().backward()
        inner.step()
        diloco.step()
    torch.cuda.synchronize()
    for name, p in model.named_parameters():
        assert not torch.equal(dict.__getitem__(diloco.theta, name), before[name]), name  # the outer step moved it
        assert torch.equal(p, dict.__getitem__(diloco.theta, name)), f"{name}: merged a theta_g it did not wait for"
    diloco.close()


@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
def test_overlapped_diloco_reads_its_pseudo_gradients_before_their_memory_is_reused(inline):
    """The pseudo-gradients of an overlapped exchange are made on the caller's stream and read on
    gradzip's.  With gradzip's stream held back on the GPU before the exchange reads them, the inner
    step made meanwhile (its allocations on the caller's stream) does not get their memory: theta_g is
    the same, bit for bit, as without the hold."""
    import gradzip

    def run(held: bool) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = gradzip.DiLoCo(model, inner, sync_every=2, overlap=True, outer_momentum=0.0)
        diloco.state.issues_inline = inline
        exchange = diloco.state.exchange

        def held_back(named, out=None):  # on gradzip's stream, before anything reads the inputs
            if held:
                torch.cuda._sleep(_SLEEP_CYCLES)
            return exchange(named, out)

        diloco.state.exchange = held_back
        x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        for _ in range(3):  # the second step starts the exchange, the third (allocating meanwhile) merges it
            inner.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            inner.step()
            diloco.step()
        torch.cuda.synchronize()
        theta = {n: t.clone() for n, t in diloco.theta.items()}
        diloco.close()
        return theta

    plain, held = run(False), run(True)
    assert all(torch.equal(plain[n], held[n]) for n in plain), "an exchange read memory reused meanwhile"


def test_a_state_loaded_on_the_callers_stream_is_read_before_its_memory_is_reused(monkeypatch):
    """A CUDA state loaded in the caller's thread (on its stream) is copied into the bucket's flat state
    on gradzip's stream, and let go of at once on the host.  With gradzip's stream held back on the GPU
    just before that copy, fresh tensors the caller makes meanwhile do not get the loaded tensors'
    memory (the caching allocator waits for gradzip's stream to have read it), and the exchange
    continues bit for bit."""
    import threading

    from gradzip import buckets
    from gradzip.state import GradzipState

    params = {"ratio": 0.3, "bucketed": True}
    going = GradzipState("topk", **params)
    for step in range(2):
        named = _cuda_bucket(step)
        going.exchange(named, out=[g for _, g in named])
    resumed = GradzipState("topk", **params)
    resumed.load_state_dict(going.state_dict())  # clones, on the caller's stream
    loaded = [t for slot in resumed.tensors.values() for t in slot.values() if isinstance(t, torch.Tensor) and t.numel()]
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in loaded]
    sizes = [t.shape for t in loaded]
    del loaded
    original, copied = buckets._Bucket.load, threading.Event()

    def held_back(self, tensors, shapes):
        if torch.cuda.current_stream() != torch.cuda.default_stream():  # gradzip's stream
            torch.cuda._sleep(_SLEEP_CYCLES)
        result = original(self, tensors, shapes)
        copied.set()  # on the host: the loaded tensors are let go of; on the GPU, not yet read
        return result

    monkeypatch.setattr(buckets._Bucket, "load", held_back)
    named, again = _cuda_bucket(2), _cuda_bucket(2)
    fut = resumed.submit(again, lambda out: out, out=[g for _, g in again])
    assert copied.wait(30)
    scribbled = [torch.full(s, 1e6, device="cuda") for s in sizes for _ in range(4)]
    reused = [(t.data_ptr(), lo) for t in scribbled for lo, hi in spans if lo <= t.data_ptr() < hi]
    fut.wait()
    going.exchange(named, out=[g for _, g in named])
    torch.cuda.synchronize()
    assert not reused, "the caller's fresh tensors took memory gradzip's stream had not read yet"
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, again))
    resumed.close()

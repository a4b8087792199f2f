"""Fused kernels on the bucket route, compiled ahead (:meth:`gradzip.kernels.Kernel.ahead`, :mod:`gradzip.ahead`).

A bucket's first exchange for a kernel's form queues the loading of its package (compiled in a child
process where the machine's cache has none) and takes the reference path; later exchanges run it.  The
kernel and the reference path agree bit for bit (aggregates and error-feedback state; up to the order of
float sums for a kernel that scatters), so it does not matter at which step each rank switches; no compile runs in the process; a dispatch mode of the
caller's gets the reference path; a failing compile warns once and leaves the reference path for good.  Every bucket
size takes them (``Kernel.ahead_numel``, one element); a test raises it to get a reference path.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradzip.state  # noqa: F401 - registers the methods
from gradzip import ahead, devices, kernels
from gradzip.state import GradzipState
from gradzip.testing import MemoryCounter, OpCounter, launching_ops

from .workers import run_threads

quantize = sys.modules["gradzip.compressors.quantize"]

#: (method, parameters, the kernels its bucket route takes ahead: encoding, decoding, error feedback's residual)
CASES = [
    ("qsgd", {"feedback": "residual"}, ("_qsgd_bucket_encode", "_bucket_residual", "_bucket_decoded")),
    ("terngrad", {"feedback": "residual"}, ("_terngrad_bucket_encode", "_bucket_residual", "_codes_summed",
                                            "_segments_scaled")),
    ("terngrad", {"clip": None}, ("_terngrad_bucket_encode",)),
    ("natural", {"feedback": "residual"}, ("_natural_encode", "_natural_bucket_residual")),
    ("efsignsgd", {}, ("_bucket_sign_bits", "_ef_bucket_residual", "_ef_decoded")),
    ("signsgd", {}, ("_bucket_trits", "_bucket_trit_vote")),
    ("signum", {"zeros": "plus"}, ("_bucket_sign_bits",)),
    ("onebit", {}, ("_bucket_sign_bits", "_onebit_decoded")),
    ("sketch", {"ratio": 0.05, "rows": 3, "width": 2.0}, ("_sketch_bucket", "_sketch_magnitude")),
    ("fp16", {"feedback": "residual"}, ("_half_share", "_half_residual")),
    ("bf16", {"feedback": "residual"}, ("_half_share", "_half_residual")),
    ("dgc", {"min_numel": 0, "ratio": 0.1, "warmup_epochs": 0}, ("_counter_uniforms", "_sample_keys", "_dgc_thresholds",
                                                                      "_dgc_selected", "_dgc_piece_counts")),
    ("randomk", {"ratio": 0.3}, ("_counter_hashes",)),
    ("dropping", {"drop_ratio": 0.9, "sample_ratio": 0.1}, ("_counter_uniforms", "_sample_keys", "_dropping_mask")),
]
QUANTISERS = ("qsgd", "terngrad", "natural")
IDS = [f"{m}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for m, p, _ in CASES]
#: The cases the default run checks bit for bit (a compile is some 15-30 s a kernel on 2 cores): the
#: quantisers with feedback, whose encodings, residuals and decodings the launch count below compiles
#: anyway; signs packed to bits and their decoding (EF-signSGD); a counter hash (Random-k); a cast's
#: share (fp16); the sketch, the one kernel that sums in no fixed order.  The others (ternary votes,
#: TernGrad without clipping, DGC's and dropping's sampling and selection, 1-bit's decoding, bf16) run
#: with GRADZIP_SLOW=1, and all of them on a GPU (tests/stacks/test_gpu.py).
REPRESENTATIVE = {"qsgd-feedback=residual", "terngrad-feedback=residual", "natural-feedback=residual", "efsignsgd-",
                  "randomk-ratio=0.3", "fp16-feedback=residual", "sketch-ratio=0.05-rows=3-width=2.0"}


def tiered(cases: list, ids: list) -> list:
    return [pytest.param(*case, id=case_id, marks=() if case_id in REPRESENTATIVE else pytest.mark.slow)
            for case, case_id in zip(cases, ids)]


#: Odd shapes together: an empty tensor, one element, a QSGD chunk cut short, a non-power-of-two count.
SHAPES = [(64, 33), (33,), (0, 3), (1,), (100, 7), (5,)]


def kernel_named(name: str) -> kernels.Kernel:
    (kernel,) = [k for k in kernels.KERNELS if k.__name__ == name]
    return kernel


def bucket(seed: int, device="cpu") -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.randn(s, generator=gen).to(device)) for i, s in enumerate(SHAPES)]


def exchanges(method: str, params: dict, steps: int, device="cpu", world: int = 1):
    """The flat aggregates of ``steps`` exchanges from a fresh bucketed state, and the state; with
    ``world`` > 1, of that many ranks as threads (each its own buckets), every rank's aggregates in
    turn and rank 0's state."""
    def run(rank, transport=None):
        state = GradzipState(method, bucketed=True, **params, **({"transport": transport} if transport else {}))
        outs = []
        for step in range(steps):
            named = bucket(step * world + rank, device)
            outs.append(torch.cat([g.reshape(-1) for g in state.exchange(named, out=[g for _, g in named])]))
        return outs, state
    if world == 1:
        return run(0)
    ranks = run_threads(world, run)
    return [out for outs, _ in ranks for out in outs], ranks[0][1]


def state_tensors(state) -> dict:
    return {(key, name): t for key, slot in state.tensors.items() for name, t in slot.items()
            if isinstance(t, torch.Tensor)}


def ran_ahead(kernel, monkeypatch) -> list:
    """Whether each later call of ``kernel.ahead`` ran the kernel (True) or gave the reference path."""
    ran, original = [], kernel.ahead

    def spied(*args, **static):
        result = original(*args, **static)
        ran.append(result is not None)
        return result
    monkeypatch.setattr(kernel, "ahead", spied)
    return ran


def settle_without_compiling_here(timeout: float = 900) -> None:
    """Wait for the queued loads and compiles, checking meanwhile that this process never compiles
    (``torch.compiler.is_compiling()`` stays false in it, which PyTorch's optimizers and DDP branch on)."""
    deadline = time.monotonic() + timeout
    while not kernels.settle(timeout=0.01):
        assert not torch.compiler.is_compiling(), "a kernel compiled in the process that asked for it"
        assert time.monotonic() < deadline, f"the compiles took more than {timeout} s"


def compare_with_reference(method, params, names, monkeypatch, device="cpu", steps=3, world=1):
    """The reference paths' aggregates and state, then those with the kernels ``names`` compiled ahead:
    bit for bit, every kernel having run at every call from the second step on (a residual's first);
    ``world`` ranks as threads."""
    fused = [kernel_named(name) for name in names]
    for kernel in fused:
        monkeypatch.setattr(kernel, "_ahead", {})  # what this process loaded before: not from this session's cache
        monkeypatch.setattr(kernel, "ahead_numel", 1 << 40)
    want, reference = exchanges(method, params, steps, device, world)
    for kernel in fused:
        monkeypatch.setattr(kernel, "ahead_numel", 1)
    exchanges(method, params, 2, device, world)  # queues the compiles (a residual's from the second step on)
    settle_without_compiling_here()
    if world > 1:  # a decoding kernel's form that adds (ranks after the first) is asked for once the first's runs
        exchanges(method, params, 2, device, world)
        settle_without_compiling_here()
    ran = {kernel.__name__: ran_ahead(kernel, monkeypatch) for kernel in fused}
    got, fused_state = exchanges(method, params, steps, device, world)
    assert all(len(r) >= steps - 1 and all(r) for r in ran.values()), f"{method}: the kernels ran at calls {ran}"
    # a kernel that sums in no fixed order (a scatter's atomic adds) agrees up to that order: here, where
    # no two estimates of the sketch lie that close, the same selection and values to float tolerance
    same = torch.equal if all(kernel.ordered for kernel in fused) else close
    for step, (g, w) in enumerate(zip(got, want)):
        assert same(g, w), f"{method}: aggregates differ at step {step}"
    a, b = state_tensors(fused_state), state_tensors(reference)
    assert a.keys() == b.keys()
    for key in a:
        assert same(a[key], b[key]), f"{method}: state {key} differs"


def close(a, b) -> bool:
    return torch.equal(a != 0, b != 0) and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def no_failure(monkeypatch):
    """No failure before; and a GPU's form on this CPU: kernels compiled ahead run (their runner holds
    Python's lock, which a CPU's training thread would feel)."""
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(devices, "runs_kernels_ahead", lambda where: True)
    for kernel in kernels.KERNELS:
        monkeypatch.setattr(kernel, "failed_ahead", None)
    yield
    kernels.settle()  # nothing of a test's keeps compiling into the next


@pytest.mark.parametrize("method, params, names", tiered(CASES, IDS))
def test_kernels_compiled_ahead_agree_with_reference_bit_for_bit(method, params, names, monkeypatch):
    compare_with_reference(method, params, names, monkeypatch)


def test_kernel_arguments_start_aligned(monkeypatch):
    """Every tensor a kernel compiled ahead is given starts 16-byte aligned, as a GPU package assumes of
    what it was compiled with (else it copies the argument at every call), the sketch's seed rows
    apart (made at every exchange, one view per hash row); at world size 2 too, where the other rank's
    fields are views of the gathered bytes. Counted without compiling: the calls are spied on and no
    package is asked for."""
    unaligned = []
    monkeypatch.setattr(ahead, "submit", lambda job: None)  # nothing compiles: every call its reference path
    for kernel in kernels.KERNELS:
        original = kernel.ahead

        def spied(*args, _kernel=kernel, _original=original, **static):
            unaligned.extend((_kernel.__name__, i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                             and a.numel() and a.storage_offset() * a.element_size() % 16)
            return _original(*args, **static)
        monkeypatch.setattr(kernel, "_ahead", {})
        monkeypatch.setattr(kernel, "ahead", spied)
    for method, params, _ in CASES:
        exchanges(method, params, 2)
        exchanges(method, params, 2, world=2)  # the other rank's fields: views of the gathered bytes
    assert unaligned and all(name.startswith("_sketch") for name, _ in unaligned), sorted(set(unaligned))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("method, names", [("qsgd", ("_bucket_decoded",)),
                                           pytest.param("terngrad", ("_codes_summed", "_segments_scaled"), marks=SLOW),
                                           pytest.param("onebit", ("_onebit_decoded",), marks=SLOW),
                                           pytest.param("signsgd", ("_bucket_trit_vote",), marks=SLOW),
                                           ("efsignsgd", ("_ef_decoded",))])
def test_decoding_kernels_sum_two_ranks_in_rank_order(method, names, monkeypatch):
    """Two ranks (threads), each rank's payload decoded by one kernel (the first written, the next added
    to it): the reference path's bits on every rank."""
    compare_with_reference(method, {}, names, monkeypatch, world=2)


@pytest.mark.parametrize("shapes", [[(1000, 3)], [(77,), (4097,), (0,), (511,)], [(8, 8)] * 9],
                         ids=["one-tensor", "odd-sizes", "equal-tensors"])
def test_one_package_serves_every_size(shapes, monkeypatch):
    """Buckets of other sizes and tensor counts (one tensor; a size of every residue; many equal ones)
    of QSGD's form take the package already compiled, with the reference path's bits."""
    names = ("_qsgd_bucket_encode", "_bucket_residual")
    compare_with_reference("qsgd", {"feedback": "residual"}, names, monkeypatch)  # compiled (or loaded) here

    def compiled_again(spec):
        raise RuntimeError("compiled again")
    monkeypatch.setattr(ahead, "spawn", compiled_again)
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", shapes)
    compare_with_reference("qsgd", {"feedback": "residual"}, names, monkeypatch)
    assert all(kernel_named(name).failed_ahead is None for name in names)


@pytest.mark.parametrize("absolute", [False, True])
def test_sample_keys_order_slots_as_the_two_sorts(absolute, monkeypatch):
    """DGC's and gradient dropping's sample sorted by one sort of :func:`_sample_keys`' keys (its eager
    code here: the package equals it, as the DGC and dropping cases above check with GRADZIP_SLOW=1) gives the reference path's two stable
    sorts' values bit for bit, where values tie (within a tensor and across tensors), are NaN (of
    three payloads, one negative), +-0.0, +-inf, or fall past their tensor (-1)."""
    from gradzip.buckets import BucketLayout
    sparse = sys.modules["gradzip.compressors.sparse"]
    monkeypatch.setenv("GRADZIP_FUSED", "0")  # the reference path's sorts
    shapes = [(50,), (7,), (0,), (33,), (1,), (12,)]
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, torch.float32, torch.device("cpu"))
    plan = sparse._SamplePlan(layout, 3, [True] * len(shapes))
    gen = torch.Generator().manual_seed(0)
    odd = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1.5, -1.5, 1.5, 2.0, -2.0])
    nans = torch.tensor([0x7FC00000, 0x7FC00001, -0x00400000], dtype=torch.int32).view(torch.float32)
    pool = torch.cat([odd, nans])
    for trial in range(20):
        p = pool[torch.randint(len(pool), (layout.numel,), generator=gen)]
        x = p.abs() if absolute else p
        uniforms = torch.rand(len(shapes), generator=gen)
        want, want_short = plan.sorted(x, uniforms.clone(), absolute)
        keys, values, short = sparse._sample_keys.fn(x, uniforms, plan.span, plan.span_max, plan.slot_base,
                                                     plan.slot_tensor, plan.slot_last, plan.last_slot,
                                                     absolute=absolute)
        got = values.index_select(0, keys.sort(stable=True).indices)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), trial  # NaN payloads, signs of 0
        assert torch.equal(short, want_short)


def test_dgc_counts_tensors_of_several_pieces(monkeypatch):
    """DGC's counts per piece of 2^14 elements (:func:`_dgc_piece_counts`) add up per tensor as the
    reference path's: tensors of several pieces, one a piece and an element long, one of exactly one.
    DGC's other kernels take their reference paths here (no compile of theirs for these shapes)."""
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", [(40000,), (3,), (128, 128), (16385,), (0,)])
    for kernel in kernels.KERNELS:
        if kernel.__name__ != "_dgc_piece_counts":
            monkeypatch.setattr(kernel, "ahead_numel", 1 << 40)
    params = next(case[1] for case in CASES if case[0] == "dgc")
    compare_with_reference("dgc", params, ("_dgc_piece_counts",), monkeypatch)


def test_the_compile_runs_in_a_child_while_exchanges_go_on(monkeypatch, tmp_path, kernel_cache):
    """With no package in the cache, exchanges take the reference path while the child compiles (held
    here until they are done), on gradzip's thread, the process never compiling, and the package serves
    the exchanges after.  Where the session's cache has the package already (a bit-for-bit test of
    QSGD compiled it, checking meanwhile that its process never compiles), that package stands in for
    the child's work; alone, this test compiles it."""
    monkeypatch.setenv("GRADZIP_KERNEL_CACHE", str(tmp_path))
    kernel = quantize._qsgd_bucket_encode
    monkeypatch.setattr(kernel, "ahead_numel", 1)
    monkeypatch.setattr(kernel, "_ahead", {})
    release, spawned = threading.Event(), []
    spawn = ahead.spawn

    def held(spec):
        spawned.append(threading.current_thread().name)
        assert release.wait(60)
        path = spec["path"]
        compiled = os.path.join(kernel_cache, os.path.basename(path))  # the same name: kernel, form, sources
        if os.path.exists(compiled + ".json") and os.path.exists(compiled):
            shutil.copyfile(compiled + ".json", path + ".json")
            shutil.copyfile(compiled, path)
        else:
            spawn(spec)
    monkeypatch.setattr(ahead, "spawn", held)
    ran = ran_ahead(kernel, monkeypatch)
    try:
        got, _ = exchanges("qsgd", {}, 2)
    finally:
        release.set()
    settle_without_compiling_here()  # until the child's package is loaded
    assert ran == [False, False] and spawned and set(spawned) == {"gradzip-ahead"}
    again, _ = exchanges("qsgd", {}, 2)
    assert ran[2:] == [True, True]
    monkeypatch.setattr(kernel, "ahead_numel", 1 << 40)
    want, _ = exchanges("qsgd", {}, 2)
    assert all(torch.equal(g, w) for g, w in zip(got + again, want + want))


def test_a_package_in_the_cache_is_loaded_not_compiled(monkeypatch):
    """Compiled once per machine: a process that finds the package (here, a kernel that forgot what it
    loaded) loads it without a child."""
    kernel = quantize._natural_encode
    monkeypatch.setattr(kernel, "ahead_numel", 1)
    monkeypatch.setattr(kernel, "_ahead", {})
    exchanges("natural", {}, 1)  # loaded from the session's cache, or compiled into it
    kernels.settle()
    monkeypatch.setattr(kernel, "_ahead", {})

    def compiled_again(spec):
        raise RuntimeError("compiled again")
    monkeypatch.setattr(ahead, "spawn", compiled_again)
    ran = ran_ahead(kernel, monkeypatch)
    exchanges("natural", {}, 1)
    kernels.settle()
    exchanges("natural", {}, 1)
    assert ran == [False, True] and kernel.failed_ahead is None


def test_ranks_on_one_machine_compile_once(monkeypatch, tmp_path):
    """While another process holds a package's lock (it compiles), a job waits, then loads that process's
    package instead of compiling it again; a lock whose holder died is free at once (the system releases
    it), and the next job compiles."""
    path = str(tmp_path / "k.pt2")
    spawned = []

    def compiled(spec):
        spawned.append(spec)
        _write_package(path)
    monkeypatch.setattr(ahead, "spawn", compiled)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, path + ".lock"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    waiter = threading.Thread(target=ahead._compile, args=(path, {}))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not spawned
    _write_package(path)  # the other process's package
    holder.stdin = None
    holder.kill()  # its lock goes with it
    waiter.join(10)
    assert not waiter.is_alive() and not spawned
    os.remove(path)
    os.remove(path + ".json")
    ahead._compile(path, {})
    assert len(spawned) == 1 and ahead._meta(path) is not None


#: Takes the lock at argv[1] as a compiling rank does, says so, and holds it until killed.
_HOLD_LOCK = ("import fcntl, sys, time\n"
              "f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
              "print('locked', flush=True); time.sleep(600)\n")


def _write_package(path: str) -> None:
    with open(path + ".json", "w") as meta:
        json.dump({"mins": []}, meta)
    open(path, "w").close()


def test_a_half_written_sidecar_is_no_package(tmp_path):
    """A compile killed mid-write leaves no package that a later run would take as whole."""
    path = str(tmp_path / "k.pt2")
    open(path, "w").close()
    with open(path + ".json", "w") as meta:
        meta.write('{"mins": [[')
    assert ahead._meta(path) is None
    _write_package(path)
    assert ahead._meta(path) == {"mins": []}


#: Where the stand-ins for a compile live (the children import them as they import gradzip: from this
#: process's import path; the scripts below, from the repository's root).
TARGETS = "tests.compile_targets"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _said(path: str, timeout: float = 60) -> list:
    """What a stand-in wrote to ``path``, once it has."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"nothing at {path} after {timeout} s"
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)


def _left(tmp) -> list:
    """What is left in a temporary directory, but for Inductor's cache (kept there on purpose)."""
    return [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]


def test_a_process_that_exits_mid_compile_stops_its_child(tmp_path):
    """A user's script that ends while its kernel compiles: the child is stopped (and the lock, released
    with the process, is free for the next run), no failure is recorded for it, and nothing it unpacked
    is left in the temporary directory, nor the package it was writing in the cache."""
    path, said, tmp = str(tmp_path / "k.pt2"), str(tmp_path / "said"), tmp_path / "tmp"
    tmp.mkdir()
    script = (
        "import os, sys, threading, time\n"
        "from gradzip import ahead\n"
        "spawn = ahead.spawn\n"
        f"ahead.spawn = lambda spec: spawn({{'said': {said!r}, 'path': sys.argv[1]}}, '{TARGETS}:unpacking')\n"
        "threading.Thread(target=ahead._compile, args=(sys.argv[1], {}), daemon=True).start()\n"
        f"while not os.path.exists({said!r}): time.sleep(0.01)\n"
        "print(next(iter(ahead._CHILDREN)).pid, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script, path], timeout=60, capture_output=True, text=True,
                          env=dict(os.environ, TMPDIR=str(tmp)), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.strip())
    pid, unpacked = _said(said)
    time.sleep(0.2)
    assert pid == child and not _alive(child) and not os.path.exists(path + ".failed")
    assert unpacked.startswith(str(tmp)) and _left(tmp) == []
    assert sorted(os.listdir(tmp_path)) == ["k.pt2.lock", "said", "tmp"]
    with open(path + ".lock", "a") as lock:
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: raises if still held


def test_a_killed_process_leaves_no_compiling_child_nor_its_files(tmp_path):
    """A process killed (no atexit runs) while a kernel compiles: the child notices, removes the compile's
    scratch directory with what it unpacked there and the package it was writing, and ends."""
    said, tmp, cache = str(tmp_path / "said"), tmp_path / "tmp", tmp_path / "cache"
    tmp.mkdir()
    cache.mkdir()
    spec = {"said": said, "path": str(cache / "k.pt2")}
    script = (
        "import json, os, signal, sys, threading, time\n"
        "from gradzip import ahead\n"
        f"threading.Thread(target=ahead.spawn, args=({spec!r}, '{TARGETS}:unpacking'), daemon=True).start()\n"
        f"while not os.path.exists({said!r}): time.sleep(0.01)\n"
        f"print(json.dumps([os.path.exists(json.load(open({said!r}))[1]), os.listdir({str(cache)!r})]), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True,
                          env=dict(os.environ, TMPDIR=str(tmp)), cwd=ROOT)
    assert done.returncode == -signal.SIGKILL, done.stderr
    child, unpacked = _said(said)
    existed, written = json.loads(done.stdout)  # as the parent was killed: or the checks below could not fail
    assert unpacked.startswith(str(tmp)) and existed
    assert len(written) == 2  # the package and its sidecar, under the compile's own name
    deadline = time.monotonic() + 30
    while (_alive(child) or _left(tmp) or os.listdir(cache)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child) and _left(tmp) == [] and os.listdir(cache) == []


def test_a_compile_first_removes_what_this_hosts_dead_compiles_of_its_package_left(monkeypatch, tmp_path):
    """A process killed with its compiling child leaves the package that child was writing: the next
    compile of that package on the host removes it (under the package's lock; without one, it cannot
    tell a dead compile from another process's), not another host's."""
    path, host = str(tmp_path / "k.pt2"), socket.gethostname()
    left = [f"k.{host}.4242.pt2", f"k.{host}.gradzip-compile-x1.pt2", f"k.{host}.gradzip-compile-x1.json"]
    kept = ["k.elsewhere.4242.pt2", f"k.{host}.cluster.gradzip-compile-x2.pt2", "other.pt2", f"other.{host}.1.pt2"]
    for name in left + kept:
        (tmp_path / name).write_text("half")
    compiled = []
    monkeypatch.setattr(ahead, "spawn", lambda spec: compiled.append(sorted(os.listdir(tmp_path))))
    with monkeypatch.context() as m:
        m.setattr(ahead, "_lock", lambda file: False)  # no POSIX locks: another may be compiling it
        ahead._compile(path, {"path": path})
    ahead._compile(path, {"path": path})
    assert compiled == [sorted(left + kept + ["k.pt2.lock"]), sorted(kept + ["k.pt2.lock"])]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def keeps_child(monkeypatch):
    """This thread keeps its compiling child between compiles, as gradzip's background threads do; ended
    after the test."""
    monkeypatch.setattr(ahead._THREAD, "keeps_child", True, raising=False)
    yield
    ahead._close_child()


def test_a_child_serves_its_threads_later_compiles_each_in_its_own_scratch(monkeypatch, tmp_path, keeps_child):
    """A thread's next compiles run in the same child (the environment's changes as a process runs, such
    as pytest's name of the test, and Ctrl-C, which is the parent's to act on, notwithstanding), each
    in a scratch directory of its own, gone once it ends, and after it the temporary directory the
    child had before (not the last compile's scratch), as the environment and Python's ``tempfile`` see it."""
    said = [str(tmp_path / f"said{i}") for i in range(3)]
    for path in said[:2]:
        ahead.spawn({"said": path, "scratch": True}, f"{TARGETS}:where")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    os.kill(ahead._THREAD.child.pid, signal.SIGINT)
    ahead.spawn({"said": said[2]}, f"{TARGETS}:where")
    (pid, *scratch), (again, *other), (still, *after) = [_said(path) for path in said]
    assert pid == again == still == ahead._THREAD.child.pid and ahead._CHILDREN[ahead._THREAD.child] is None
    assert scratch[0] == scratch[1] != other[0] == other[1]  # TMPDIR and tempfile's, each compile its own
    assert all(os.path.basename(d).startswith("gradzip-compile-") and not os.path.exists(d) for d in scratch + other)
    assert after == [os.environ.get("TMPDIR"), tempfile.gettempdir()]


def test_a_failed_compile_or_a_changed_environment_gets_a_fresh_child(monkeypatch, tmp_path, keeps_child):
    """A compile that raises is reported with its exception line and ends its child (it is not tried again
    where the child was fresh; where the child had served other compiles it is, once, in a fresh
    child: what those left behind must not mark a kernel failed); a change of the environment or the
    working directory, which a child keeps from its start (the cache a package's name is made in,
    where a relative one lies), starts another; and a child killed between compiles is replaced (the
    dead one's pipes closed)."""
    log = str(tmp_path / "log")
    reason = r"\(raised in its child\): ValueError: the compile's own failure$"
    with pytest.raises(ahead.CompileFailed, match=reason) as failed:
        ahead.spawn({"log": log, "raises": True}, f"{TARGETS}:logged")
    assert "Traceback" in failed.value.output and ahead._THREAD.child is None
    ahead.spawn({"log": log}, f"{TARGETS}:logged")
    path, real = str(tmp_path / "k.pt2"), ahead.spawn
    with pytest.MonkeyPatch.context() as patch:
        failing_if_run_before = {"log": log, "raises_if_run_before": True}
        patch.setattr(ahead, "spawn", lambda spec: real(failing_if_run_before, f"{TARGETS}:logged"))
        ahead._compile(path, {})  # raises in the used child, then not in a fresh one: nothing recorded
    assert not os.path.exists(path + ".failed")
    monkeypatch.setenv("GRADZIP_KERNEL_CACHE", str(tmp_path))
    ahead.spawn({"log": log}, f"{TARGETS}:logged")
    monkeypatch.chdir(tmp_path)
    ahead.spawn({"log": log}, f"{TARGETS}:logged")
    killed = ahead._THREAD.child
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    ahead.spawn({"log": log}, f"{TARGETS}:logged")
    with open(log) as f:
        pids = [int(line) for line in f]
    assert len(pids) == 7 and pids[1] == pids[2] and len(set(pids)) == 6, pids
    assert killed.stdout.closed and killed.stdin.closed
    assert not any(_alive(pid) for pid in pids[:-1])
    listed = [c.pid for c in ahead._CHILDREN]
    assert listed.count(pids[-1]) == 1 and not set(listed) & set(pids[:-1])


def test_another_threads_compile_ends_its_child(tmp_path):
    """Only gradzip's background threads keep a child between compiles: a compile on another thread (a
    test's, a script's) ends its child with it."""
    said = str(tmp_path / "said")
    ahead.spawn({"said": said}, f"{TARGETS}:where")
    pid = _said(said)[0]
    assert getattr(ahead._THREAD, "child", None) is None and not _alive(pid)
    assert pid not in {c.pid for c in ahead._CHILDREN}


def test_a_background_threads_child_ends_once_idle(monkeypatch, tmp_path):
    """The child a background thread's compile started outlives the compile, and ends once no job has come
    for :data:`gradzip.ahead.CHILD_IDLE_S`; and a process that exits kills its idle children."""
    monkeypatch.setattr(ahead, "CHILD_IDLE_S", 3.0)
    said, children = str(tmp_path / "said"), []

    def compile_and_keep():
        ahead.spawn({"said": said}, f"{TARGETS}:where")
        children.append(ahead._THREAD.child)
    ahead.submit(compile_and_keep)
    kernels.settle()
    (child,) = children
    assert child.pid == _said(said)[0] and child.poll() is None and child in ahead._CHILDREN  # the job is done
    deadline = time.monotonic() + 30
    while child in ahead._CHILDREN and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child not in ahead._CHILDREN and child.wait(timeout=10) == -signal.SIGKILL and not _alive(child.pid)

    script = (  # an exit handler registered first runs last: after gradzip's
        "import atexit\n"
        "children = []\n"
        "atexit.register(lambda: print(*[c.poll() for c in children], flush=True))\n"
        "from gradzip import ahead, kernels\n"
        f"ahead.submit(lambda: ahead.spawn({{}}, '{TARGETS}:nothing'))\n"
        "kernels.settle()\n"
        "children.extend(ahead._CHILDREN)\n")
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(-signal.SIGKILL)]  # one child, killed by the exit handler


def test_a_timed_out_compile_is_stopped_and_recorded(monkeypatch, tmp_path, keeps_child):
    """A child over the time limit is stopped (not left compiling beside the next one), and the reason is
    kept beside the package's name, so no rank or later run compiles it again."""
    ahead.spawn({}, f"{TARGETS}:nothing")  # the child is up: the limit below is the compile's alone
    child = ahead._THREAD.child
    path, log = str(tmp_path / "k.pt2"), str(tmp_path / "log")
    monkeypatch.setattr(ahead, "COMPILE_TIMEOUT_S", 3)
    real = ahead.spawn
    monkeypatch.setattr(ahead, "spawn", lambda spec: real({"log": log}, f"{TARGETS}:sleeping"))
    with pytest.raises(RuntimeError, match="more than 3 s"):
        ahead._compile(path, {})
    with open(log) as f:
        assert f.read().split() == [str(child.pid)]  # that child, and not tried again in another
    assert child.poll() == -signal.SIGKILL and child not in ahead._CHILDREN
    assert "more than 3 s" in open(path + ".failed").read()
    with pytest.raises(RuntimeError, match="delete"):
        ahead._meta(path)

    class Late(threading.Timer):
        """A limit that passes as the reply comes: the compile succeeded, its child is not served again."""
        def cancel(self):
            self.function()
            super().cancel()
    monkeypatch.setattr(ahead.threading, "Timer", Late)
    monkeypatch.setattr(ahead, "COMPILE_TIMEOUT_S", 600)  # a fresh child's start is well within it
    real({}, f"{TARGETS}:nothing")
    assert getattr(ahead._THREAD, "child", None) is None


def test_a_failed_compile_names_its_exception_and_keeps_the_output(monkeypatch, tmp_path):
    """The reason is the child's exception line, not whatever it printed after (a warning's source line
    at shutdown), and the ``.failed`` file keeps the whole output; a child stopped from outside (a job's
    time limit) records nothing, so the next process compiles again.  Neither leaves the package it
    was writing in the cache."""
    path = str(tmp_path / "k.pt2")
    real = ahead.spawn
    monkeypatch.setattr(ahead, "spawn", lambda spec: real(spec, f"{TARGETS}:exits_after_a_traceback"))
    with pytest.raises(RuntimeError, match=r"\(exit status 1\): ValueError: the real reason$"):
        ahead._compile(path, {"path": path})
    assert sorted(os.listdir(tmp_path)) == ["k.pt2.failed", "k.pt2.lock"]
    with open(path + ".failed") as failed:
        reason, output = failed.readline(), failed.read()
    assert "ValueError: the real reason" in reason and "Traceback" in output and "cls.__new__" in output
    with pytest.raises(RuntimeError, match="ValueError: the real reason .*delete it"):
        ahead._meta(path)

    other = str(tmp_path / "stopped.pt2")
    monkeypatch.setattr(ahead, "spawn", lambda spec: real(spec, f"{TARGETS}:terminated"))
    with pytest.raises(RuntimeError, match=r"killed by SIGTERM\): half"):
        ahead._compile(other, {"path": other})
    assert not os.path.exists(other + ".failed") and ahead._meta(other) is None
    assert sorted(os.listdir(tmp_path)) == ["k.pt2.failed", "k.pt2.lock", "stopped.pt2.lock"]


def test_a_callers_dispatch_mode_gets_the_reference_path(monkeypatch):
    """A compiled kernel runs no aten operation a mode could see, so under the caller's own dispatch mode
    the reference path runs (and nothing is switched off); gradzip's counters see the kernel as one
    operation and its result's storage."""
    kernel = quantize._qsgd_bucket_encode
    monkeypatch.setattr(kernel, "ahead_numel", 1)
    exchanges("qsgd", {}, 1)
    kernels.settle()

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    ran = ran_ahead(kernel, monkeypatch)
    state = GradzipState("qsgd", bucketed=True)
    with Seen():
        state.exchange(bucket(0))
    with OpCounter() as counter:
        state.exchange(bucket(1))
    with MemoryCounter() as memory:
        state.exchange(bucket(2))
    assert ran == [False, True, True] and kernels._failure is None
    assert counter.ops["fused:_qsgd_bucket_encode"] == 1
    assert launching_ops({"fused:_qsgd_bucket_encode": 1}) == 1
    n = sum(torch.Size(s).numel() for s in SHAPES)
    assert memory.peak >= 4 * n + -(-n // 4)  # at least the aggregate and the kernel's packed codes


def test_fused_kernels_cut_the_bucket_route_launches(monkeypatch):
    """Counted on CPU: with error feedback, the quantisers' encoding, decoding and residual are an
    operation each once compiled, at least 28 operations fewer per bucket than their reference paths dispatch."""
    for method, params, names in [case for case in CASES if case[0] in QUANTISERS and "feedback" in case[1]]:
        counts = []
        for threshold in (1 << 40, 1):
            for kernel in kernels.KERNELS:  # the counter's draws of the reference path too
                monkeypatch.setattr(kernel, "ahead_numel", threshold)
            exchanges(method, params, 2)
            kernels.settle()
            state = GradzipState(method, bucketed=True, **params)
            state.exchange(bucket(0))
            named = bucket(1)
            with OpCounter() as counter:
                state.exchange(named)
            counts.append(launching_ops(counter.ops))
            assert all(counter.ops[f"fused:{name}"] == (threshold == 1) for name in names), counter.ops
        assert counts[1] <= counts[0] - 28, f"{method}: {counts[0]} launching operations, {counts[1]} fused"


def test_the_sketch_kernels_cut_its_launches(monkeypatch):
    """Counted on CPU: the count sketch's sketching and its estimates' medians are one operation each
    once compiled, whatever the bucket's size (its reference path draws a large bucket in pieces)."""
    method, params, names = next(case for case in CASES if case[0] == "sketch")
    sketch = sys.modules["gradzip.compressors.sketch"]
    counts = []
    for threshold, piece in ((1 << 40, 1 << 16), (1 << 40, 100), (1, 100)):
        monkeypatch.setattr(sketch, "_MIN_PIECE", piece)
        for kernel in map(kernel_named, names):
            monkeypatch.setattr(kernel, "ahead_numel", threshold)
        exchanges(method, params, 1)
        kernels.settle()
        state = GradzipState(method, bucketed=True, **params)
        state.exchange(bucket(0))
        with OpCounter() as counter:
            state.exchange(bucket(1))
        counts.append(launching_ops(counter.ops))
        assert all(counter.ops[f"fused:{name}"] == (threshold == 1) for name in names), counter.ops
    one_piece, pieces, fused = counts
    assert pieces > one_piece and fused <= one_piece - 50, counts


def _unordered(a, b) -> bool:
    return ahead._same(a, b, ordered=False)


def test_an_unordered_kernel_is_checked_at_float_tolerance():
    """A kernel whose sums run in no fixed order passes its package's check where the sums differ in
    their last bits, and fails it where a result is wrong or NaN moved."""
    values = torch.randn(4099, generator=torch.Generator().manual_seed(0))
    forward, backward = values.sum().view(1), values.flip(0).cumsum(0)[-1:]
    assert _unordered(forward, backward)
    assert not _unordered(forward, forward + 0.01)
    assert not _unordered(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0]))
    assert not _unordered(torch.tensor([3], dtype=torch.int64), torch.tensor([4], dtype=torch.int64))
    assert _unordered(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0 + 1e-7]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_an_ordered_kernel_is_checked_bit_for_bit(dtype):
    """A package's check: the same bits (signs of zeros too), NaN where NaN whatever its payload."""
    nan = float("nan")
    a = torch.tensor([1.5, -0.0, nan, 3.0, 0.0], dtype=dtype)
    assert ahead._same(a, a.clone()) and ahead._same(a, torch.tensor([1.5, -0.0, -nan, 3.0, 0.0], dtype=dtype))
    for moved in ([1.5, 0.0, nan, 3.0, 0.0], [1.5, -0.0, 2.0, 3.0, 0.0], [1.5, -0.0, nan, nan, 0.0],
                  [1.5, -0.0, nan, 3.0, 0.25]):
        assert not ahead._same(a, torch.tensor(moved, dtype=dtype)), moved
    assert ahead._same(a[::2], a.clone()[::2]) and not ahead._same(a, a.float() if dtype != torch.float32 else a.double())
    if hasattr(torch, "float8_e4m3fn"):  # no masked_fill for it on CPUs: compared as integers
        b = torch.tensor([1.5, -0.0, 0.0, 3.0], dtype=torch.float8_e4m3fn)
        assert ahead._same(b, b.clone()) and not ahead._same(b, torch.tensor([1.5, 0.0, 0.0, 3.0]).to(b.dtype))


def test_a_cpus_package_is_compiled_less_optimised(monkeypatch):
    """Only tests and checks build CPU packages: their wrapper compiles at -O0 and their loops at -O1, a
    GPU's at Inductor's levels; the options are part of the package's name, so the two never share a file."""
    from torch._inductor import config, cpp_builder
    cpu = kernels._ahead_options(torch.device("cpu"))
    monkeypatch.setattr(devices, "optimises_ahead", lambda where: True)
    gpu = kernels._ahead_options(torch.device("cpu"))
    if hasattr(config.aot_inductor, "compile_wrapper_opt_level"):
        assert cpu["aot_inductor.compile_wrapper_opt_level"] == "O0"
    assert cpu[ahead.LOOPS_LEVEL] == "O1" and ahead.LOOPS_LEVEL not in gpu
    assert {k: v for k, v in cpu.items() if k not in ("aot_inductor.compile_wrapper_opt_level", ahead.LOOPS_LEVEL)} == gpu
    kernel = kernel_named("_half_share")
    form = (("float32", "cpu", (-1,)),)
    assert ahead.package_path(kernel.fn, {}, form, cpu, "cpu") != ahead.package_path(kernel.fn, {}, form, gpu, "cpu")
    # what the compiling child does with the loops' level: Inductor's flags for the loops say -O1
    monkeypatch.setattr(cpp_builder, "_get_optimization_cflags", cpp_builder._get_optimization_cflags)

    def cflags() -> list:
        given = cpp_builder._get_optimization_cflags("g++")
        return given[0] if isinstance(given, tuple) else given  # older torch: cflags alone
    assert "O3" in cflags()
    original = cpp_builder._get_optimization_cflags
    ahead._compile_loops_at("O1")
    assert "O1" in cflags() and "O3" not in cflags(), cflags()
    ahead._compile_loops_at("O1")  # a child's next compile: Inductor's own function wrapped once, not twice
    assert cpp_builder._get_optimization_cflags.wrapped is original
    ahead._compile_loops_at(None)  # a GPU's package after a CPU's, in one child: -O3 again
    assert cpp_builder._get_optimization_cflags is original and "O3" in cflags()


def test_a_failing_compile_warns_once_and_keeps_the_reference_path(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADZIP_KERNEL_CACHE", str(tmp_path))
    kernel = quantize._terngrad_bucket_encode
    monkeypatch.setattr(kernel, "ahead_numel", 1)
    monkeypatch.setattr(kernel, "_ahead", {})

    def no_compiler(spec):
        raise RuntimeError("compiling a kernel ahead failed: InvalidCxxCompiler: No working C++ compiler found")
    monkeypatch.setattr(ahead, "spawn", no_compiler)
    monkeypatch.setattr(kernels, "_AHEAD_WARNED", False)
    with pytest.warns(RuntimeWarning, match="compiled ahead is off") as caught:
        got, _ = exchanges("terngrad", {}, 1)
        kernels.settle()
    assert len(caught) == 1 and "No working C++ compiler" in str(caught[0].message)
    assert kernel.failed_ahead is not None and kernels._failure is None  # the other kernels go on
    assert [p.suffix for p in tmp_path.iterdir()] and all(p.suffix in (".failed", ".lock") for p in tmp_path.iterdir())
    ran = ran_ahead(kernel, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = exchanges("terngrad", {}, 2)
    assert not any(ran) and not kernel.wanted(1 << 30, "cpu")
    monkeypatch.setattr(kernel, "ahead_numel", 1 << 40)
    want, _ = exchanges("terngrad", {}, 2)
    assert torch.equal(got[0], want[0]) and all(torch.equal(g, w) for g, w in zip(again, want))


def test_switched_off_queues_nothing_and_a_small_bucket_queues_its_kernel(monkeypatch):
    """GRADZIP_FUSED=0 keeps the reference paths; otherwise a bucket of any size takes the kernels
    (here some 3,000 elements: the per-tensor route's threshold, 2^20, does not apply to them)."""
    kernel = quantize._natural_encode
    monkeypatch.setattr(kernel, "_ahead", {})
    monkeypatch.setenv("GRADZIP_FUSED", "0")
    exchanges("natural", {}, 1)
    assert kernel._ahead == {}
    monkeypatch.delenv("GRADZIP_FUSED")
    exchanges("natural", {}, 1)
    assert kernel.ahead_numel == 1 and len(kernel._ahead) == 1


def test_a_process_that_exits_leaves_no_unpacked_package(tmp_path):
    """AOTInductor unpacks each package loaded into a temporary directory that only its runner's
    destruction removes, and a process does not destroy every object as it exits: gradzip unloads its
    packages then (here natural's, compiled by the earlier tests: this process only loads them)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = (
        "import glob, os, tempfile, torch\n"
        "from gradzip import devices, kernels\n"
        "from gradzip.state import GradzipState\n"
        "devices.runs_kernels_ahead = lambda where: True\n"
        "state = GradzipState('natural', bucketed=True, feedback='residual')\n"
        "for step in range(3):\n"
        "    gen = torch.Generator().manual_seed(step)\n"
        f"    named = [(f'p{{i}}', torch.randn(s, generator=gen)) for i, s in enumerate({SHAPES!r})]\n"
        "    state.exchange(named, out=[g for _, g in named])\n"
        "    kernels.settle()\n"
        "print(len(glob.glob(os.path.join(tempfile.gettempdir(), 'aotinductor_*'))), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], timeout=600, capture_output=True, text=True,
                          env=dict(os.environ, TMPDIR=str(tmp)))
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) >= 1 and _left(tmp) == []  # packages were loaded, and none is left


def test_a_package_loaded_as_the_process_exits_is_let_go_of(monkeypatch):
    """A job that finishes loading after the exit handler unloaded the others keeps no runner (whose
    unpacked directory would then outlive the process), and its kernel takes the reference path."""
    exiting = threading.Event()
    exiting.set()
    monkeypatch.setattr(ahead, "_EXITING", exiting)
    package = ahead.Package(lambda *args: args, [])
    assert package.runner is None and not package.fits(()) and package() is None


def test_a_runner_is_loaded_single_threaded_and_its_calls_take_turns(monkeypatch):
    """AOTInductor's thread-aware runner waits at each call for the last call's CUDA event (one model
    instance): packages load single-threaded, and Package lets one thread call its runner at a time."""
    loaded, inside, overlapped = [], [], []

    def runner(*args):
        inside.append(1)
        overlapped.append(len(inside) > 1)
        time.sleep(0.01)
        inside.pop()
        return [args[0] + 1]

    def load_package(path, **kw):
        loaded.append(kw)
        return runner

    monkeypatch.setattr(torch._inductor, "aoti_load_package", load_package)
    package = ahead.Package(ahead.load_runner("kernel.pt2", torch.device("cpu")), [])
    assert loaded == [{"run_single_threaded": True, "device_index": -1}]
    results = []
    threads = [threading.Thread(target=lambda: results.extend(package(torch.ones(2)) for _ in range(5)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(overlapped) == 20 and not any(overlapped)
    assert all(torch.equal(r, torch.full((2,), 2.0)) for r in results)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_copy_leaves_the_parents_compile_alone(tmp_path):
    """A data loader's worker forked while a kernel compiles exits (atexit and all) without stopping the
    parent's compiling child."""
    script = (
        "import os, subprocess, sys, time\n"
        "from gradzip import ahead\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "ahead._CHILDREN[child] = os.devnull\n"
        "pid = os.fork()\n"
        "if pid == 0: sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(child.poll() is None, flush=True)\n"
        "child.kill()\n")
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_a_package_is_checked_at_its_examples_and_smaller_sizes_of_every_residue():
    """The child's checks: once at the export's example sizes, then at smaller sizes plus 0..15 (the tails
    of 8- and 16-lane vectors), each in the order of the examples and within half of each other (as a
    packed byte's index ``i >> 3`` into a dimension an eighth as long as another stays in range), never
    a size an export would specialise."""
    spec = {"shapes": [["float32", "cpu", [-1]], ["uint8", "cpu", [-2, 1]], ["int32", "cpu", [-3, -1]]],
            "examples": [4131, 4099, 4115], "device": "cpu"}
    checked = [[tuple(t.shape) for t in args] for args in ahead._checked(spec)]
    assert checked[0] == [(4131,), (4099, 1), (4115, 4131)]
    assert len(checked) == 17
    for extra, shapes in enumerate(checked[1:]):
        assert shapes == [(289 + extra,), (257 + extra, 1), (273 + extra, 289 + extra)]
    for dim in (289, 257, 273):
        assert {(dim + extra) % 16 for extra in range(16)} == set(range(16))
    for shapes in checked:
        sizes = [d for shape in shapes for d in shape if d > 1]
        assert max(sizes) < 1.5 * min(sizes) and max(sizes) >> 3 < min(sizes)


def test_a_kernels_nonnegative_arguments_are_checked_so():
    """Float arguments a kernel makes indices of (DGC's and dropping's uniform draws times their spans)
    are drawn non-negative for its checks, the others of either sign: the eager code the package is
    checked against then reads only within its tensors, whatever the draws' seed."""
    sparse = sys.modules["gradzip.compressors.sparse"]
    kernel = sparse._sample_keys
    assert kernel.nonnegative == (1, 2)  # uniforms, span
    per_tensor, per_slot = [-2], [-3]
    spec = {"shapes": [["float32", "cpu", [-1]], ["float32", "cpu", per_tensor], ["float32", "cpu", per_tensor],
                       ["int64", "cpu", per_tensor], *[["int64", "cpu", per_slot]] * 3, ["int64", "cpu", per_tensor]],
            "examples": [4131, 4099, 4115], "device": "cpu"}
    for args in ahead._checked(spec, kernel.nonnegative):
        assert bool((args[1] >= 0).all()) and bool((args[2] >= 0).all())
        assert bool((args[0] < 0).any())
        kernel.fn(*args, absolute=True)  # in range: a negative start would be an index error here


def test_a_kernels_nonnegative_names_are_its_positional_tensor_arguments():
    """Only arguments the spec's shapes describe by position can be drawn non-negative: a keyword
    constant, one of ``*packed`` or a misspelt name is an error where the kernel is defined."""
    def mean(out, steps, *packed, bits: int):
        return out
    KERNELS = list(kernels.KERNELS)
    try:
        assert kernels.Kernel(mean, nonnegative=("steps",)).nonnegative == (1,)
        for wrong in ("bits", "packed", "stpes"):
            with pytest.raises(ValueError, match=rf"mean: nonnegative names \['{wrong}'\], not among its tensor "
                                                 r"arguments before any \*args \['out', 'steps'\]"):
                kernels.fused(nonnegative=(wrong,))(mean)
    finally:
        kernels.KERNELS[:] = KERNELS  # the kernels defined here are not gradzip's


def test_a_package_needing_larger_sizes_than_its_checks_is_a_failed_compile(monkeypatch, tmp_path):
    """A package whose least sizes exceed its checks' sizes is not taken unchecked: the child fails, naming
    them (here the export is made to report a least size of 300 elements)."""
    monkeypatch.setenv("GRADZIP_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(ahead, "_least_sizes", lambda exported, shapes, name: [[300]])
    kernel = kernel_named("_counter_hashes")
    spec = {"module": kernel.fn.__module__, "kernel": "_counter_hashes", "static": {},
            "shapes": [["int32", "cpu", [-1]], ["int32", "cpu", []]], "options": {}, "device": "cpu",
            "examples": [4099]}
    spec["path"] = ahead.package_path(kernel.fn, {}, ahead._as_form(spec["shapes"]), {}, "cpu")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: None)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda *a, **k: kernel.fn)  # a right package
    needs = r"needs sizes of at least \[\[300\]\], more than its checks' \[\(257,\), \(\)\]"
    with pytest.raises(RuntimeError, match=needs):
        ahead._main(spec)
    assert not os.listdir(tmp_path)

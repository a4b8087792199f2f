"""Fused kernels on the bucket route, compiled ahead (:meth:`gradzip.kernels.Kernel.ahead`, :mod:`gradzip.ahead`).

A bucket's first exchange for a kernel's form queues the loading of its package (compiled in a child
process where the machine's cache has none) and takes the reference path; later exchanges run it.  The
kernel and the reference path agree bit for bit (aggregates and error-feedback state), so it does not
matter at which step each rank switches; no compile runs in the process; a dispatch mode of the
caller's gets the reference path; a failing compile warns once and leaves the reference path for good.  The thresholds are lowered to one
element for the kernels under test (the default, 2^20 elements, would make the buckets here large).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradzip.state  # noqa: F401 - registers the methods
from gradzip import ahead, kernels
from gradzip.state import GradzipState
from gradzip.testing import MemoryCounter, OpCounter, launching_ops

quantize = sys.modules["gradzip.compressors.quantize"]

#: (method, parameters, the kernels its bucket route takes ahead: encoding, then error feedback's residual)
CASES = [
    ("qsgd", {"feedback": "residual"}, ("_qsgd_bucket_encode", "_qsgd_bucket_residual")),
    ("qsgd", {"levels": 7}, ("_qsgd_bucket_encode",)),
    ("terngrad", {"feedback": "residual"}, ("_terngrad_bucket_encode", "_terngrad_bucket_residual")),
    ("terngrad", {"clip": None}, ("_terngrad_bucket_encode",)),
    ("natural", {"feedback": "residual"}, ("_natural_encode", "_natural_bucket_residual")),
]
IDS = [f"{m}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for m, p, _ in CASES]
#: Odd shapes together: an empty tensor, one element, a QSGD chunk cut short, a non-power-of-two count.
SHAPES = [(64, 33), (33,), (0, 3), (1,), (100, 7), (5,)]


def bucket(seed: int, device="cpu") -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.randn(s, generator=gen).to(device)) for i, s in enumerate(SHAPES)]


def exchanges(method: str, params: dict, steps: int, device="cpu"):
    """The flat aggregates of ``steps`` exchanges from a fresh bucketed state, and the state."""
    state = GradzipState(method, bucketed=True, **params)
    outs = []
    for step in range(steps):
        named = bucket(step, device)
        outs.append(torch.cat([g.reshape(-1) for g in state.exchange(named, out=[g for _, g in named])]))
    return outs, state


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


def compare_with_reference(method, params, names, monkeypatch, device="cpu", steps=3):
    """The reference paths' aggregates and state, then those with the kernels ``names`` compiled ahead:
    bit for bit, every kernel having run at every call from the second step on (a residual's first)."""
    fused = [getattr(quantize, name) for name in names]
    for kernel in fused:
        monkeypatch.setattr(kernel, "_ahead", {})  # what this process loaded before: not from this session's cache
        monkeypatch.setattr(kernel, "min_numel", 1 << 40)
    want, reference = exchanges(method, params, steps, device)
    for kernel in fused:
        monkeypatch.setattr(kernel, "min_numel", 1)
    exchanges(method, params, 2, device)  # queues the compiles (a residual's from the second step on)
    kernels.settle()
    ran = {kernel.__name__: ran_ahead(kernel, monkeypatch) for kernel in fused}
    got, fused_state = exchanges(method, params, steps, device)
    assert all(len(r) >= steps - 1 and all(r) for r in ran.values()), f"{method}: the kernels ran at calls {ran}"
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{method}: aggregates differ at step {step}"
    a, b = state_tensors(fused_state), state_tensors(reference)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{method}: state {key} differs"


@pytest.fixture(autouse=True)
def no_failure(monkeypatch):
    monkeypatch.setattr(kernels, "_failure", None)
    yield
    kernels.settle()  # nothing of a test's keeps compiling into the next


@pytest.mark.parametrize("method, params, names", CASES, ids=IDS)
def test_kernels_compiled_ahead_agree_with_reference_bit_for_bit(method, params, names, monkeypatch):
    compare_with_reference(method, params, names, monkeypatch)


def test_the_compile_runs_in_a_child_while_exchanges_go_on(monkeypatch, tmp_path):
    """With no package in the cache, exchanges take the reference path while the child compiles (held
    here until they are done), the process never compiles (``torch.compiler.is_compiling()`` stays false
    in it, which PyTorch's optimizers and DDP branch on), and the package serves the exchanges after."""
    monkeypatch.setenv("GRADZIP_KERNEL_CACHE", str(tmp_path))
    kernel = quantize._qsgd_bucket_encode
    monkeypatch.setattr(kernel, "min_numel", 1)
    monkeypatch.setattr(kernel, "_ahead", {})
    release, spawned = threading.Event(), []
    spawn = ahead.spawn

    def held(argv):
        spawned.append(threading.current_thread().name)
        assert release.wait(60)
        spawn(argv)
    monkeypatch.setattr(ahead, "spawn", held)
    ran = ran_ahead(kernel, monkeypatch)
    try:
        got, _ = exchanges("qsgd", {}, 2)
    finally:
        release.set()
    compiling = False
    while not list(tmp_path.glob("*.pt2")):  # until the child's package is written
        compiling |= torch.compiler.is_compiling()
        time.sleep(0.01)
    kernels.settle()
    assert ran == [False, False] and spawned == ["gradzip-ahead"] and not compiling
    again, _ = exchanges("qsgd", {}, 2)
    assert ran[2:] == [True, True]
    monkeypatch.setattr(kernel, "min_numel", 1 << 40)
    want, _ = exchanges("qsgd", {}, 2)
    assert all(torch.equal(g, w) for g, w in zip(got + again, want + want))


def test_a_package_in_the_cache_is_loaded_not_compiled(monkeypatch):
    """Compiled once per machine: a process that finds the package (here, a kernel that forgot what it
    loaded) loads it without a child."""
    kernel = quantize._natural_encode
    monkeypatch.setattr(kernel, "min_numel", 1)
    monkeypatch.setattr(kernel, "_ahead", {})
    exchanges("natural", {}, 1)  # loaded from the session's cache, or compiled into it
    kernels.settle()
    monkeypatch.setattr(kernel, "_ahead", {})

    def compiled_again(argv):
        raise RuntimeError("compiled again")
    monkeypatch.setattr(ahead, "spawn", compiled_again)
    ran = ran_ahead(kernel, monkeypatch)
    exchanges("natural", {}, 1)
    kernels.settle()
    exchanges("natural", {}, 1)
    assert ran == [False, True] and kernels._failure is None


def test_ranks_on_one_machine_compile_once(monkeypatch, tmp_path):
    """A package another process is compiling (its lock file there) is waited for, not compiled again;
    a lock left by a process that died, or long ago on another host, is taken over."""
    path = str(tmp_path / "k.pt2")
    spawned = []
    monkeypatch.setattr(ahead, "spawn", lambda argv: spawned.append(argv) or open(path, "w").close())
    with open(path + ".lock", "w") as lock:
        lock.write(f"{socket.gethostname()} {os.getpid()}")  # a live process: this one
    waiter = threading.Thread(target=ahead._compile, args=(path, {}))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not spawned
    open(path, "w").close()  # the other process's package
    waiter.join(10)
    assert not waiter.is_alive() and not spawned
    for holder, age in ((f"{socket.gethostname()} {_dead_pid()}", 0), ("elsewhere 1", ahead.STALE_LOCK_S + 1)):
        os.remove(path)
        with open(path + ".lock", "w") as lock:
            lock.write(holder)
        os.utime(path + ".lock", (time.time() - age,) * 2)
        ahead._compile(path, {})
        assert os.path.exists(path) and not os.path.exists(path + ".lock")
    assert len(spawned) == 2


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_process_that_exits_mid_compile_leaves_no_lock(tmp_path):
    """A user's script that ends while its kernel compiles: the child is stopped and the lock removed, so
    the next run compiles instead of waiting for a file that never comes."""
    script = (
        "import os, sys, time, threading\n"
        "from gradzip import ahead\n"
        "ahead.spawn = lambda argv: time.sleep(60)\n"
        "threading.Thread(target=ahead._compile, args=(sys.argv[1], {}), daemon=True).start()\n"
        "while not os.path.exists(sys.argv[1] + '.lock'): time.sleep(0.01)\n")
    path = str(tmp_path / "k.pt2")
    done = subprocess.run([sys.executable, "-c", script, path], timeout=30)
    assert done.returncode == 0 and not os.path.exists(path + ".lock")


def test_a_callers_dispatch_mode_gets_the_reference_path(monkeypatch):
    """A compiled kernel runs no aten operation a mode could see, so under the caller's own dispatch mode
    the reference path runs (and nothing is switched off); gradzip's counters see the kernel as one
    operation and its result's storage."""
    kernel = quantize._qsgd_bucket_encode
    monkeypatch.setattr(kernel, "min_numel", 1)
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
    assert memory.peak > 0


def test_fused_kernels_cut_the_bucket_route_launches(monkeypatch):
    """Counted on CPU: with error feedback, the quantisers' encoding and residual are one operation each
    once compiled, at least 28 operations fewer per bucket than their reference paths dispatch."""
    for method, params, names in CASES[::2]:
        fused = [getattr(quantize, name) for name in names]
        counts = []
        for threshold in (1 << 40, 1):
            for kernel in fused:
                monkeypatch.setattr(kernel, "min_numel", threshold)
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


def test_a_failing_compile_warns_once_and_keeps_the_reference_path(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADZIP_KERNEL_CACHE", str(tmp_path))
    kernel = quantize._terngrad_bucket_encode
    monkeypatch.setattr(kernel, "min_numel", 1)
    monkeypatch.setattr(kernel, "_ahead", {})

    def no_compiler(argv):
        raise RuntimeError("compiling a kernel ahead failed: InvalidCxxCompiler: No working C++ compiler found")
    monkeypatch.setattr(ahead, "spawn", no_compiler)
    with pytest.warns(RuntimeWarning, match="fused kernels are off") as caught:
        got, _ = exchanges("terngrad", {}, 1)
        kernels.settle()
    assert len(caught) == 1 and "No working C++ compiler" in str(caught[0].message)
    assert kernels._failure is not None and not list(tmp_path.iterdir())  # no lock left behind
    ran = ran_ahead(kernel, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = exchanges("terngrad", {}, 2)
    assert not any(ran) and not kernel.wanted(1 << 30)
    monkeypatch.setattr(kernel, "min_numel", 1 << 40)
    want, _ = exchanges("terngrad", {}, 2)
    assert torch.equal(got[0], want[0]) and all(torch.equal(g, w) for g, w in zip(again, want))


def test_switched_off_and_small_buckets_queue_nothing(monkeypatch):
    kernel = quantize._natural_encode
    monkeypatch.setattr(kernel, "_ahead", {})
    exchanges("natural", {}, 1)  # the default threshold, 2^20 elements, is above this bucket
    monkeypatch.setattr(kernel, "min_numel", 1)
    monkeypatch.setenv("GRADZIP_FUSED", "0")
    exchanges("natural", {}, 1)
    assert kernel._ahead == {}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_copy_leaves_the_parents_compile_alone(tmp_path):
    """A data loader's worker forked while a kernel compiles exits (atexit and all) without removing the
    parent's lock, which would let another rank compile the same package again."""
    script = (
        "import os, sys\n"
        "from gradzip import ahead\n"
        "open(sys.argv[1], 'w').close()\n"
        "ahead._HELD.add(sys.argv[1])\n"
        "pid = os.fork()\n"
        "if pid == 0: sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(os.path.exists(sys.argv[1]))\n")
    lock = str(tmp_path / "k.pt2.lock")
    done = subprocess.run([sys.executable, "-c", script, lock], timeout=30, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "True"

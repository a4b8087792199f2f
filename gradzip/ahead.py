"""Fused kernels compiled ahead: once per machine, in a process of their own, loaded when ready.

The bucket route cannot wait seconds for a compile in a user's step, nor compile on a thread of the
user's process: Python holds one lock for every thread's bytecode (a compile's tracing would slow the
user's own host-bound steps), and ``torch.compiler.is_compiling()`` is true for the whole process while
any thread compiles, which PyTorch's optimizers, DDP and a user's own code branch on.  So the first call
for a kernel's *form* (:func:`form`: its arguments' dtypes, kind of device and which dimensions are 0, 1
or equal, not their sizes) queues a job on a background thread, and the caller takes the kernel's
reference path.  The job loads the kernel's package from the machine's cache (``GRADZIP_KERNEL_CACHE``,
default ``~/.cache/gradzip/kernels``) or, where there is none, has a child process export the kernel
with every size symbolic, compile it with AOTInductor (``torch._inductor.aoti_compile_and_package``: a
C++ loop on CPUs, Triton on GPUs; some 20 s on a 2-core CPU, 10 s for the later compiles of a thread,
whose child serves them until it idles: :func:`spawn`) and check it against the kernel's eager
code at its example sizes and at smaller sizes of every residue modulo 16, under a lock (``flock``,
released by the system if its holder dies) that the ranks on one machine share: one compiles, the
others wait and load its file.  Later calls run the package.  A compile that fails leaves a
``.failed`` file with the reason beside the package's name, so no process tries it again (delete the
file to retry).

Packages are compiled with Inductor's eager-numerics options (no contracted multiply-adds, division and
denormals as eager): a kernel gives its reference path's bits, so a run does not depend on when its
compiles finished.  A CPU's package, which only tests and checks build, has its wrapper (the host code
around the loops) compiled at -O0 and its loops at -O1 (:func:`gradzip.devices.optimises_ahead`).  A package is named by a digest of the kernel, its constants, the form, the options,
torch's version, what it is compiled for (:func:`gradzip.devices.compile_target`: a CPU's instruction
set, a GPU's compute capability) and every source file of gradzip, so changed code compiles again.

This module sits beside :mod:`gradzip.kernels`: it imports only torch and :mod:`gradzip.devices`.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import importlib
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from typing import Callable, Optional

import torch

from . import devices

#: The longest a child's compile may take.
COMPILE_TIMEOUT_S = 1800
#: Example sizes of a form: odd, apart from each other and from 0 and 1, which an export would
#: specialise, in the order of the first call's sizes and within a few percent of each other (an index
#: into one dimension made from another's, such as a packed byte's ``i >> 3``, stays in range).  The
#: child checks the package at these (more than a GPU's block, a CPU's share of its threads) and at
#: smaller sizes of every residue modulo 16 (``_SMALL`` + ``_APART`` * rank + 0..15, within half of
#: each other): the tails of a 16-lane vector (AVX-512's float32) as well as an 8-lane one's.  A
#: kernel's work can grow with the product of its sizes (rows by columns, pieces by their width), so
#: sixteen checks at the examples' sizes would cost seconds each.
_EXAMPLE, _APART, _SMALL, _CHECKED = 4099, 16, 257, 16


#: gradzip's own entry of a package's options (part of its name, not passed to Inductor): the level its
#: loops' C++ is compiled at, where not Inductor's -O3.
LOOPS_LEVEL = "gradzip.loops_opt_level"


def cache_dir() -> str:
    return os.environ.get("GRADZIP_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradzip",
                                                                    "kernels")


def form(args) -> Optional[tuple]:
    """What a package compiled for ``args`` serves: per tensor its dtype, kind of device and each
    dimension as 0, 1 or -1 - i for the i-th distinct larger size met, in order (so that it serves
    every size and device index while keeping which dimensions are equal, and only that); None where an
    argument is not a contiguous tensor."""
    if not all(isinstance(a, torch.Tensor) and a.is_contiguous() for a in args):
        return None
    sizes: dict = {}
    for d in (d for a in args for d in a.shape if d > 1):
        sizes.setdefault(d, len(sizes))
    return tuple((str(a.dtype).removeprefix("torch."), a.device.type, tuple(d if d < 2 else -1 - sizes[d] for d in a.shape))
                 for a in args)


class Package:
    """A loaded package: call it with tensors of its form; ``fits(args)`` says whether their sizes are
    within the ranges the export allowed (a size the kernel's code had to assume, such as at least 2)."""

    def __init__(self, runner: Callable, mins: list):
        self.runner = None if exiting() else runner  # loaded as the process exits: let go of at once
        self.mins = mins
        self._calling = threading.Lock()  # the runner is loaded single-threaded (see load_runner)
        _LOADED.add(self)

    def fits(self, args) -> bool:
        return self.runner is not None and all(d >= m for a, low in zip(args, self.mins) for d, m in zip(a.shape, low))

    def __call__(self, *args):
        """The kernel's outputs; None once unloaded (the caller's reference path)."""
        runner = self.runner  # held until the call ends, should the process unload it meanwhile
        if runner is None:
            return None
        with self._calling, devices.current_for(args[0]):  # it launches on the current GPU's current stream
            out = runner(*args)
        return out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out

    def unload(self) -> None:
        """Let go of the runner.  AOTInductor unpacks a package into a temporary directory that only the
        runner's destruction removes, and a process does not destroy all its objects when it exits."""
        self.runner = None


#: Every package loaded in this process, unloaded at its exit.
_LOADED: "weakref.WeakSet[Package]" = weakref.WeakSet()


@functools.lru_cache(maxsize=1)
def _source_digest() -> bytes:
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.digest()


def package_path(fn: Callable, static: dict, shapes: tuple, options: dict, device) -> str:
    """Where the package of kernel function ``fn`` with constants ``static`` for form ``shapes`` lives,
    compiled for ``device``'s kind of processor (the very device: a thread's current GPU may be another
    model of GPU)."""
    digest = hashlib.sha256(_source_digest())
    for part in (fn.__module__, fn.__name__, sorted(static.items()), shapes, sorted(options.items()), torch.__version__,
                 devices.compile_target(device)):
        digest.update(repr(part).encode())
    return os.path.join(cache_dir(), f"{fn.__name__}-{digest.hexdigest()[:24]}.pt2")


def load(fn: Callable, static: dict, args_form: tuple, options: dict, device: torch.device, sizes: list) -> Package:
    """The package for ``fn``, ``static`` and form ``args_form``, loaded for ``device``: from the cache,
    else compiled first (in a child process, under the machine's lock for it, on ``device``, its example
    sizes in the order of ``sizes``, the shapes of the call that asked: an index stays within what it
    indexes)."""
    path = package_path(fn, static, args_form, options, device)
    meta = _meta(path)
    if meta is None:
        real = {-1 - d: n for (_, _, dims), shape in zip(args_form, sizes) for d, n in zip(dims, shape) if d < 0}
        examples = {c: _EXAMPLE + _APART * rank for rank, c in enumerate(sorted(real, key=real.get))}
        _compile(path, {"module": fn.__module__, "kernel": fn.__name__, "static": static, "shapes": args_form,
                        "options": options, "path": path, "device": str(device),
                        "examples": [examples[c] for c in range(len(examples))]})
        meta = _meta(path)
    if meta is None:
        raise RuntimeError(f"no package at {path} after its compile")
    return Package(load_runner(path, device), meta["mins"])


def load_runner(path: str, device) -> Callable:
    """AOTInductor's runner of the package at ``path``, for ``device``, single-threaded: the thread-aware
    runner keeps one model instance, which a call takes only once the last call's work has finished on
    the GPU (it waits for that run's CUDA event), so calls back to back, as a bucket's kernels are,
    would make the host wait for the GPU at each.  :class:`Package` serialises the calls instead."""
    return torch._inductor.aoti_load_package(path, run_single_threaded=True, device_index=_index(device))


def _meta(path: str) -> Optional[dict]:
    """The package's sidecar (its sizes' least values), or None where there is no whole package; raises
    the reason where its compile failed."""
    if os.path.exists(path + ".failed"):
        with open(path + ".failed") as failed:
            reason = failed.readline().strip()
        raise RuntimeError(f"{reason} (the child's output: {path}.failed; delete it to try again)")
    try:
        with open(path + ".json") as meta:
            found = json.load(meta)
    except (OSError, ValueError):  # none, or one a dead compile left half written
        return None
    return found if os.path.exists(path) else None


def _compile(path: str, spec: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        locked = _lock(lock)  # one compiles, the others wait here; the system releases it if its holder dies
        if _meta(path) is not None:
            return
        if locked:  # else another process may be compiling it beside this one
            _remove_parts_left(path)
        try:
            spawn(spec)
        except RuntimeError as exc:
            # a failure, not a child stopped because this process ends or by a signal from outside
            if not exiting() and not getattr(exc, "stopped", False):
                with open(path + ".failed", "w") as failed:
                    failed.write(str(exc).replace("\n", " ") + "\n")
                    failed.write(getattr(exc, "output", ""))  # the child's whole output, for whoever reads it
            raise


def _lock(file) -> bool:
    try:
        import fcntl
    except ImportError:  # no POSIX locks: ranks may compile the same package side by side
        return False
    fcntl.flock(file, fcntl.LOCK_EX)
    return True


#: The compiling children, each with the scratch directory of the compile it runs (None between compiles).
_CHILDREN: dict = {}
#: A running compile's scratch directory, and where it writes its package before renaming it (:func:`_part`).
_WRITING: dict = {}
_SPAWN_LOCK = threading.Lock()
#: What a compile runs in the child: a test names a function of its own.
COMPILE = "gradzip.ahead:_main"
#: A background thread's compiling child ends once no job has come for this long: it holds torch (and on
#: a GPU a context of its own), which a training process should not carry for nothing.
CHILD_IDLE_S = 20.0
#: Environment variables that change as a process runs and that a compile does not depend on (pytest's
#: name of the test; those torch sets for its own loads, pools and profiler): a child started before
#: one changed still serves.
_CHANGING = ("PYTEST_CURRENT_TEST", "KMP_", "CUDA_MODULE_LOADING", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
             "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "TORCH_WARM_POOL", "DISABLE_CUPTI_LAZY_REINIT", "TEARDOWN_CUPTI")
_THREAD = threading.local()


def spawn(spec: dict, target: str = COMPILE) -> None:
    """Have this thread's compiling child run ``target`` (``module:function``) on ``spec``; raises with its
    exception line if that fails.  The child is started by a thread's first compile and serves its
    later ones (a background thread's until it idles, :data:`CHILD_IDLE_S`; another thread's for this
    compile only): some 8 s of a core a compile go to importing and warming torch's compiler, twice
    what the compile itself takes in Python.  It is started with this process's import path, working
    directory and environment, and again when any of them has changed since (but for the variables of
    ``_CHANGING``), so it compiles the very gradzip that asked, for the cache it names.  What AOTInductor
    unpacks as the child loads a package to check it goes to a scratch directory of the compile's own
    (:func:`_unpack_in_scratch`), removed however the compile ends: a child is often killed (its process
    ended mid-compile).  A compile that fails ends its child (a failure may have left the child's device
    or torch in a state no later compile should inherit) and is reported as it ended: its exception
    line, a crash, a signal, over :data:`COMPILE_TIMEOUT_S`; one that failed in a child that had served
    others is first tried once more in a fresh child, so what an earlier compile left behind cannot
    mark this kernel failed on the machine."""
    try:
        _spawn(spec, target)
        return
    except CompileFailed as failed:
        if not failed.after_others or failed.stopped or exiting():
            raise
    _spawn(spec, target)  # its failure, if it fails too, is the one recorded


def _spawn(spec: dict, target: str) -> None:
    scratch, child = tempfile.mkdtemp(prefix="gradzip-compile-"), None
    try:
        # a copy made key by key: another thread may change the environment meanwhile, as Inductor's do
        environment = {k: v for k in list(os.environ) if (v := os.environ.get(k)) is not None}
        started = _started(environment)
        kept = getattr(_THREAD, "child", None)
        if kept is not None and (kept.poll() is not None or _THREAD.started != started):
            _close_child()  # ended between compiles (killed from outside), or started with what has changed
        with _SPAWN_LOCK:
            if exiting():
                raise RuntimeError("the process is exiting")
            child = _child(started, environment)
            _CHILDREN[child] = scratch
            _WRITING[scratch] = _part(spec["path"], scratch) if spec.get("path") else None
        served, timed_out = _THREAD.served, threading.Event()

        def stop():
            timed_out.set()
            child.kill()
        timer = threading.Timer(COMPILE_TIMEOUT_S, stop)
        timer.start()
        try:
            output, status = _request(child, {"target": target, "spec": spec, "scratch": scratch})
        except BaseException:  # this thread stopped: the child must not go on alone
            _close_child()
            raise
        finally:
            timer.cancel()
            timer.join()  # a stop under way has killed the child once this returns: it is not served again
        _THREAD.served += 1
        if status != 0 or timed_out.is_set() or not getattr(_THREAD, "keeps_child", False):
            _close_child()
        if status is None and timed_out.is_set():
            raise RuntimeError(f"compiling a kernel ahead took more than {COMPILE_TIMEOUT_S} s")
        if status is None:  # the child ended
            raise CompileFailed(child.returncode, output, after_others=served > 0)
        if status:
            raise CompileFailed(status, output, raised=True, after_others=served > 0)
    finally:
        with _SPAWN_LOCK:
            _remove_part(_WRITING.pop(scratch, None))  # what a failed compile (raised, crashed, killed) wrote
            shutil.rmtree(scratch, ignore_errors=True)  # its name is free for another compile's from now on
            if child is not None and _CHILDREN.get(child) == scratch:  # serving on: between compiles now
                _CHILDREN[child] = None


def _started(environment: dict) -> tuple:
    """What a child started now keeps: the import path, the working directory (None where it was removed)
    and ``environment`` but for ``_CHANGING``."""
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = None
    return (tuple(p for p in sys.path if p), cwd,
            {k: v for k, v in environment.items() if not k.startswith(_CHANGING)})


def _child(started: tuple, environment: dict) -> subprocess.Popen:
    """This thread's compiling child (under ``_SPAWN_LOCK``), started if it has none."""
    if getattr(_THREAD, "child", None) is not None:
        return _THREAD.child
    _THREAD.started, _THREAD.served, _THREAD.token = started, 0, os.urandom(8).hex()  # the token marks replies
    env = dict(environment, PYTHONPATH=os.pathsep.join(started[0]), GRADZIP_COMPILE_REPLY=_THREAD.token,
               GRADZIP_COMPILE_PARENT=str(os.getpid()))
    _THREAD.child = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace", env=env)
    _CHILDREN[_THREAD.child] = None
    return _THREAD.child


def _request(child: subprocess.Popen, request: dict) -> tuple:
    """Send ``request``; the child's output until its reply, and the reply's exit status (None: the child
    ended first)."""
    lines, mark = [], _THREAD.token + " "
    try:
        child.stdin.write(json.dumps(request) + "\n")
        child.stdin.flush()
    except OSError:  # it has ended: what it said is still in the pipe
        pass
    for line in child.stdout:
        if line.startswith(mark):
            return "".join(lines), int(line[len(mark):])
        lines.append(line)
    child.wait()
    return "".join(lines), None


def _close_child() -> None:
    """End this thread's compiling child, if it has one: killed, then waited for (at most 5 s, outside the
    lock) while still listed, so that an exit meanwhile waits for it too before it removes the scratch
    directory of a compile it ran."""
    child = getattr(_THREAD, "child", None)
    if child is None:
        return
    _THREAD.child = None
    child.kill()
    for pipe in (child.stdin, child.stdout):
        try:
            pipe.close()
        except OSError:  # unflushed input to a dead child
            pass
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU's fault): reaped when it ends
        pass
    with _SPAWN_LOCK:
        _CHILDREN.pop(child, None)


#: Signals that stop a child from outside (a job's time limit, Ctrl-C, a scheduler): not the kernel's fault.
_STOPPED = {signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP}
#: A traceback's last line: the exception and its message (output printed later, such as a warning's
#: source line at shutdown, must not pass for the reason).
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b.*")


class CompileFailed(RuntimeError):
    """A compile that raised in its child (``raised``), or a child that ended with ``returncode``: its
    exception line (or how it ended) as the message, its whole output kept for the ``.failed`` file."""

    def __init__(self, returncode: int, output: str, raised: bool = False, after_others: bool = False):
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        raised_lines = [line for line in lines if _RAISED.match(line)]
        how = "raised in its child" if raised else f"exit status {returncode}"
        if returncode < 0:
            try:
                how = f"killed by {signal.Signals(-returncode).name}"
            except ValueError:
                how = f"killed by signal {-returncode}"
        last = raised_lines[-1] if raised_lines else lines[-1] if lines else "no output"
        super().__init__(f"compiling a kernel ahead failed ({how}): {last}")
        self.output = output
        #: stopped from outside, so nothing is wrong with the kernel: compiled again by the next process
        self.stopped = returncode < 0 and -returncode in _STOPPED
        #: in a child that had served other compiles, which may have left it unfit for this one
        self.after_others = after_others


# -- the background threads -------------------------------------------------------------------------------

_JOBS: list = []  # the queue, made (with its threads) on first use
_EXITING = threading.Event()
#: Jobs at once: a compile is mostly one C++ or Triton compiler process, and a kernel's encoding and
#: residual are asked for together.
WORKERS = max(2, min(4, (os.cpu_count() or 1) // 4))


def submit(job: Callable[[], None]) -> None:
    """Run ``job`` on a background thread, after the ones queued before it have started."""
    if not _JOBS:
        jobs: queue.Queue = queue.Queue()
        for _ in range(WORKERS):
            threading.Thread(target=_work, args=(jobs,), name="gradzip-ahead", daemon=True).start()
        _JOBS.append(jobs)
    _JOBS[0].put(job)


def _work(jobs: queue.Queue) -> None:
    _THREAD.keeps_child = True
    while True:
        try:
            job = jobs.get(timeout=CHILD_IDLE_S)
        except queue.Empty:
            try:
                _close_child()
            except BaseException:  # noqa: BLE001 - nothing may end the thread: its queue would never settle
                pass
            job = jobs.get()
        try:
            if not exiting():
                job()
        except BaseException:  # noqa: BLE001 - a job reports its own failures; nothing may end the thread
            pass
        finally:
            jobs.task_done()


def exiting() -> bool:
    """Whether the process is exiting (its compiling child stopped on purpose: not a failure to report)."""
    return _EXITING.is_set()


def settle(timeout: Optional[float] = None) -> bool:
    """Wait until every job queued so far has finished (at most ``timeout`` seconds); whether they have."""
    if not _JOBS:
        return True
    jobs = _JOBS[0]
    end = None if timeout is None else time.monotonic() + timeout
    with jobs.all_tasks_done:
        while jobs.unfinished_tasks:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            jobs.all_tasks_done.wait(left)
    return True


@atexit.register
def _exit() -> None:
    """A queued job is not started, every compiling child is killed (and the scratch directory of a
    compile it ran removed, with the package it was writing, once it is dead: at most 5 s a child), and
    every package loaded is unloaded (and one that a job loads from now on, at once)."""
    with _SPAWN_LOCK:
        _EXITING.set()
        children = list(_CHILDREN.items())
        for child, _ in children:
            child.kill()
        for child, scratch in children:
            try:
                child.wait(timeout=5)  # killed: at once; its files can go only once it has
            except subprocess.TimeoutExpired:
                continue
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
                _remove_part(_WRITING.get(scratch))
    _unload_all()


def _unload_all() -> None:
    # No wait for the device first: a collective stuck on a dead peer would hang the exit.  A runner may
    # be destroyed with its kernels in flight, as any object of the user's holding one may.
    for package in list(_LOADED):
        package.unload()


def _forked() -> None:
    """A forked copy (a data loader's worker) owns neither its parent's children, nor threads, nor the
    directories its parent's packages were unpacked into."""
    global _SPAWN_LOCK, _THREAD
    _SPAWN_LOCK = threading.Lock()
    _THREAD = threading.local()
    _CHILDREN.clear()
    _WRITING.clear()
    _LOADED.clear()
    _JOBS.clear()  # a job of the copy's own starts threads of its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


# -- the child ---------------------------------------------------------------------------------------------


#: The compiling child's program.  Ctrl-C reaches the whole process group: it is the parent's to act on
#: (it kills its children as it exits), from the child's first statement on (before its imports).
_SERVE = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); from gradzip import ahead; ahead._serve()"
#: In a compiling child: the scratch directory of the compile it runs.
_SCRATCH: list = [None]
#: The package a child's compile writes before renaming it (:func:`_part`), while it runs.
_PART: list = [None]


def _serve() -> None:
    """A compiling child: for each request read (a line of JSON), run its target on its spec with the
    request's scratch directory, its output going to the parent, then reply on a line of its own: the
    marker and 0, or 1 where the target raised (its traceback printed).  A target that ends the child
    (a signal, ``SystemExit``) ends it: the parent sees how.  The parent kills the child when done with
    it; the child ends itself once the parent is gone (:func:`_die_with_parent`)."""
    mark = os.environ.pop("GRADZIP_COMPILE_REPLY").encode()
    replies = os.dup(1)  # whatever a compile does to sys.stdout, the replies reach the parent
    _die_with_parent(int(os.environ.pop("GRADZIP_COMPILE_PARENT")))
    tmpdir, tempdir = os.environ.get("TMPDIR"), tempfile.gettempdir()
    for line in sys.stdin:
        request = json.loads(line)
        module, _, name = request["target"].partition(":")
        _SCRATCH[0] = request["scratch"]
        status = 0
        try:
            getattr(importlib.import_module(module), name)(request["spec"])
        except Exception:  # noqa: BLE001 - the parent records it
            traceback.print_exc()
            status = 1
        finally:
            _SCRATCH[0] = _PART[0] = None
            if tmpdir is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = tmpdir
            tempfile.tempdir = tempdir
            for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - replaced, or closed, by the compile
                    pass
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            try:
                if torch.cuda.is_initialized():  # the checks' blocks go back to the GPU the user trains on
                    torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a device the compile left failed: its status says so
                pass
        os.write(replies, b"\n" + mark + b" %d\n" % status)
    os._exit(0)  # the interpreter's teardown of torch and Inductor would take some 2 s


def _main(spec: dict) -> None:
    """Export the kernel ``spec`` names on zero tensors of its form (on ``spec["device"]``), every larger
    size symbolic, compile it, check it against the kernel's eager code, and only then put it at
    ``spec["path"]``, its sidecar first (each written whole under a name of its own, then renamed)."""
    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    fn, static, shapes = kernel.fn, spec["static"], spec["shapes"]
    assert package_path(fn, static, _as_form(shapes), spec["options"], spec["device"]) == spec["path"], "another gradzip"

    class Wrapped(torch.nn.Module):
        def forward(self, *tensors):
            return fn(*tensors, **static)

    dynamic = tuple({i: torch.export.Dim.AUTO for i, d in enumerate(dims) if d < 0} or None for _, _, dims in shapes)
    exported = torch.export.export(Wrapped(), _examples(spec, 0, zeros=True), dynamic_shapes=(dynamic,), strict=False)
    mins = _least_sizes(exported, shapes, spec["kernel"])
    part = _PART[0] = _part(spec["path"], _SCRATCH[0])
    options = dict(spec["options"])
    _compile_loops_at(options.pop(LOOPS_LEVEL, None))
    torch._inductor.aoti_compile_and_package(exported, package_path=part + ".pt2", inductor_configs=options)
    _unpack_in_scratch()
    package = Package(load_runner(part + ".pt2", spec["device"]), mins)
    try:
        for args in _checked(spec, kernel.nonnegative):  # export keeps guards the package drops
            if not package.fits(args):
                raise RuntimeError(f"{spec['kernel']}'s package needs sizes of at least {mins}, more than its "
                                   f"checks' {[tuple(t.shape) for t in args]}")
            _check(package, fn, static, args, spec["kernel"], kernel.ordered)
    finally:
        package.unload()  # what it unpacked goes with it: the child serves other compiles
    with open(part + ".json", "w") as meta:
        json.dump({"mins": mins, "kernel": spec["kernel"], "static": static, "shapes": shapes}, meta)
        meta.flush()
        os.fsync(meta.fileno())
    os.replace(part + ".json", spec["path"] + ".json")
    os.replace(part + ".pt2", spec["path"])


def _part(path: str, scratch: Optional[str]) -> str:
    """Where a compile writes its package and sidecar before renaming them to ``path``: beside it (a rename
    within the cache is atomic), under a name of this compile's own (its host and scratch directory's).
    Should the compile fail, the process that asked removes them (as the compile ends, or as that process
    exits); should that process die, its child does; should both die, the next compile of the package on
    this host does (:func:`_remove_parts_left`)."""
    own = os.path.basename(scratch) if scratch else str(os.getpid())
    return f"{path.removesuffix('.pt2')}.{socket.gethostname()}.{own}"


def _remove_part(part: Optional[str]) -> None:
    for suffix in (".pt2", ".json") if part else ():
        with contextlib.suppress(OSError):
            os.remove(part + suffix)


def _remove_parts_left(path: str) -> None:
    """Remove what compiles of ``path`` on this host left (a process killed with its child): called under
    the package's lock, so no compile of it runs here but a killed process's child in the second it
    takes to notice (it is ending; its rename would put a checked package in place).  Not another host's
    whose name extends this one's (``node1.cluster`` beside ``node1``): a compile's own part has no dot."""
    directory, base = os.path.split(path.removesuffix(".pt2"))
    own = re.compile(re.escape(f"{base}.{socket.gethostname()}.") + r"[^./]+(?=\.(?:pt2|json)$)")
    for name in os.listdir(directory):
        if part := own.match(name):
            _remove_part(os.path.join(directory, part.group()))


def _compile_loops_at(level: Optional[str]) -> None:
    """Have this child's C++ loops compiled at ``level`` instead of -O3 (None: at -O3).  Inductor has no
    option for it: the function that gives its flags is wrapped (a torch without it compiles at -O3,
    slower, no worse)."""
    from torch._inductor import cpp_builder
    flags = getattr(cpp_builder, "_get_optimization_cflags", None)
    flags = getattr(flags, "wrapped", flags)  # a compile before this one's level
    if flags is None:
        return
    if level is None:
        cpp_builder._get_optimization_cflags = flags
        return

    def at_level(*args, **kwargs):
        given = flags(*args, **kwargs)  # (cflags, ldflags); older torch: cflags alone
        cflags = given[0] if isinstance(given, tuple) else given
        cflags = [level if flag == "O3" else flag for flag in cflags]
        return (cflags, *given[1:]) if isinstance(given, tuple) else cflags
    at_level.wrapped = flags
    cpp_builder._get_optimization_cflags = at_level


def _as_form(shapes: list) -> tuple:
    return tuple((dtype, kind, tuple(dims)) for dtype, kind, dims in shapes)


def _index(device) -> int:
    """The device's index for ``aoti_load_package`` (-1: none)."""
    index = torch.device(device).index
    return -1 if index is None else index


def _checked(spec: dict, nonnegative: tuple = ()) -> list:
    """The arguments a package is checked on: at its example sizes, then at the smaller sizes plus 0..15."""
    return [_examples(spec, 0, zeros=False, nonnegative=nonnegative),
            *(_examples(spec, extra, zeros=False, small=True, nonnegative=nonnegative) for extra in range(_CHECKED))]


def _examples(spec: dict, extra: int, zeros: bool, small: bool = False, nonnegative: tuple = ()) -> tuple:
    """Tensors of the form, each larger size its example (``small``: its small size) plus ``extra``:
    zeros, or random floats, their magnitudes at the positions ``nonnegative`` (a kernel's draws in
    [0, 1) and sizes, which it may make indices of); integer arguments, indices and seeds, stay 0: in
    range for any gather."""
    gen = torch.Generator().manual_seed(extra)
    base = [_SMALL + e - _EXAMPLE for e in spec["examples"]] if small else spec["examples"]  # same order, apart
    out = []
    for position, (dtype, _, dims) in enumerate(spec["shapes"]):
        shape = [d if d >= 0 else base[-1 - d] + extra for d in dims]
        t = torch.zeros(shape, dtype=getattr(torch, dtype))
        if not zeros and t.is_floating_point():
            drawn = torch.randn(shape, generator=gen)
            t = (drawn.abs() if position in nonnegative else drawn).to(t.dtype)
        out.append(t.to(spec["device"]))
    return tuple(out)


def _least_sizes(exported, shapes: list, name: str) -> list:
    """Each input dimension's least size the export allowed (its fixed size where not symbolic)."""
    inputs = exported.graph_signature.user_inputs
    nodes = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    mins = []
    for (_, _, dims), input_name in zip(shapes, inputs):
        low = []
        for d, size in zip(dims, nodes[input_name].meta["val"].shape):
            if d < 0 and not isinstance(size, torch.SymInt):  # the code fixed a size: no package serves all
                raise RuntimeError(f"{name} specialises a size to {size}")
            low.append(int(exported.range_constraints[size.node.expr].lower) if d < 0 else d)
        mins.append(low)
    return mins


def _check(package: Package, fn: Callable, static: dict, args: tuple, name: str, ordered: bool = True) -> None:
    """The package's results and writes equal the eager code's, bit for bit (NaN where NaN); at float
    tolerance for a kernel whose sums run in no fixed order (not ``ordered``)."""
    mine = tuple(a.clone() for a in args)
    got, want = _outputs(package(*mine)), _outputs(fn(*args, **static))
    if len(got) != len(want) or not all(_same(a, b, ordered) for a, b in [*zip(got, want), *zip(mine, args)]):
        raise RuntimeError(f"{name}'s compiled package differs from its eager code at sizes "
                           f"{[tuple(t.shape) for t in args]}")


def _outputs(result) -> tuple:
    """A kernel's outputs as a tuple: one tensor, or several."""
    return tuple(result) if isinstance(result, (list, tuple)) else (result,)


def _same(a: torch.Tensor, b: torch.Tensor, ordered: bool = True) -> bool:
    """Of one dtype and shape, integers equal, floats bit for bit (NaN where NaN, signs of zeros too);
    not ``ordered``: floats equal up to the order of float sums, NaN where NaN and otherwise within a
    relative 1e-4 of the largest magnitude."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    if not ordered:
        scale = max(1.0, float(b.abs().nan_to_num(0, 0, 0).max())) if b.numel() else 1.0
        return torch.allclose(a, b, rtol=1e-4, atol=1e-4 * scale, equal_nan=True)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    # the same bits where not NaN (signs of zeros too): eight times as fast as selecting those elements
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(bits).masked_fill(nan, 0), b.view(bits).masked_fill(nan, 0))  # fp8 has no masked_fill


def _unpack_in_scratch() -> None:
    """Have AOTInductor unpack the packages this compile loads from now on into its scratch directory
    (it reads ``TMPDIR`` at each load; only its runner's destruction would remove what it unpacked, and
    a killed child destroys nothing).  Set once the compile is done, not before: Inductor keeps caches
    under the temporary directory (precompiled headers), which every compile shares; the child puts
    ``TMPDIR`` back after each compile."""
    if _SCRATCH[0]:
        os.environ["TMPDIR"] = _SCRATCH[0]


def _die_with_parent(parent: int) -> None:
    """End this child, and remove the scratch directory of the compile it runs and the package it was
    writing, when ``parent``, the process that started it, is gone (killed, so no atexit ran there to do
    either; gone already while the child imported torch, too)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        if _SCRATCH[0]:
            shutil.rmtree(_SCRATCH[0], ignore_errors=True)
        _remove_part(_PART[0])
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()

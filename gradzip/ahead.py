"""Fused kernels compiled ahead: once per machine, in a process of their own, loaded when ready.

The bucket route cannot wait seconds for a compile in a user's step, nor compile on a thread of the
user's process: Python holds one lock for every thread's bytecode (a compile's tracing would slow the
user's own host-bound steps), and ``torch.compiler.is_compiling()`` is true for the whole process while
any thread compiles, which PyTorch's optimizers, DDP and a user's own code branch on.  So the first call
for a kernel's *form* (:func:`form`: its arguments' dtypes, device and which dimensions are 0, 1 or
equal, not their sizes) queues a job on one background thread, and the caller takes the kernel's
reference path.  The job loads the kernel's package from the machine's cache (``GRADZIP_KERNEL_CACHE``,
default ``~/.cache/gradzip/kernels``) or, where there is none, has a child process export the kernel
with every size symbolic and compile it with AOTInductor (``torch._inductor.aoti_compile_and_package``:
a C++ loop on CPUs, Triton on GPUs; some 15 s on a 2-core CPU), under a lock file that the ranks on one
machine share: one compiles, the others wait for its file.  Later calls run the package.

Packages are compiled with Inductor's eager-numerics options (no contracted multiply-adds, division and
denormals as eager): a kernel gives its reference path's bits, so a run does not depend on when its
compiles finished.  A package is named by a digest of the kernel, its constants, the form, the options,
torch's version, the device's kind (a GPU's compute capability) and the source of the kernel's module,
so a changed kernel is compiled again.

This module sits beside :mod:`gradzip.kernels`: it imports only torch and :mod:`gradzip.devices`.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import torch

from . import devices

#: A lock file older than this belongs to a compile that died: the next job takes it over.
STALE_LOCK_S = 1800
#: The longest a child's compile may take.
COMPILE_TIMEOUT_S = 1800
#: Example size of the i-th distinct size of a form: odd, apart from each other and from 0 and 1, which
#: an export would specialise.
_EXAMPLE, _APART = 4099, 16


def cache_dir() -> str:
    return os.environ.get("GRADZIP_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradzip",
                                                                    "kernels")


def form(args) -> Optional[tuple]:
    """What a package compiled for ``args`` serves: per tensor its dtype, device and each dimension as 0,
    1 or -1 - i for the i-th distinct larger size among all of them (so that it serves every size while
    keeping which dimensions are equal); None where an argument is not a contiguous tensor."""
    if not all(isinstance(a, torch.Tensor) and a.is_contiguous() for a in args):
        return None
    sizes = {d: i for i, d in enumerate(sorted({d for a in args for d in a.shape if d > 1}))}
    return tuple((str(a.dtype).removeprefix("torch."), str(a.device), tuple(d if d < 2 else -1 - sizes[d] for d in a.shape))
                 for a in args)


class Package:
    """A loaded package: call it with tensors of its form; ``fits(args)`` says whether their sizes are
    within the ranges the export allowed (a size the kernel's code had to assume, such as at least 2)."""

    def __init__(self, runner: Callable, mins: list):
        self.runner = runner
        self.mins = mins

    def fits(self, args) -> bool:
        return all(d >= m for a, low in zip(args, self.mins) for d, m in zip(a.shape, low))

    def __call__(self, *args):
        out = self.runner(*args)
        return out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out


def package_path(fn: Callable, static: dict, shapes: tuple, options: dict) -> str:
    """Where the package of kernel function ``fn`` with constants ``static`` for form ``shapes`` lives."""
    digest = hashlib.sha256()
    for part in (fn.__module__, fn.__name__, sorted(static.items()), shapes, sorted(options.items()), torch.__version__,
                 devices.compile_target(shapes[0][1])):
        digest.update(repr(part).encode())
    for module in (sys.modules[fn.__module__], sys.modules[__name__], sys.modules[__package__ + ".kernels"]):
        with open(module.__file__, "rb") as source:
            digest.update(source.read())
    return os.path.join(cache_dir(), f"{fn.__name__}-{digest.hexdigest()[:24]}.pt2")


def load(fn: Callable, static: dict, shapes: tuple, options: dict) -> Package:
    """The package for ``fn``, ``static`` and form ``shapes``: from the cache, else compiled first (in a
    child process, under the machine's lock for it)."""
    path = package_path(fn, static, shapes, options)
    if not os.path.exists(path):
        _compile(path, {"module": fn.__module__, "kernel": fn.__name__, "static": static, "shapes": shapes,
                        "options": options, "path": path})
    with open(path + ".json") as meta:
        mins = json.load(meta)["mins"]
    return Package(torch._inductor.aoti_load_package(path), mins)


_CHILDREN: set = set()


_HELD: set = set()  # lock files this process holds (removed at exit too)


def _compile(path: str, spec: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = path + ".lock"
    while not os.path.exists(path):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # another process compiles it: wait for its file, or take a dead one's lock over
            if _dead(lock):
                _remove(lock)
            time.sleep(0.2)
            continue
        _HELD.add(lock)
        with os.fdopen(fd, "w") as holder:
            holder.write(f"{socket.gethostname()} {os.getpid()}")
        try:
            spawn([sys.executable, "-m", __name__, json.dumps(spec)])
        finally:
            _remove(lock)
            _HELD.discard(lock)


def _dead(lock: str) -> bool:
    """Whether the process that wrote ``lock`` is gone: on this host and not running, or its lock older than
    :data:`STALE_LOCK_S` (another host's, on a shared file system)."""
    try:
        with open(lock) as holder:
            host, pid = holder.read().split()
    except (OSError, ValueError):  # gone, or written only in part: its holder may still be writing it
        return time.time() - _mtime(lock) > 1
    if host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError):  # alive, another user's
            return False
        return False
    return time.time() - _mtime(lock) > STALE_LOCK_S


def spawn(argv: list) -> None:
    """Run the compiling child (a test replaces this); raises with its last line of output if it fails."""
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _CHILDREN.add(child)
    try:
        output, _ = child.communicate(timeout=COMPILE_TIMEOUT_S)
    finally:
        _CHILDREN.discard(child)
    if child.returncode:
        lines = [line for line in output.strip().splitlines() if line.strip()]
        raise RuntimeError(f"compiling a kernel ahead failed: {lines[-1] if lines else child.returncode}")


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return time.time()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# -- the background thread -------------------------------------------------------------------------------

_JOBS: list = []  # the queue, made (with its thread) on first use
_EXITING = threading.Event()


def submit(job: Callable[[], None]) -> None:
    """Run ``job`` on the background thread, after the ones queued before it."""
    if not _JOBS:
        jobs: queue.Queue = queue.Queue()
        threading.Thread(target=_work, args=(jobs,), name="gradzip-ahead", daemon=True).start()
        _JOBS.append(jobs)
    _JOBS[0].put(job)


def _work(jobs: queue.Queue) -> None:
    while True:
        job = jobs.get()
        try:
            if not _EXITING.is_set():
                job()
        finally:
            jobs.task_done()


def exiting() -> bool:
    """Whether the process is exiting (its compiling child stopped on purpose: not a failure to report)."""
    return _EXITING.is_set()


def settle() -> None:
    """Wait until every job queued so far has finished."""
    if _JOBS:
        _JOBS[0].join()


@atexit.register
def _exit() -> None:  # a queued job is not started, a running child is stopped: the process does not wait
    _EXITING.set()
    for child in list(_CHILDREN):
        child.kill()
    for lock in list(_HELD):
        _remove(lock)


def _forked() -> None:  # a forked copy (a data loader's worker) owns neither the parent's children nor its locks
    _CHILDREN.clear()
    _HELD.clear()
    _JOBS.clear()  # nor its thread: a job of the copy's own starts one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


# -- the child ---------------------------------------------------------------------------------------------


def _main(spec: dict) -> None:
    """Export the kernel ``spec`` names on zero tensors of its form, every larger size symbolic, and
    compile it into ``spec["path"]`` (written whole or not at all), its sizes' least values beside it."""
    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    fn, static = kernel.fn, spec["static"]
    args = tuple(torch.zeros([d if d >= 0 else _EXAMPLE + _APART * (-1 - d) for d in dims],
                             dtype=getattr(torch, dtype), device=device) for dtype, device, dims in spec["shapes"])
    dynamic = tuple({i: torch.export.Dim.AUTO for i, d in enumerate(dims) if d < 0} or None
                    for _, _, dims in spec["shapes"])

    class Wrapped(torch.nn.Module):
        def forward(self, *tensors):
            return fn(*tensors, **static)

    exported = torch.export.export(Wrapped(), args, dynamic_shapes=(dynamic,), strict=False)
    mins = []
    for (_, _, dims), node in zip(spec["shapes"], [n for n in exported.graph.nodes if n.op == "placeholder"]):
        low = []
        for d, size in zip(dims, node.meta["val"].shape):
            if d < 0 and not isinstance(size, torch.SymInt):  # the code fixed a size: no package serves all
                raise RuntimeError(f"{spec['kernel']} specialises a size to {size}")
            low.append(int(exported.range_constraints[size.node.expr].lower) if d < 0 else d)
        mins.append(low)
    part = spec["path"].removesuffix(".pt2") + f".{os.getpid()}.part.pt2"
    torch._inductor.aoti_compile_and_package(exported, package_path=part, inductor_configs=spec["options"])
    with open(spec["path"] + ".json", "w") as meta:
        json.dump({"mins": mins, "kernel": spec["kernel"], "static": static, "shapes": spec["shapes"]}, meta)
    os.replace(part, spec["path"])


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))

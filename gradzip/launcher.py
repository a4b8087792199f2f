"""Launching local worker processes: a rendezvous port, a fork server that starts them, a watchdog over
them, and :func:`run_workers`, which runs a function in N gloo processes and returns their results.

The trainer, the cost model's link calibration, the benchmarks and the multi-process tests launch
workers with it.  It imports only torch and the standard library (and :mod:`gradzip.netem` when asked to
emulate a network), so anything may import it without pulling in the rest of gradzip.
"""
from __future__ import annotations

import atexit
import os
import socket
import tempfile
import time
import traceback
from multiprocessing import connection as mp_connection
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "worker_context", "start_worker", "wait_for_workers", "run_workers"]


def free_port() -> int:
    """A free TCP port on loopback, for a local process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Environment variables read once, as the interpreter starts or torch and its libraries load (TorchDynamo's
#: and Inductor's configuration included): the fork server has them as they were when it started, so a
#: worker whose caller has changed one since is spawned instead.
_READ_AT_START = ("PYTHON", "LD_", "OMP_", "GOMP_", "MKL_", "TORCH_LOGS", "TORCH_DISTRIBUTED_DEBUG",
                  "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "TORCHDYNAMO_", "TORCH_DYNAMO_",
                  "TORCH_COMPILE", "TORCHINDUCTOR_", "INDUCTOR_", "TORCH_CACHING_PRECOMPILE", "TORCH_FAKE_TENSOR",
                  "TORCH_STRICT_PRECOMPILE")
#: But not those torch sets itself as it runs (and KMP_*, which no prefix above takes).
_SET_AS_TORCH_RUNS = ("TORCHINDUCTOR_CACHE_DIR",)
_SERVER_ENVIRONMENT: dict = {}


def _read_at_start() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_START) and k not in _SET_AS_TORCH_RUNS}


def worker_context():
    """The multiprocessing context local workers start from: a fork server that has imported torch (with
    TorchDynamo, which every optimizer imports) and gradzip once, for this process's lifetime.

    A freshly spawned interpreter spends seconds of a core importing torch before a worker does anything;
    one forked from the server starts at once.  The server never runs a kernel, touches a device or starts
    a thread pool, so a worker inherits nothing but imported modules (CUDA may be used in it, unlike after
    a plain fork).  Start workers with :func:`start_worker`, which hands them this process's environment
    and runs their exit handlers.  Spawned interpreters instead where there is no fork server (Windows),
    or where what the server read as it started has changed since (``_READ_AT_START``).  A worker's
    standard output and error are the server's: this process's as they were when it started.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    now = _read_at_start()
    if _SERVER_ENVIRONMENT.setdefault("started", now) != now:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: PyTorch's optimizers import it as they are built (add_param_group is wrapped by
    # torch._disable_dynamo, which imports it at its first call), 2-3 s of a core in every worker that
    # builds one.  A server already running keeps what it has.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "gradzip"])
    return ctx


def _in_environment(environment: dict, forked: bool, target: Callable, args: tuple):
    # A worker runs in its caller's environment as of its start, as a spawned one would.
    os.environ.clear()
    os.environ.update(environment)
    try:
        return target(*args)
    finally:
        if forked:  # a fork server's child ends by os._exit: its exit handlers (gradzip closes its states
            atexit._run_exitfuncs()  # and stops its compiles there) are run here, as interpreter exit would


def start_worker(target: Callable, args: tuple = (), ctx=None):
    """Start ``target(*args)`` in a process of :func:`worker_context` (``ctx``, if already made), with
    this process's current environment; returns the started process.  ``target`` must be importable."""
    ctx = ctx or worker_context()
    process = ctx.Process(target=_in_environment,
                          args=(dict(os.environ), ctx.get_start_method() == "forkserver", target, args))
    process.start()
    return process


def wait_for_workers(procs: Sequence, timeout: Optional[float],
                     stalled: Optional[Callable[[], bool]] = None) -> bool:
    """Wait for worker processes; returns False if ``timeout`` seconds passed first.

    As soon as one worker exits with an error the others are killed: they would wait forever in a
    collective for their dead peer.  At the deadline every worker still running is killed too, and so
    they are as soon as ``stalled()``, asked about once a second, says they have stopped making progress.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        running = list(procs)
        while running:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if stalled is not None:
                left = 1.0 if left is None else min(left, 1.0)
            if not mp_connection.wait([p.sentinel for p in running], timeout=left):
                if (deadline is not None and time.monotonic() >= deadline) or (stalled is not None and stalled()):
                    return False
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode for p in procs):
                break
        return True
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def _entry(rank, world, address, port, namespace, out_dir, fn, args):
    try:
        if namespace is not None:
            from .netem import INTERFACE, enter_namespace

            enter_namespace(namespace)  # before any socket: gloo's threads inherit the namespace
            os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the trainer: workers share cores
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_workers(fn: Callable, workers: int, *args, netem: Optional[str] = None, timeout: float = 300.0,
                every_rank: bool = False):
    """Run ``fn(rank, workers, *args)`` in ``workers`` gloo processes (:func:`start_worker`) and return rank 0's result
    (``every_rank``: the list of every rank's result).

    With ``netem`` (e.g. "rate=1gbit") every worker runs in its own network namespace of an
    :class:`~gradzip.netem.EmulatedCluster` (root); without, over loopback.  ``fn`` must be importable
    (a module-level function).  A failed or hung worker stops all of them and raises RuntimeError.
    """
    if netem is None:
        results = _spawn(fn, workers, args, None, timeout)
    else:
        from .netem import EmulatedCluster, parse_netem

        with EmulatedCluster(workers, parse_netem(netem)) as cluster:
            results = _spawn(fn, workers, args, cluster, timeout)
    return results if every_rank else results[0]


def _spawn(fn, workers, args, cluster, timeout):
    address = cluster.address(0) if cluster else "127.0.0.1"
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [start_worker(_entry, (r, workers, address, port, cluster.namespace(r) if cluster else None,
                                       out_dir, fn, args))
                 for r in range(workers)]
        finished = wait_for_workers(procs, timeout)
        # The first traceback written is the cause; the others are ranks that lost their peer.
        errors = sorted((os.path.join(out_dir, name) for name in os.listdir(out_dir) if name.startswith("error")),
                        key=os.path.getmtime)
        if errors:
            raise RuntimeError("a worker failed:\n" + open(errors[0]).read())
        if not finished or any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"workers did not finish within {timeout:.0f} s "
                               f"(exit codes {[p.exitcode for p in procs]})")
        return [torch.load(os.path.join(out_dir, f"result{r}.pt"), weights_only=True) for r in range(workers)]

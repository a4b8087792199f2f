"""Launch real multi-process torch.distributed (gloo) jobs from tests, with a hard timeout."""
from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradzip.collectives import free_port



def _entry(rank, world_size, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_workers(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return their results."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, out_dir, fn, args)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"error{r}.txt")
            if os.path.exists(path):
                errors.append(f"rank {r}:\n" + open(path).read())
        if errors:
            raise AssertionError("worker failed\n" + "\n".join(errors))
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout}s (hang)")
        return [torch.load(os.path.join(out_dir, f"result{r}.pt"), weights_only=False) for r in range(world_size)]

"""Launch real multi-process torch.distributed (gloo) jobs from tests, with a hard timeout."""
from __future__ import annotations

from gradzip.launcher import run_workers as _run_workers


def run_workers(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return every rank's result.

    :func:`gradzip.launcher.run_workers` with the tests' defaults: every rank's result, and a 240 s timeout.
    A failing rank stops the others at once and its traceback is raised; so is a hang, at ``timeout``.
    """
    return _run_workers(fn, world_size, *args, timeout=timeout, every_rank=True)

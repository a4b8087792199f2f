"""What a kernel compiled in-process on gradzip's thread does to the training thread beside it, on CPU.

1. ``torch.compiler.is_compiling()`` while another thread compiles: how often the training thread sees
   it true, and how far AdamW's steps taken meanwhile end from the same steps without a compiling
   thread (PyTorch's optimizers branch on the flag).
2. Python's lock: how many iterations a second the training thread's Python loop makes while another
   thread runs a kernel over 2^24 elements (eager operations, a kernel ``torch.compile`` made, the same
   kernel as an AOTInductor package) or sleeps.

    python benchmarks/compiling_thread.py

Notes for docs/architecture.md's kernels section, not a benchmark of gradzip's speed.
"""
from __future__ import annotations

import tempfile
import threading
import time

import torch


def adamw_beside_compiles(steps: int = 3000) -> tuple:
    """(polls that saw the flag, steps, max |difference| of the parameters)."""
    def run(compiling: bool):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1000))
        opt = torch.optim.AdamW([p], lr=1e-3)
        stop = threading.Event()

        def compile_again_and_again():
            i = 0
            while not stop.is_set():
                torch._dynamo.reset()
                torch.compile(lambda x: (x * 2 + i).sin(), fullgraph=True)(torch.randn(100))
                i += 1
        worker = threading.Thread(target=compile_again_and_again)
        if compiling:
            worker.start()
        seen = 0
        for s in range(steps):
            p.grad = torch.randn(1000, generator=torch.Generator().manual_seed(s))
            seen += torch.compiler.is_compiling()
            opt.step()
            time.sleep(0.0005)
        stop.set()
        if compiling:
            worker.join()
        return p.detach().clone(), seen

    alone, _ = run(False)
    beside, seen = run(True)
    return seen, steps, float((alone - beside).abs().max())


def python_rate_beside(numel: int = 1 << 24) -> dict:
    """Million iterations a second of the training thread's loop beside another thread's work."""
    torch.set_num_threads(1)

    def kernel(x):
        return ((x * 2 + 1).sin() * x).cos()

    class Module(torch.nn.Module):
        def forward(self, x):
            return kernel(x)

    x = torch.randn(numel)
    compiled = torch.compile(kernel, fullgraph=True)
    compiled(x)
    path = tempfile.mkdtemp() + "/kernel.pt2"
    package = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(
        torch.export.export(Module(), (x,)), package_path=path))
    package(x)

    def rate(job) -> float:
        worker = threading.Thread(target=job)
        start = time.perf_counter()
        worker.start()
        n = 0
        while worker.is_alive():
            n += 1
        return n / (time.perf_counter() - start) / 1e6

    return {"idle thread": rate(lambda: time.sleep(0.5)),
            "eager operations": rate(lambda: [kernel(x) for _ in range(5)]),
            "torch.compile kernel": rate(lambda: [compiled(x) for _ in range(5)]),
            "AOTInductor package": rate(lambda: [package(x) for _ in range(5)])}


def main() -> None:
    seen, steps, difference = adamw_beside_compiles()
    print(f"AdamW beside a compiling thread: the flag seen at {seen} of {steps} steps; "
          f"parameters {difference:.3g} away from the same steps alone")
    for name, value in python_rate_beside().items():
        print(f"training thread's Python beside {name}: {value:.2f} million iterations a second")


if __name__ == "__main__":
    main()

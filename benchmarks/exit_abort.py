"""How often a finished DDP job aborts at interpreter exit (SIGABRT, "terminate called without an active
exception"), with or without gradzip.

    python3 benchmarks/exit_abort.py --method plain --repeat 50     # plain DDP, no gradzip
    python3 benchmarks/exit_abort.py --method topk --repeat 50      # + gradzip.register(ddp, "topk")

Each repeat is one ``torchrun --nproc-per-node 2`` launch (gloo) of this file as a worker: 5 steps of a
small MLP, then ``destroy_process_group()``.  The abort is a race with interpreter finalisation, so it
shows mostly on a busy machine; docs/results/real_stacks.md says what ran beside the measured launches.
"""
import argparse
import os
import subprocess
import sys
import tempfile


def worker(method: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    if method != "plain":
        import gradzip

        gradzip.register(ddp, method, **({"ratio": 0.1} if method == "topk" else {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        ddp(torch.randn(8, 64)).sum().backward()
        opt.step()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="plain", help="plain (no gradzip) or a gradzip method")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.method)
    from gradzip.launcher import free_port  # the launcher only: a plain worker never imports gradzip

    failed = aborted = 0
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as logs:  # torchrun's own would stay in the temporary directory
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "--log-dir", logs, "--master-port", str(free_port()), __file__,
                                   "--worker", "--method", args.method],
                                  capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            failed += 1
            aborted += "terminate called without an active exception" in proc.stderr + proc.stdout
    print(f"{args.method}: {failed} of {args.repeat} launches failed, {aborted} of them with the abort at exit")


if __name__ == "__main__":
    main()

"""The PyTorch DDP tutorial's script with ``gradzip.register`` added, one torchrun launch (2 workers,
gloo) per method: it must exit with code 0 (an abort at interpreter exit fails it) and end with
bit-identical parameters on both ranks.  The default run launches it for five methods of different
ways of exchanging (a launch costs some 10 s of starting processes on 2 cores; every method also runs
under torchrun in test_gpt_features' launches); GRADZIP_SLOW=1 adds the other methods, and launches it 50
times per method counting the failed launches (target: none).
"""
import pytest
import torch

from .launch import identical_across_ranks, torchrun
from .methods import METHODS, params


def launch_tutorial(method, out, *extra, nproc=2):
    args = [f"--param={k}={v!r}" for k, v in params(method).items()]
    return torchrun("ddp_tutorial.py", "--method", method, *args, "--out", out, *extra, nproc=nproc, timeout=120,
                    log=out / "launch.log")


def check_tutorial_run(method, out, launch, nproc=2):
    assert launch.ok, launch.describe()
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]
    diff = identical_across_ranks([r["final"] for r in ranks])
    assert not diff, f"{method}: final parameters differ between ranks:\n" + "\n".join(diff)
    for r, result in enumerate(ranks):
        assert all(torch.isfinite(torch.tensor(result["losses"]))), f"rank {r} losses {result['losses']}"
        assert any(not torch.equal(result["initial"][k], v) for k, v in result["final"].items()), "nothing trained"
        stats = result["stats"]
        assert stats["exchanges"] > 0 and stats["world_size"] == nproc, f"rank {r}: gradzip's stats {stats}"


#: DDP's own allreduce, the hook's C++ allreduce of a cast, sparse pairs gathered, chained low-rank
#: phases, packed codes on the bucket route (the other ways run in test_gpt_features' launches).
TUTORIAL = ("none", "fp16", "topk", "powersgd", "qsgd")


@pytest.mark.parametrize("method", [m if m in TUTORIAL else pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def test_tutorial_script(method, tmp_path):
    check_tutorial_run(method, tmp_path, launch_tutorial(method, tmp_path))


def test_tutorial_script_registering_the_compiled_ddp_model(tmp_path):
    """``gradzip.register(torch.compile(DDP(model)), ...)``: the hook goes on the DDP inside, and DDP's
    buckets go through it (compiling after ``register`` runs in test_gpt_features' launches)."""
    check_tutorial_run("topk", tmp_path, launch_tutorial("topk", tmp_path, "--compile", "before-register"))
    for r in range(2):
        stats = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["stats"]
        assert stats["plain_allreduces"] == 0 and stats["density"] < 0.5, f"rank {r}: not Top-k's exchange: {stats}"


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_tutorial_script_50_times_without_an_abort(method, tmp_path):
    failed = []
    for i in range(50):
        out = tmp_path / str(i)
        out.mkdir()
        launch = launch_tutorial(method, out)
        if not launch.ok:
            failed.append(launch)
    aborts = sum(launch.aborted for launch in failed)
    assert not failed, (f"{method}: {len(failed)} of 50 launches failed, {aborts} of them with SIGABRT; "
                        f"the first:\n{failed[0].describe()}")

"""One checkpoint file for all ranks, written by rank 0 alone (nanoGPT's way), and resuming it on
another number of ranks: ``scripts/rank0_checkpoint.py`` under torchrun.

- 2 ranks, interrupted and resumed on 2: the final parameters equal the uninterrupted run's bit for
  bit (Top-k with residuals, PowerSGD with its error and shared basis).
- saved on 2 and resumed on 3, saved on 3 and resumed on 2: the error feedback owed after the resume
  (the mean over the new ranks of each residual) equals what the saved ranks owed, and training goes on
  from the checkpoint's loss rather than from a fresh start.
- ``register(resume=...)`` with no such file ends the job with gradzip's one-line error.
"""
import json

import pytest
import torch

from .launch import torchrun

METHODS = ("topk", "powersgd")
STEPS, SAVE_AT = 12, 6


def _run(tmp, name, nproc, *args):
    out = tmp / name
    launch = torchrun("rank0_checkpoint.py", "--out", out, "--steps", STEPS, *args, nproc=nproc, timeout=300)
    assert launch.ok, launch.describe()
    return out


def _reports(out, method, nproc):
    return [json.loads((out / f"{method}.rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chars):
    tmp = tmp_path_factory.mktemp("rank0")
    full2 = _run(tmp, "full2", 2)
    part2 = _run(tmp, "part2", 2, "--save-at", SAVE_AT)
    part3 = _run(tmp, "part3", 3, "--save-at", SAVE_AT)
    return {"full2": full2, "part2": part2, "part3": part3,
            "2to2": _run(tmp, "2to2", 2, "--resume", part2),
            "2to3": _run(tmp, "2to3", 3, "--resume", part2),
            "3to2": _run(tmp, "3to2", 2, "--resume", part3)}


@pytest.mark.parametrize("method", METHODS)
def test_rank0_file_resumes_bit_for_bit(runs, method):
    full = _reports(runs["full2"], method, 2)
    resumed = _reports(runs["2to2"], method, 2)
    assert full[0]["exchanges"] > 0 and resumed[0]["exchanges"] > 0
    for a, b in zip(full, resumed):
        assert a["params"] == b["params"], f"rank {a['rank']}: resumed parameters differ from the uninterrupted run's"
    assert resumed[0]["params"] == resumed[1]["params"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("saved_on, resumed_as", [("part2", "2to3"), ("part3", "3to2")])
def test_resume_on_another_world_size_conserves_what_is_owed(runs, method, saved_on, resumed_as):
    n_saved, n_new = (2, 3) if saved_on == "part2" else (3, 2)
    saved = _reports(runs[saved_on], method, n_saved)[0]["owed_saved"]
    new = _reports(runs[resumed_as], method, n_new)
    owed = new[0]["owed_resumed"]
    assert owed is not None and saved is not None and set(owed) == set(saved)
    nonzero = [k for k, v in saved.items() if any(abs(x) > 0 for x in v)]
    assert nonzero, "the saved state owed nothing: the test would prove nothing"
    for key, values in saved.items():
        assert owed[key] == pytest.approx(values, rel=1e-6, abs=1e-9), key
    assert all(r["params"] == new[0]["params"] for r in new[1:]), "ranks disagree after the resume"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("saved_on, resumed_as", [("part2", "2to3"), ("part3", "3to2")])
def test_resumed_run_goes_on_from_the_checkpoint(runs, method, saved_on, resumed_as):
    """The first losses after the resume continue the saved run's (a fresh model starts near ln(vocab))."""
    full = _reports(runs["full2"], method, 2)[0]["losses"]
    resumed = _reports(runs[resumed_as], method, 2 if resumed_as == "3to2" else 3)[0]["losses"]
    assert len(resumed) >= STEPS - SAVE_AT
    tail = len(resumed)
    assert resumed[-1] == pytest.approx(full[-1], rel=0.15)
    assert sum(resumed) / tail < 0.95 * sum(full[:tail]) / tail  # far below the fresh start's losses


def test_resume_from_a_checkpoint_without_gradzip_state_is_an_error(runs, tmp_path):
    """A model/optimizer checkpoint saved without gradzip's state does not resume as a fresh state silently."""
    checkpoint = torch.load(runs["part2"] / "topk.ckpt.pt", weights_only=True)
    del checkpoint["gradzip"]
    (tmp_path / "ckpt").mkdir()
    torch.save(checkpoint, tmp_path / "ckpt" / "topk.ckpt.pt")
    launch = torchrun("rank0_checkpoint.py", "--out", tmp_path / "out", "--methods", "topk", "--resume",
                      tmp_path / "ckpt", nproc=2, timeout=120, log=tmp_path / "log")
    assert not launch.ok
    assert "holds no gradzip state_dict" in launch.output, launch.describe()

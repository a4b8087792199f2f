"""`gradzip train` end to end: real worker processes, real data (scikit-learn digits), real files."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import gradzip
from gradzip.cli import app, parse_params
from gradzip.launcher import free_port

STEP_FIELDS = {"kind", "epoch", "step", "loss", "accuracy", "lr", "density", "bytes_sent", "payload_bytes",
               "dense_bytes", "ratio", "step_s", "compute_s", "compress_s", "communicate_s", "decompress_s",
               "wall_s"}
EPOCH_FIELDS = {"kind", "epoch", "step", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "epoch_s",
                "wall_s", "lr", "density", "bytes_sent", "payload_bytes", "dense_bytes", "ratio"}
SUMMARY_FIELDS = {"final_test_accuracy", "time_to_target_s", "epochs_to_target", "total_bytes_sent", "mean_ratio",
                  "mean_density", "mean_bits_per_element", "wall_s", "mean_step_s", "mean_compute_s", "mean_compress_s",
                  "mean_communicate_s", "mean_decompress_s"}
DIGITS = ["--dataset", "digits", "--model", "mlp", "--batch-size", "16", "--no-progress", "--lr", "0.05"]


def _train(tmp_path, *args):
    result = CliRunner().invoke(app, ["train", *DIGITS, "--out-dir", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    return result


def _final_params(run: Path, rank: int = 0) -> dict:
    steps = sorted(run.glob(f"checkpoint-rank{rank}-step*.pt"), key=lambda p: int(p.stem.rsplit("step", 1)[1]))
    return torch.load(steps[-1], weights_only=True)["model"]  # as the trainer loads them: no pickled code


def test_parse_params_types_values():
    assert parse_params(["ratio=0.01", "nesterov=true", "value_dtype=float16", "clip_norm=none", "rank=2"]) == {
        "ratio": 0.01, "nesterov": True, "value_dtype": "float16", "clip_norm": None, "rank": 2}


def test_train_writes_every_metric_summary_and_tensorboard(tmp_path):
    _train(tmp_path, "-c", "dgc", "-p", "ratio=0.05", "-p", "min_numel=256", "--epochs", "2", "--target", "0.5",
           "--name", "run")
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(epochs) == 2 and len(steps) == 2 * (1437 // 2 // 16)
    assert all(STEP_FIELDS <= set(r) for r in steps) and all(EPOCH_FIELDS <= set(r) for r in epochs)
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    # DGC's warm-up (4 epochs by default): density 25% in epoch 0, 6.25% in epoch 1 for compressed tensors.
    assert epochs[0]["density"] > epochs[1]["density"] > 0
    assert all(r["bytes_sent"] > 0 and r["ratio"] > 1 for r in steps)
    summary = json.loads((run / "summary.json").read_text())
    assert SUMMARY_FIELDS <= set(summary)
    assert summary["final_test_accuracy"] == epochs[-1]["test_accuracy"] > 0.5
    assert summary["epochs_to_target"] in (1, 2) and summary["time_to_target_s"] > 0
    assert summary["total_bytes_sent"] == sum(r["bytes_sent"] for r in steps)
    # Passes over the 1437 training samples: 44 steps per epoch of 16 per worker, 2 workers.
    assert [e["passes"] for e in epochs] == [44 * 32 / 1437, 88 * 32 / 1437]
    assert (summary["train_samples"], summary["passes"]) == (1437, 88 * 32 / 1437)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_continues_exactly(tmp_path):
    _train(tmp_path / "a", "-c", "topk", "-p", "ratio=0.1", "--epochs", "2", "--name", "r")
    _train(tmp_path / "b", "-c", "topk", "-p", "ratio=0.1", "--epochs", "1", "--name", "r")
    _train(tmp_path / "b", "-c", "topk", "-p", "ratio=0.1", "--epochs", "2", "--name", "r", "--resume")
    whole, resumed = _final_params(tmp_path / "a" / "r"), _final_params(tmp_path / "b" / "r")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    a = (tmp_path / "a" / "r" / "metrics.jsonl").read_text().splitlines()
    b = (tmp_path / "b" / "r" / "metrics.jsonl").read_text().splitlines()
    assert len(a) == len(b)


def test_bad_input_is_one_clear_line(tmp_path):
    result = CliRunner().invoke(app, ["train", "--dataset", "mnist", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--data-dir" in result.output
    result = CliRunner().invoke(app, ["train", *DIGITS, "-c", "topk", "-p", "ratoi=1", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "valid: ratio" in result.output
    result = CliRunner().invoke(app, ["train", *DIGITS, "--optimizer", "adam", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "optimizer must be one of sgd, adamw, got 'adam'" in result.output
    result = CliRunner().invoke(app, ["train", *DIGITS, "--group-vectors-below", "-1", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "group_vectors_below must be an integer >= 0, got -1" in result.output
    adamw_dgc = ["--optimizer", "adamw", "-c", "dgc"]
    result = CliRunner().invoke(app, ["train", *DIGITS, *adamw_dgc, "--out-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "'dgc' applies momentum itself and AdamW applies its own: use --optimizer sgd" in result.output
    # The model is checked in the launcher too, not in each worker.
    result = CliRunner().invoke(app, ["train", "--model", "gpt", "--dataset", "digits", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "model 'gpt' is for language_model data" in result.output
    assert not list(tmp_path.iterdir()), "a refused run wrote files"


def _config(**kwargs):
    from gradzip.harness.trainer import TrainConfig

    return TrainConfig(model="mlp", dataset="digits", momentum=0.7, lr=0.05, weight_decay=1e-4, **kwargs)


def _optimizer(config, weights):
    """The run's optimizer and the parameters its compressor was built with, as the worker builds them."""
    from gradzip.harness.trainer import _compressor, _optimizer

    compressor, params = _compressor(config)
    return _optimizer(config, weights, compressor), params


def test_sgd_momentum_only_for_methods_that_do_not_apply_their_own():
    weights = [torch.nn.Parameter(torch.zeros(3))]
    opt, params = _optimizer(_config(compressor="topk", params={"ratio": 0.1}), weights)
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.7 and params == {"ratio": 0.1}
    # DGC's momentum correction: the run's momentum goes to DGC, none to SGD; an explicit one is kept.
    opt, params = _optimizer(_config(compressor="dgc"), weights)
    assert opt.defaults["momentum"] == 0.0 and params == {"momentum": 0.7}
    from gradzip.harness.trainer import _compressor

    assert _compressor(_config(compressor="dgc"))[0].momentum == 0.7  # the built instance has it
    assert _optimizer(_config(compressor="dgc", params={"momentum": 0.5}), weights)[1] == {"momentum": 0.5}
    for name in gradzip.compressors():
        opt, params = _optimizer(_config(compressor=name), weights)
        own = gradzip.make(name).applies_momentum  # DGC and Signum
        assert opt.defaults["momentum"] == (0.0 if own else 0.7), name
        assert ("momentum" in params) == (own and "momentum" in gradzip.parameters_of(name)), name


def test_adamw_takes_the_runs_lr_and_weight_decay_and_refuses_methods_with_momentum():
    weights = [torch.nn.Parameter(torch.zeros(3))]
    opt, params = _optimizer(_config(optimizer="adamw", compressor="powersgd"), weights)
    assert type(opt) is torch.optim.AdamW and params == {}
    assert (opt.defaults["lr"], opt.defaults["weight_decay"], opt.defaults["betas"]) == (0.05, 1e-4, (0.9, 0.999))
    for name in gradzip.compressors():
        if gradzip.make(name).applies_momentum:
            with pytest.raises(ValueError, match=f"'{name}' applies momentum itself .* use --optimizer sgd$"):
                _config(optimizer="adamw", compressor=name)
        else:
            _config(optimizer="adamw", compressor=name)


def test_gpt_on_chars_trains_with_adamw_and_topk_and_resumes_exactly_from_a_weights_only_checkpoint(tmp_path):
    args = ["train", "--model", "gpt", "--dataset", "chars", "-n", "2", "-c", "topk", "-p", "ratio=0.05",
            "--optimizer", "adamw", "--lr", "0.003", "--seq-len", "32", "--batch-size", "8", "--max-steps", "5",
            "--test-size", "16", "--epochs", "2", "--no-progress", "--name", "gpt"]
    result = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path / "whole")])
    assert result.exit_code == 0, result.output
    run = tmp_path / "whole" / "gpt"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    vocab = len(torch.load(run / "checkpoint-rank0-step10.pt", weights_only=True)["model"]["tok.weight"])
    assert len(steps) == 10 and abs(steps[0]["loss"] - math.log(vocab)) < 0.1  # starts at chance
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    assert all(abs(r["density"] - 0.05) < 0.005 and r["ratio"] > 5 for r in steps)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["optimizer"] == "adamw" and summary["score"] == "test_perplexity"
    assert summary["final_score"] < vocab
    saved = torch.load(run / "checkpoint-rank1-step10.pt", weights_only=True)
    assert saved["optimizer"]["state"][0]["exp_avg"].shape == saved["model"]["tok.weight"].shape  # AdamW's
    assert any("residual" in slot for slot in saved["gradzip"]["tensors"].values())

    _resume_after_epoch_1_gives_the_same_run(args, run, tmp_path / "cut")


def test_gpt_with_grouped_vectors_under_the_optimizer_wrapper_resumes_exactly(tmp_path):
    """--group-vectors-below: the checkpointed state holds the groups' residuals, and DistributedOptimizer's
    buckets (and so its groups) are the same after a restart, so the resumed run is the whole run."""
    args = ["train", "--model", "gpt", "--dataset", "chars", "-n", "2", "-c", "topk", "-p", "ratio=0.05",
            "--integration", "optimizer", "--group-vectors-below", "65536", "--optimizer", "adamw", "--lr", "0.003",
            "--seq-len", "32", "--batch-size", "8", "--max-steps", "5", "--test-size", "16", "--epochs", "2",
            "--no-progress", "--name", "grouped"]
    result = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path / "whole")])
    assert result.exit_code == 0, result.output
    run = tmp_path / "whole" / "grouped"
    assert json.loads((run / "summary.json").read_text())["group_vectors_below"] == 65536
    tensors = torch.load(run / "checkpoint-rank0-step5.pt", weights_only=True)["gradzip"]["tensors"]
    groups = [key for key in tensors if key.startswith("vectors[")]
    assert groups and all("residual" in tensors[key] for key in groups)
    assert not any(key.endswith(".bias") for key in tensors)
    _resume_after_epoch_1_gives_the_same_run(args, run, tmp_path / "cut")


def _resume_after_epoch_1_gives_the_same_run(args, run: Path, out: Path, steps: int = 5, ranks: int = 2):
    """``run`` (2 epochs of ``steps`` steps, made by ``args``) killed after epoch 1: its epoch-1 checkpoints,
    resumed into ``out``, give epoch 2 bit for bit, on every rank."""
    cut = out / run.name
    cut.mkdir(parents=True)
    for rank in range(ranks):
        name = f"checkpoint-rank{rank}-step{steps}.pt"
        (cut / name).write_bytes((run / name).read_bytes())
    (cut / "metrics.jsonl").write_text("".join(line + "\n" for line in (run / "metrics.jsonl").read_text()
                                               .splitlines()[:steps + 1]))
    result = CliRunner().invoke(app, [*args, "--out-dir", str(out), "--resume"])
    assert result.exit_code == 0, result.output
    for rank in range(ranks):
        whole, resumed = _final_params(run, rank), _final_params(cut, rank)
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), f"rank {rank}"
    assert [r["loss"] for r in _steps(cut)] == [r["loss"] for r in _steps(run)] and len(_steps(cut)) == 2 * steps


def _steps(run: Path) -> list:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "step"]


def test_outer_loop_trains_replicas_with_diloco_and_resumes_exactly_mid_period(tmp_path):
    """--outer: no DDP, each rank its own replica and AdamW, DiLoCo's top-k pseudo-gradient every 3 steps
    in 2 staggered fragments; the epoch-1 checkpoint (step 5) falls inside a period."""
    args = ["train", "--model", "gpt", "--dataset", "chars", "-n", "2", "--outer", "diloco:sync_every=3,fragments=2",
            "-c", "topk", "-p", "ratio=0.1", "--optimizer", "adamw", "--lr", "0.003", "--seq-len", "32",
            "--batch-size", "8", "--max-steps", "5", "--test-size", "16", "--epochs", "2", "--no-progress",
            "--name", "outer"]
    result = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path / "whole")])
    assert result.exit_code == 0, result.output
    run = tmp_path / "whole" / "outer"
    steps = _steps(run)
    # Fragment 1 syncs at steps 1, 4, 7, 10, fragment 0 at 3, 6, 9: bytes only on those steps.
    assert [r["step"] for r in steps if r["bytes_sent"] > 0] == [1, 3, 4, 6, 7, 9, 10]
    assert [r["syncs"] for r in steps] == [1, 1, 2, 3, 3, 4, 5, 5, 6, 7]
    assert steps[-1]["bytes_per_inner_step"] == pytest.approx(sum(r["bytes_sent"] for r in steps) / 10)
    assert steps[-1]["bytes_per_inner_step"] < steps[-1]["ddp_bytes_per_inner_step"] / 5
    # It trains: the last five steps' mean loss, not one step's (a sync can bump one step's loss: on an
    # AVX2 machine step 10 went 3.41 -> 4.45 after fragment 1's sync; AVX-512's roundings did not).
    assert sum(r["loss"] for r in steps[-5:]) / 5 < steps[0]["loss"] - 0.3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outer"] == "diloco:sync_every=3,fragments=2" and summary["syncs"] == 7
    assert summary["evaluated"].startswith("theta_g") and summary["total_bytes_sent"] == sum(
        r["bytes_sent"] for r in steps)
    saved = [torch.load(run / f"checkpoint-rank{r}-step10.pt", weights_only=True) for r in (0, 1)]
    assert "gradzip" not in saved[0] and saved[0]["outer"]["inner_steps"] == 10
    theta = [s["outer"]["theta"] for s in saved]
    assert all(torch.equal(theta[0][k], theta[1][k]) for k in theta[0])  # theta_g: equal on every rank
    assert not all(torch.equal(saved[0]["model"][k], saved[1]["model"][k]) for k in theta[0])  # replicas: not
    _resume_after_epoch_1_gives_the_same_run(args, run, tmp_path / "cut")


def test_overlapped_outer_loop_resumes_exactly_with_an_exchange_in_flight(tmp_path):
    """overlap=true: the epoch-1 checkpoint (step 4) is taken while fragment 1's exchange, started at step 4,
    is in flight; it is saved as pending and merged at step 5 in the resumed run as in the whole one."""
    args = ["train", "--model", "gpt", "--dataset", "chars", "-n", "2", "--outer",
            "diloco:sync_every=3,fragments=2,overlap=true,merge_alpha=0.5", "-c", "topk", "-p", "ratio=0.1",
            "--optimizer", "adamw", "--lr", "0.003", "--seq-len", "32", "--batch-size", "8", "--max-steps", "4",
            "--test-size", "16", "--epochs", "2", "--no-progress", "--name", "overlap"]
    result = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path / "whole")])
    assert result.exit_code == 0, result.output
    run = tmp_path / "whole" / "overlap"
    saved = torch.load(run / "checkpoint-rank0-step4.pt", weights_only=True)["outer"]
    assert saved["pending"] == [1] and saved["pending_step"] == 4
    steps = _steps(run)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3 and steps[-1]["syncs"] == 5
    _resume_after_epoch_1_gives_the_same_run(args, run, tmp_path / "cut", steps=4)


def test_sigkilled_worker_restarts_under_torchrun_and_the_run_finishes_exactly(tmp_path):
    args = [*DIGITS, "-c", "topk", "-p", "ratio=0.1", "--epochs", "3", "--checkpoint-steps", "10",
            "--out-dir", str(tmp_path)]
    assert CliRunner().invoke(app, ["train", *args, "--name", "uninterrupted"]).exit_code == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
           "--log-dir", str(tmp_path / "torchrun"), "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "-m", "gradzip", "train", *args, "--name", "killed"]
    run = tmp_path / "killed"
    # Own session: on failure the whole tree (torchrun and its workers) is killed, leaving no orphans.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        killed = None
        while time.time() < deadline and killed is None:
            metrics = run / "metrics.jsonl"
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if len(lines) >= 25 and list(run.glob("checkpoint-rank1-step*.pt")):
                killed = int((run / "rank1.pid").read_text())
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        assert killed, "the run never reached step 25"
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    assert int((run / "rank1.pid").read_text()) != killed, "rank 1 was not restarted"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 3
    expected = _final_params(tmp_path / "uninterrupted")
    got = _final_params(run)
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resume after the kill was not exact"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, len(steps) + 1)), "metrics repeat or skip steps after the restart"


def test_a_run_past_its_timeout_is_stopped_and_reported(tmp_path):
    from gradzip.harness.trainer import TrainConfig, launch

    config = TrainConfig(model="mlp", dataset="digits", workers=2, epochs=50, timeout_s=1.0, progress=False,
                         out_dir=str(tmp_path), name="slow")
    start = time.time()
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        launch(config)
    assert time.time() - start < 30


def _signal_a_worker_after_steps(metrics: Path, sig: int, steps: int = 5):
    """Start a thread that sends ``sig`` to one worker once ``metrics`` holds ``steps`` step lines;
    returns the thread and a dict that gets the time it was sent ('at')."""
    import multiprocessing
    import threading

    sent = {}

    def send():
        deadline = time.time() + 120
        while time.time() < deadline:
            if metrics.exists() and metrics.read_text().count('"kind": "step"') >= steps:
                os.kill(multiprocessing.active_children()[-1].pid, sig)
                sent["at"] = time.time()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, sent


def test_a_frozen_peer_is_reported_as_hung_once_no_rank_makes_progress(tmp_path):
    """SIGSTOP one worker (a frozen host): the other blocks in its next allreduce, the ticks stop, and
    the launcher stops both after ``stall_s``, long before the overall timeout."""
    import multiprocessing

    from gradzip.harness.trainer import TrainConfig, launch

    config = TrainConfig(model="mlp", dataset="digits", workers=2, epochs=50, batch_size=16, timeout_s=300.0,
                         stall_s=3.0, progress=False, out_dir=str(tmp_path), name="frozen")
    thread, frozen = _signal_a_worker_after_steps(tmp_path / "frozen" / "metrics.jsonl", signal.SIGSTOP)
    with pytest.raises(TimeoutError, match="made no progress for 3 s"):
        launch(config)
    thread.join()
    assert "at" in frozen, "the run ended before a worker could be frozen"
    assert 3.0 < time.time() - frozen["at"] < 60.0
    assert multiprocessing.active_children() == [], "a worker outlived the launcher"


def test_a_crashed_worker_is_reported_with_the_signal_that_ended_it(tmp_path):
    """A worker that aborts (as a native crash does) is named with its rank and SIGABRT, not a bare -6;
    its peer is stopped too instead of waiting in the next allreduce."""
    import multiprocessing

    from gradzip.harness.trainer import TrainConfig, launch

    config = TrainConfig(model="mlp", dataset="digits", workers=2, epochs=50, batch_size=16, timeout_s=300.0,
                         progress=False, out_dir=str(tmp_path), name="crash")
    thread, aborted = _signal_a_worker_after_steps(tmp_path / "crash" / "metrics.jsonl", signal.SIGABRT)
    with pytest.raises(RuntimeError, match=r"rank \d: SIGABRT") as failure:
        launch(config)
    thread.join()
    assert "at" in aborted, "the run ended before a worker could be aborted"
    assert "once one fails the others are killed" in str(failure.value)
    assert multiprocessing.active_children() == [], "a worker outlived the launcher"


def test_the_stall_watch_is_armed_by_the_first_tick_and_reset_by_every_tick():
    from gradzip.harness.trainer import _StallWatch

    ticks = [0, 0]
    watch = _StallWatch(ticks, limit_s=0.05)
    time.sleep(0.1)
    assert not watch(), "start-up (no tick yet) is the overall timeout's business"
    ticks[1] += 1
    assert not watch()
    time.sleep(0.1)
    assert watch() and watch.fired
    ticks[0] += 1
    assert not watch() and not watch.fired


def test_exit_codes_read_as_exits_or_signal_names():
    from gradzip.harness.trainer import _exit_text

    assert _exit_text(0) == "exit 0"
    assert _exit_text(1) == "exit 1"
    assert _exit_text(-signal.SIGKILL) == "SIGKILL"
    assert _exit_text(-signal.SIGABRT) == "SIGABRT"
    assert _exit_text(-200) == "signal 200"


@pytest.mark.parametrize("key", ["timeout_s", "stall_s"])
@pytest.mark.parametrize("value", [0, -1.0, "10", True])
def test_time_limits_must_be_positive(key, value):
    from gradzip.harness.trainer import TrainConfig

    with pytest.raises(ValueError, match=f"{key} must be a number of seconds > 0"):
        TrainConfig(model="mlp", dataset="digits", **{key: value})

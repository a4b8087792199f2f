"""The harness around gradzip.DiLoCo: `--outer` specs and their one-line refusals, sweeps over H, and
`gradzip advise`'s outer-loop projection.  (Training with --outer, resumed: tests/test_train_cli.py; the
benchmark's contenders: tests/test_bench_e2e.py.)"""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from gradzip import costmodel as cost
from gradzip.advise import advise
from gradzip.cli import app
from gradzip.harness.trainer import TrainConfig, _compressor, _optimizer, parse_outer

DIGITS = ["train", "--dataset", "digits", "--model", "mlp", "--no-progress"]
KEYS = "valid keys: sync_every, fragments, outer_lr, outer_momentum, nesterov, overlap, merge_alpha"


def test_parse_outer_types_the_options_of_diloco():
    assert parse_outer("diloco:sync_every=50,fragments=4") == {"sync_every": 50, "fragments": 4}
    assert parse_outer(" diloco: sync_every = 8, outer_lr=1, outer_momentum=0.0, nesterov=false ") == {
        "sync_every": 8, "outer_lr": 1, "outer_momentum": 0.0, "nesterov": False}


@pytest.mark.parametrize("spec, message", [
    ("diloco", f"'diloco' needs sync_every=H .*; {KEYS}$"),
    ("localsgd:sync_every=5", "DiLoCo is the only outer loop"),
    ("diloco:sync_every=5,H=3", f"bad outer option 'H=3' in 'diloco:sync_every=5,H=3'; {KEYS} "),
    ("diloco:sync_every", f"bad outer option 'sync_every' .*; {KEYS} "),
    ("diloco:sync_every=0", "outer 'diloco:sync_every=0': sync_every must be an int >= 1, got 0$"),
    ("diloco:sync_every=2.5", "sync_every must be an int >= 1, got 2.5"),
    ("diloco:sync_every=5,outer_momentum=1", "outer_momentum must be a number with 0 <= outer_momentum < 1, got 1"),
    ("diloco:sync_every=5,outer_lr=-1", "outer_lr must be a number > 0"),
    ("diloco:sync_every=5,nesterov=1", "nesterov must be True or False, got 1"),
    ("diloco:sync_every=1,overlap=true", "overlap=True needs sync_every >= 2"),
    ("diloco:sync_every=4,merge_alpha=0.5", "merge_alpha .* needs overlap=True"),
    ("diloco:sync_every=4,overlap=true,merge_alpha=1", "merge_alpha must be a number with 0 <= merge_alpha < 1"),
])
def test_bad_outer_specs_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_outer(spec)
    assert "\n" not in str(error.value)


def test_outer_config_refusals_and_the_inner_optimizer():
    def config(**kwargs):
        return TrainConfig(model="mlp", dataset="digits", outer="diloco:sync_every=4", **kwargs)

    with pytest.raises(ValueError, match="outer replaces DDP and DistributedOptimizer"):
        config(integration="optimizer")
    with pytest.raises(ValueError, match="outer replaces DDP"):
        config(baseline="allreduce")
    with pytest.raises(ValueError, match="'dgc' applies momentum to the pseudo-gradient itself: add outer_momentum=0"):
        config(compressor="dgc")
    # DGC on the pseudo-gradient with AdamW inside is fine: they no longer act on the same gradients.
    dgc = TrainConfig(model="mlp", dataset="digits", outer="diloco:sync_every=4,outer_momentum=0",
                      compressor="dgc", optimizer="adamw")
    assert dgc.name == "mlp-digits-dgc-diloco_sync_every_4_outer_momentum_0-w2-s0"
    config = TrainConfig(model="mlp", dataset="digits", outer="diloco:sync_every=4,outer_momentum=0",
                         compressor="dgc", momentum=0.7)
    compressor, params = _compressor(config)
    opt = _optimizer(config, [torch.nn.Parameter(torch.zeros(2))], compressor)
    assert opt.defaults["momentum"] == 0.7 and params == {}  # the inner SGD keeps its momentum


def test_the_cli_refuses_bad_outer_input_in_one_line_before_any_worker_starts(tmp_path):
    for args, message in [(["--outer", "diloco:H=5"], f"error: bad outer option 'H=5' in 'diloco:H=5'; {KEYS}"),
                          (["--outer", "diloco:sync_every=5,fragments=7"],
                           "outer option fragments must be at most 6, the number of mlp's parameter tensors, got 7"),
                          (["--outer", "diloco:sync_every=5", "--integration", "optimizer"], "outer replaces DDP")]:
        result = CliRunner().invoke(app, [*DIGITS, *args, "--out-dir", str(tmp_path)])
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir()), "a refused run wrote files"


SWEEP_OVER_H = """
base = { model = "mlp", dataset = "digits", max_steps = 4 }

[[grid.methods]]
compressor = "none"
label = "dense"

[[grid.methods]]                   # 2 workers (the default), topk at H = 10 and at H = 50 in 2 fragments
label = "topk-diloco"
compressor = "topk"
params = { ratio = 0.01 }
sweep_param = "outer"
values = ["diloco:sync_every=10", "diloco:sync_every=50,fragments=2"]
"""


def test_a_sweep_over_h_is_a_grid_of_methods_with_outer_strings(tmp_path):
    path = tmp_path / "h.toml"
    path.write_text(SWEEP_OVER_H)
    result = CliRunner().invoke(app, ["sweep", str(path), "--out-dir", str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[:3] == [
        "run  dense-w2-s0: none {} lr=0.01",
        "run  topk-diloco-outerdiloco_sync_every_10-w2-s0: topk {'ratio': 0.01} outer=diloco:sync_every=10 lr=0.01",
        "run  topk-diloco-outerdiloco_sync_every_50_fragments_2-w2-s0: topk {'ratio': 0.01} "
        "outer=diloco:sync_every=50,fragments=2 lr=0.01"]
    path.write_text(SWEEP_OVER_H.replace("sync_every=10", "sync_evry=10"))
    result = CliRunner().invoke(app, ["sweep", str(path), "--out-dir", str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 2 and "bad outer option 'sync_evry=10'" in result.output


def _profile(wire_bytes: int) -> cost.MethodProfile:
    return cost.MethodProfile("none", {}, [[cost.Collective("allreduce", wire_bytes)]], [["w"]], wire_bytes,
                              [0.002], [0.0])


def test_outer_step_time_adds_one_exchange_per_sync_every_steps():
    link, p = cost.Link.from_rate("1gbit"), _profile(4_000_000)
    every = cost.step_time(p, 0.05, link, 8)
    outer = cost.outer_step_time(p, 0.05, link, 8, 50)
    assert outer["comm_s"] == pytest.approx(every["comm_s"] / 50) and outer["codec_s"] == pytest.approx(0.002 / 50)
    assert outer["step_s"] == pytest.approx(0.05 + (every["comm_s"] + 0.002) / 50) and outer["hidden_s"] == 0
    with pytest.raises(ValueError, match="sync_every must be an integer >= 1, got 0"):
        cost.outer_step_time(p, 0.05, link, 8, 0)


def test_advise_projects_diloco_with_a_fiftieth_of_the_communication_at_h_50():
    rows = advise("mlp", "digits", bandwidth="100mbit", methods=["none", "topk:ratio=0.01"],
                  outer=["diloco:sync_every=50"], echo=None)
    by = {r["label"]: r for r in rows}
    assert set(by) == {"none", "none diloco H=50", "topk(ratio=0.01)", "topk(ratio=0.01) diloco H=50"}
    for label in ("none", "topk(ratio=0.01)"):
        every, outer = by[label], by[f"{label} diloco H=50"]
        assert outer["comm_s"] == pytest.approx(every["comm_s"] / 50)  # the same exchange, once per 50 steps
        assert outer["wire_bytes"] == pytest.approx(every["wire_bytes"] / 50)
        assert outer["step_s"] == pytest.approx(outer["compute_s"] + outer["codec_s"] + outer["comm_s"])
        assert outer["sync_every"] == 50 and every["sync_every"] is None and outer["risk"] in ("medium", "high")
    assert by["none diloco H=50"]["speedup"] > 1  # 100 Mbit/s: dense DDP waits on the link every step
    with pytest.raises(ValueError, match="needs sync_every"):
        advise("mlp", "digits", bandwidth="1gbit", outer=["diloco"], echo=None)

"""`gradzip train`'s options against TrainConfig: one new field is one edit, and the CLI cannot drift."""
import dataclasses

import typer.main
from typer.testing import CliRunner

import gradzip.cli as cli
import gradzip.harness.trainer as trainer
from gradzip.cli import TRAIN_FIELDS_NOT_OPTIONS, app, parse_params
from gradzip.harness.trainer import TrainConfig


def _options() -> dict:
    """`gradzip train`'s click parameters by TrainConfig field name (--param fills params)."""
    command = typer.main.get_command(app).commands["train"]
    return {("params" if p.name == "param" else p.name): p for p in command.params}


def test_every_train_config_field_is_an_option_with_its_default_or_listed_as_not_one():
    options = _options()
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert set(options) == set(fields) - TRAIN_FIELDS_NOT_OPTIONS, "an option without a field, or the reverse"
    assert TRAIN_FIELDS_NOT_OPTIONS <= set(fields), "a listed field TrainConfig no longer has"
    for name, option in options.items():
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        got = parse_params(option.default) if name == "params" else option.default
        assert got == default and type(got) is type(default), (name, got, default)
        assert option.opts[0] == "--" + name.replace("_", "-") or name == "params", option.opts


def test_the_options_reach_train_config(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "_check_data", lambda config: None)
    monkeypatch.setattr(trainer, "launch", lambda config: seen.append(config))
    assert CliRunner().invoke(app, ["train"]).exit_code == 0
    assert seen[-1] == TrainConfig()
    args = ["-c", "topk", "-p", "ratio=0.1", "-n", "3", "--epochs", "2", "--lr", "0.5", "--clip", "1.5",
            "--max-steps", "7", "--resume", "--no-progress", "--name", "x", "--out-dir", "elsewhere"]
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    assert seen[-1] == TrainConfig(compressor="topk", params={"ratio": 0.1}, workers=3, epochs=2, lr=0.5, clip=1.5,
                                   max_steps=7, resume=True, progress=False, name="x", out_dir="elsewhere")


def test_the_run_builds_its_compressor_once_with_the_runs_momentum_where_it_applies_momentum(monkeypatch):
    built = []
    make = trainer.gradzip.make
    monkeypatch.setattr(trainer.gradzip, "make", lambda name, **params: built.append(name) or make(name, **params))
    cases = [(TrainConfig(compressor="dgc", momentum=0.8), 0.8, 0.8),                     # the run's momentum
             (TrainConfig(compressor="dgc", params={"momentum": 0.5}, momentum=0.8), 0.5, 0.5),
             (TrainConfig(compressor="dgc", params={"feedback": "residual"}, momentum=0.8), 0.9, None),  # default
             (TrainConfig(compressor="dgc", params={"feedback": None}, momentum=0.8), 0.8, 0.8),  # None: the default scheme
             (TrainConfig(compressor="signum", momentum=0.0), None, None)]
    for config, momentum, given in cases:
        built.clear()
        compressor, params = trainer._compressor(config)
        assert built == [config.compressor]
        assert getattr(compressor, "momentum", None) == momentum and params.get("momentum") == given

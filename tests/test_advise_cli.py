"""`gradzip advise` for the user's own model (CLI and Python), `gradzip methods`, "did you mean" errors
and the demo's tables at 80 columns.  No timing is asserted: only what is exact (parameter counts,
which row is recommended, call counts, error texts)."""
from __future__ import annotations

import io
import sys
import textwrap

import pytest
import torch
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

import gradzip
from gradzip.advise import default_loss, recommend, user_model
from gradzip.cli import DEMO_METHODS, app, demo_tables
from gradzip.compressors import summary

MODULE = "gz_user_models"  # a name no installed package has
PARAMETERS = 20 * 30 + 30 + 30 * 4 + 4
METHODS = ["-m", "fp16", "-m", "topk:ratio=0.01"]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory holding the user's module, made the current directory (as for `gradzip advise`)."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 4))

        def batch():
            g = torch.Generator().manual_seed(1)
            return torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)

        def pair():
            return model(), batch()

        def calls(model, batch):
            x, y = batch
            return nn.functional.cross_entropy(model(x), y)

        NOT_CALLABLE = 3

        def wrong():
            return [1, 2]

        def broken_import():
            import gz_no_such_module  # noqa: F401
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # advise puts the current directory on it
    yield tmp_path
    sys.modules.pop(MODULE, None)


def _advise(*args):
    return CliRunner().invoke(app, ["advise", *args, "--bandwidth", "100mbit", *METHODS])


def test_cli_advises_on_the_users_model_from_a_factory(user_dir):
    for spec in (["--model", f"{MODULE}:pair"], ["--model", f"{MODULE}:model", "--batch", f"{MODULE}:batch"],
                 ["--model", f"{MODULE}:model", "--batch", f"{MODULE}:batch", "--loss", f"{MODULE}:calls"]):
        result = _advise(*spec)
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert lines[0].startswith(f"Sequential on your batch: {PARAMETERS:,} parameters in 4 tensors, 2 workers; "
                                   "link alpha=100 us, beta=100 Mbit/s (given 100mbit)")
        table = lines[3:6]
        labels = [line.split()[1] for line in table]
        assert sorted(labels) == ["fp16", "none", "topk(ratio=0.01)"]
        assert lines[6].startswith("Recommendation: ")
        # The fastest row of low or medium risk; all three are.
        assert lines[6].startswith(f"Recommendation: {labels[0]}") or (
            labels[0] == "none" and lines[6].startswith("Recommendation: none (plain DDP)"))


def test_python_api_times_the_users_model_and_leaves_it_as_it_was(user_dir):
    sys.path.insert(0, str(user_dir))
    import gz_user_models as user

    model, batch = user.model(), user.batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    calls = []

    def loss(m, b):
        calls.append(b is batch)
        return user.calls(m, b)

    lines = []
    rows = gradzip.advise(model, batch, loss_fn=loss, bandwidth="1gbit", workers=8, methods=["none", "powersgd:rank=2"],
                          echo=lines.append)
    assert calls == [True] * 13  # 3 warm-up and 10 timed steps, each on the given batch
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert [r for r in rows if r["recommended"]] == [recommend(rows)]
    assert recommend(rows) == min(rows, key=lambda r: r["step_s"])  # both rows are low risk
    assert lines[0].startswith(f"Sequential on your batch: {PARAMETERS:,} parameters in 4 tensors, 8 workers")
    best = recommend(rows)
    assert lines[-1].startswith("Recommendation: none (plain DDP)" if best["method"] == "none"
                                else f"Recommendation: {best['label']}: ")


def test_default_loss_follows_the_batchs_form():
    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    x, labels, targets = torch.randn(4, 6), torch.tensor([0, 2, 1, 1]), torch.randn(4, 3)
    assert torch.equal(default_loss((x, labels))(net, (x, labels)), nn.functional.cross_entropy(net(x), labels))
    assert torch.equal(default_loss((x, targets))(net, (x, targets)), nn.functional.mse_loss(net(x), targets))
    assert torch.equal(default_loss(x)(net, x), net(x).float().square().mean())

    class WithLoss(nn.Module):  # as a Hugging Face model given labels
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, inputs, labels):
            return {"logits": self.net(inputs), "loss": nn.functional.cross_entropy(self.net(inputs), labels)}

    batch = {"inputs": x, "labels": labels}
    assert torch.equal(default_loss(batch)(WithLoss(), batch), nn.functional.cross_entropy(net(x), labels))
    with pytest.raises(ValueError, match=r"^a sample batch of type int needs loss_fn\(model, batch\)"):
        default_loss(3)


@pytest.mark.parametrize("args, error", [
    (["--model", f"{MODULE}:nope"], f"--model '{MODULE}:nope': module '{MODULE}' has no attribute 'nope'"),
    (["--model", "gz_absent_module:make"],
     "--model 'gz_absent_module:make': no module named 'gz_absent_module' (in the current directory or on PYTHONPATH)"),
    (["--model", f"{MODULE}:NOT_CALLABLE"],
     f"--model '{MODULE}:NOT_CALLABLE': NOT_CALLABLE is not a function but a value of type int"),
    (["--model", f"{MODULE}:wrong"],
     f"--model '{MODULE}:wrong' returned a list; expected a torch.nn.Module, (model, batch) or (model, batch, loss_fn)"),
    (["--model", f"{MODULE}:model"], f"--model '{MODULE}:model' returns the model alone: give --batch "
                                     "package.module:function returning one input batch, or return (model, batch)"),
    (["--model", f"{MODULE}:pair", "--batch", f"{MODULE}:batch"],
     f"--model '{MODULE}:pair' returns a batch already; --batch is for a factory that returns the model alone"),
    (["--model", f"{MODULE}:pair", "--dataset", "digits"],
     "--dataset, --data-dir and --batch-size are for the built-in models; your factory or --batch gives the batch"),
    (["--model", f"{MODULE}:"], f"--model '{MODULE}:': expected package.module:function"),
    (["--model", "resnet"], "unknown model 'resnet' (did you mean 'resnet20'?); valid names: cnn, mlp, resnet20, "
                            "lstm, gpt, or your own as package.module:factory"),
    (["--model", "cnn", "--batch", f"{MODULE}:batch"],
     "--batch and --loss go with your own model (--model package.module:factory)"),
])
def test_a_bad_model_spec_is_a_one_line_error(user_dir, args, error):
    result = _advise(*args)
    assert result.exit_code == 2
    assert result.output == f"error: {error}\n"


def test_a_missing_import_inside_the_users_module_is_not_reported_as_the_module_missing(user_dir):
    with pytest.raises(ModuleNotFoundError, match="gz_no_such_module"):
        user_model(f"{MODULE}:broken_import")


def test_methods_lists_each_method_with_a_description_in_aligned_columns():
    result = CliRunner().invoke(app, ["methods"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    names = gradzip.compressors()
    column = max(map(len, names)) + 2
    heads = [line for line in lines if not line.startswith(" ")]
    assert [line[:column].rstrip() for line in heads] == names
    for name, line in zip(names, heads):
        assert line[column:] == summary(name)
        assert line[column - 1] == " " and line[column] != " "
    assert "adaptive_threshold  sparse:" in result.output
    params = [line for line in lines if line.startswith(" ")]
    assert all(line.startswith(" " * column) for line in params)
    assert max(map(len, lines)) <= 80  # an 80-column terminal
    assert " " * column + "ratio=0.01, value_dtype=None, feedback=None" in lines


def test_unknown_method_and_parameter_names_suggest_the_closest():
    with pytest.raises(ValueError) as exc:
        gradzip.make("topkk")
    assert str(exc.value).startswith("unknown compressor 'topkk' (did you mean 'topk'?); valid names: none, fp16,")
    with pytest.raises(ValueError) as exc:
        gradzip.GradzipState("topk", ratoi=0.1)
    assert str(exc.value) == ("unknown parameter(s) ratoi for compressor 'topk' (did you mean 'ratio'?); "
                              "valid: ratio, value_dtype, feedback")
    with pytest.raises(ValueError) as exc:
        gradzip.make("powersgd", xyz=1)
    assert "did you mean" not in str(exc.value)  # nothing close: no guess


def test_demo_tables_fit_80_columns_without_cutting_names():
    summary = {"final_test_accuracy": 0.81234, "mean_ratio": 1234.5, "mean_bits_per_element": 0.0259,
               "total_bytes_sent": 12345.6 * 2**20,
               **{f"mean_{k}_s": 1.2345 for k in ("step", "compute", "compress", "communicate", "decompress")}}
    console = Console(width=80, file=io.StringIO(), record=True)
    for table in demo_tables([(m, p, summary) for m, p in DEMO_METHODS], 2, 300):
        console.print(table)
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    for word in ["method", "test acc", "ratio", "bits/element", "MB sent/worker", "step ms", "step", "compute",
                 "compress", "communicate", "decompress"] + [m for m, _ in DEMO_METHODS]:
        assert f" {word} " in text, word
    assert "1234.5x" in text and "0.03" in text and "12345.6" in text and "0.8123" in text

"""The harness's GPT: shapes, causality, weight tying, initialisation, option errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from gradzip.harness import DatasetInfo, build_model, model_options, task_of

CHARS = DatasetInfo("chars", (16,), 50, "language_model")


def gpt(**options):
    torch.manual_seed(0)
    return build_model("gpt", CHARS, **options)


def test_registry_defaults_and_parameter_count():
    assert task_of("gpt") == "language_model"
    assert model_options("gpt") == {"layers": 2, "width": 128, "heads": 4, "dropout": 0.0, "tie": True}
    w = 128
    block = 2 * 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w)
    assert sum(p.numel() for p in gpt().parameters()) == 50 * w + 16 * w + 2 * block + 2 * w  # head tied


def test_logits_for_every_position_and_every_parameter_gets_a_gradient():
    model = gpt(layers=3, width=32, heads=2)
    x = torch.randint(0, 50, (4, 16))
    logits = model(x)
    assert logits.shape == (4, 16, 50) and logits.dtype == torch.float32
    assert model(x[:, :5]).shape == (4, 5, 50)  # shorter than the context is fine
    F.cross_entropy(logits.flatten(0, 1), torch.randint(0, 50, (64,))).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("t", [0, 7, 15])
def test_changing_a_token_changes_no_earlier_logits(t):
    model = gpt(width=32, heads=4).eval()
    x = torch.randint(0, 50, (2, 16))
    changed = x.clone()
    changed[:, t] = (x[:, t] + 1) % 50
    before, after = model(x), model(changed)
    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])  # the token itself and later ones see it


def test_weight_tying_and_initialisation():
    tied = gpt(layers=4)
    assert tied.tied and tied.head.weight is tied.tok.weight
    assert len(list(tied.parameters())) == len(tied.state_dict()) - 1  # one Parameter under two names
    untied = gpt(tie=False)
    assert not untied.tied and untied.head.weight is not untied.tok.weight
    assert abs(tied.tok.weight.std().item() - 0.02) < 0.002
    assert abs(tied.blocks[0].proj.weight.std().item() - 0.02 / math.sqrt(8)) < 0.001  # GPT-2's residual scaling
    assert all(torch.count_nonzero(p) == 0 for n, p in tied.named_parameters() if n.endswith(".bias"))


def test_dropout_only_in_training():
    model = gpt(width=32, heads=2, dropout=0.5)
    x = torch.randint(0, 50, (2, 16))
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


@pytest.mark.parametrize("options, message", [
    ({"layers": 0}, "layers must be an integer >= 1, got 0"),
    ({"width": 2.5}, "width must be an integer >= 1, got 2.5"),
    ({"heads": True}, "heads must be an integer >= 1, got True"),
    ({"width": 30, "heads": 4}, "width must be a multiple of heads, got width=30, heads=4"),
    ({"dropout": 1.0}, "dropout must be a number with 0 <= dropout < 1, got 1.0"),
    ({"tie": None}, "tie must be True or False, got None"),
    ({"context": 8}, "unknown option(s) context for model 'gpt'; valid: layers, width, heads, dropout, tie"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ValueError) as excinfo:
        gpt(**options)
    assert str(excinfo.value) == message


def test_longer_input_than_the_context_and_classification_data_are_refused():
    with pytest.raises(ValueError, match="sequence of 17 tokens is longer than the model's context 16"):
        gpt(width=32)(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="model 'gpt' is for language_model data"):
        build_model("gpt", DatasetInfo("digits", (1, 8, 8), 10, "classification"))

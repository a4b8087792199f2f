"""``gradzip bench step`` on a CPU with a tiny GPT: every row measured, counts taken, JSON written."""
import json
import math
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from typer.testing import CliRunner

from gradzip.bench import step
from gradzip.cli import app

TINY = dict(device="cpu", width=32, depth=1, context=16, batch=2, vocab=64, steps=2, warmup=1, profile_steps=1)


def test_every_row_measured_and_json_written(tmp_path):
    out = tmp_path / "step.json"
    lines = []
    result = step.main(["ddp", "torch-fp16", "none", "topk", "fp16"], json_out=str(out), echo=lines.append, **TINY)
    assert not dist.is_initialized()  # the command's own one-process group is gone again
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["ddp", "torch-fp16", "none", "topk", "fp16"]
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        for key in ("ms", "min_ms", "first_ms", "x_ddp"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
        assert r["aten_ops"] > 0 and r["host_reads"] >= 0 and r["launches"] == 0 and r["syncs"] == 0
        assert r["peak_mb"] is None and r["all_threads"] is True
    assert rows["ddp"]["x_ddp"] == 1.0
    # Top-k selects and scatters: more operations per step than plain DDP's allreduce.
    assert rows["topk"]["aten_ops"] > rows["ddp"]["aten_ops"]
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"]
    assert saved["env"]["torch"] and saved["env"]["world_size"] == 1 and saved["env"]["command"]
    assert saved["config"]["width"] == 32 and saved["config"]["parameters"] > 0
    table = "\n".join(lines)
    assert "ms/step" in table and "topk" in table and f"wrote {out}" in table


def test_a_failing_contender_is_a_row(monkeypatch):
    attach = step._attach

    def broken(name, ddp):
        if name == "none":
            raise RuntimeError("boom\nsecond line")
        return attach(name, ddp)

    monkeypatch.setattr(step, "_attach", broken)
    result = step.run(["none", "fp16"], **TINY)
    bad, good = result["rows"]
    assert bad == {"method": "none", "error": "RuntimeError: boom"}
    assert good["ms"] > 0 and good["x_ddp"] is None  # no ddp row to compare with
    assert "none             error: RuntimeError: boom" in step.format_table(result)


def test_counts_cuda_runtime_calls_by_name():
    names = ["cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemcpy",
             "cudaStreamSynchronize", "aten::_local_scalar_dense", "aten::item", "aten::nonzero",
             "aten::unique_dim", "aten::add_"]
    counts = step._count([SimpleNamespace(name=n) for n in names], True, 2)
    assert counts == {"launches": 1.5, "syncs": 1.0, "aten_ops": 2.5, "host_reads": 1.5, "all_threads": True}


def test_cli(tmp_path):
    runner = CliRunner()
    help_text = runner.invoke(app, ["bench", "step", "--help"])
    assert help_text.exit_code == 0 and "--methods" in help_text.output and "--bucket-mb" in help_text.output
    bad = runner.invoke(app, ["bench", "step", "--device", "cpu", "--methods", "ddp,nosuch"])
    assert bad.exit_code == 2 and "unknown method(s) nosuch" in bad.output
    out = tmp_path / "cli.json"
    ok = runner.invoke(app, ["bench", "step", "--device", "cpu", "--width", "32", "--depth", "1", "--context", "16",
                             "--steps", "1", "--warmup", "0", "--methods", "ddp", "--json", str(out)])
    assert ok.exit_code == 0, ok.output
    assert json.loads(out.read_text())["rows"][0]["ms"] > 0


@pytest.mark.parametrize("kwargs, message", [(dict(amp="fp16"), "amp"), (dict(steps=0), "steps"),
                                             (dict(device="tpu"), "device"), (dict(warmup=-1), "warmup")])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        step.run(["ddp"], **{**TINY, **kwargs})

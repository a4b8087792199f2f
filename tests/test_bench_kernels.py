"""`gradzip bench kernels` on tiny sizes: the structure of its results, table and JSON (not timings)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import gradzip
from gradzip.bench import kernels
from gradzip.bench.cli import bench_app

ROW_KEYS = {"method", "params", "ms", "x_pass", "best_x_pass", "compress_share", "decompress_share", "other_share", "compress_ms", "communicate_ms", "decompress_ms", "other_ms",
            "alone_ms", "alone_x_pass", "density"}


def test_resnet50_shapes_match_torchvision_resnet50():
    shapes = kernels.resnet50_shapes()
    assert len(shapes) == 161
    assert sum(math.prod(s) for _, s in shapes) == 25_557_032  # torchvision's resnet50 parameter count
    named = dict(shapes)
    assert named["conv1.weight"] == (64, 3, 7, 7) and named["fc.weight"] == (1000, 2048)
    assert named["layer1.0.conv1.weight"] == (64, 64, 1, 1)
    assert named["layer2.0.downsample.0.weight"] == (512, 256, 1, 1)
    assert named["layer4.2.conv3.weight"] == (2048, 512, 1, 1)
    assert sum(len(s) == 1 for s in named.values()) == 2 * 53 + 1  # 53 batch norms and the fc bias
    assert len(named) == len(shapes)  # names are unique


def test_flat_shape_is_the_most_square_factorisation():
    assert kernels.flat_shape(25_000_000) == (5000, 5000)
    assert kernels.flat_shape(4096) == (64, 64)
    assert kernels.flat_shape(12) == (3, 4)
    assert kernels.flat_shape(13) == (1, 13)


def test_run_reports_every_method_on_a_tiny_tensor():
    result = kernels.run(workloads=["flat"], numel=4096, repeat=1)
    assert set(result) == {"machine", "repeat", "clock", "workloads", "dgc_selection"}
    assert result["machine"]["torch"] == torch.__version__
    (flat,) = result["workloads"]
    assert flat["workload"] == "flat" and flat["shape"] == [64, 64] and flat["numel"] == 4096
    assert flat["baseline_ms"] > 0
    assert [r["method"] for r in flat["methods"]] == gradzip.compressors()
    for row in flat["methods"]:
        assert ROW_KEYS <= set(row)
        assert row["ms"] > 0 and row["alone_ms"] > 0
        assert row["x_pass"] == pytest.approx(row["ms"] / flat["baseline_ms"])
        assert 0 < row["density"] <= 1
    params = {r["method"]: r["params"] for r in flat["methods"]}
    assert params["dgc"] == {"ratio": 0.001, "warmup_epochs": 0} and params["powersgd"] == {"dense_steps": 0}
    sel = result["dgc_selection"]
    assert sel["numel"] == 4096 and sel["k"] == math.ceil(0.001 * 4096)
    assert sel["speedup"] == pytest.approx(sel["exact_topk_ms"] / sel["sampled_ms"])
    table = kernels.format_table(result)
    for name in gradzip.compressors():
        assert f"\n{name} " in table
    assert "DGC selection" in table
    json.dumps(result)  # JSON-ready


def test_resnet50_workload_and_profile_columns():
    result = kernels.run(["none", "dgc"], workloads=["resnet50"], repeat=1, profile=True, alone=False,
                         selection=False)
    (w,) = result["workloads"]
    assert w["tensors"] == 161 and w["numel"] == 25_557_032 and w["shape"] is None
    for row in w["methods"]:
        assert "alone_ms" not in row and row["top_ops"]
        assert all({"op", "ms", "share"} <= set(op) for op in row["top_ops"])
    assert "top ops" in kernels.format_table(result)


def test_cli_writes_json_and_prints_the_table(tmp_path):
    out = tmp_path / "kernels.json"
    args = ["kernels", "--numel", "4096", "--repeat", "1", "--workloads", "flat", "--methods", "none,topk,powersgd",
            "--no-selection", "--clock", "cpu", "--json", str(out)]
    result = CliRunner().invoke(bench_app, args)
    assert result.exit_code == 0, result.output
    assert "one memory pass" in result.output and "powersgd" in result.output
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["workloads"][0]["methods"]] == ["none", "topk", "powersgd"]
    assert "dgc_selection" not in data and data["clock"] == "cpu"


def test_cli_rejects_unknown_methods_and_workloads():
    runner = CliRunner()
    bad = runner.invoke(bench_app, ["kernels", "--methods", "tpk", "--numel", "64"])
    assert bad.exit_code == 2 and "unknown method" in bad.output
    bad = runner.invoke(bench_app, ["kernels", "--workloads", "vgg", "--numel", "64", "--no-selection"])
    assert bad.exit_code == 2 and "workload must be" in bad.output
    bad = runner.invoke(bench_app, ["kernels", "--clock", "sundial", "--numel", "64", "--no-selection"])
    assert bad.exit_code == 2 and "clock must be" in bad.output

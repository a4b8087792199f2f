"""``gradzip bench step`` on a CPU with a tiny GPT: every row measured, counts taken, JSON written;
contenders in child processes (isolate) or in this one, repeated, ratios per repeat."""
import json
import math
import os
import sys
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
    names = ["ddp", "probe-cpp-hook", "probe-python-hook", "torch-fp16", "none", "topk", "fp16"]
    result = step.main(names, json_out=str(out), echo=lines.append, isolate=False, **TINY)
    assert not dist.is_initialized()  # the command's own one-process group is gone again
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == names
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        for key in ("ms", "min_ms", "first_ms", "x_ddp"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
        assert r["aten_ops"] > 0 and r["host_reads"] >= 0 and r["launches"] == 0 and r["syncs"] == 0
        assert r["peak_mb"] is None and r["all_threads"] is True
    assert rows["ddp"]["x_ddp"] == 1.0 and rows["torch-fp16"]["x_fp16"] == 1.0
    assert rows["topk"]["x_fp16"] == pytest.approx(rows["topk"]["ms"] / rows["torch-fp16"]["ms"])
    assert {r["pid"] for r in result["runs"]} == {os.getpid()}  # in process
    assert result["config"]["isolate"] is False and rows["topk"]["repeats"] == 1
    # Top-k selects and scatters: more operations per step than plain DDP's allreduce; none is DDP's own.
    assert rows["topk"]["aten_ops"] > rows["ddp"]["aten_ops"] == rows["none"]["aten_ops"]
    # The probes: DDP's C++ hook allreduces, the Python probe runs no collective at all.
    assert rows["probe-cpp-hook"]["note"] == "C++ allreduce hook" and rows["probe-python-hook"]["note"] == "no collective"
    assert rows["probe-python-hook"]["aten_ops"] < rows["ddp"]["aten_ops"]
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
    result = step.run(["none", "fp16"], isolate=False, **TINY)
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
    assert "--no-isolate" in help_text.output and "--repeats" in help_text.output
    ok = runner.invoke(app, ["bench", "step", "--device", "cpu", "--width", "32", "--depth", "1", "--context", "16",
                             "--steps", "1", "--warmup", "0", "--methods", "ddp", "--json", str(out), "--no-isolate",
                             "--repeats", "2"])
    assert ok.exit_code == 0, ok.output
    saved = json.loads(out.read_text())
    assert saved["rows"][0]["ms"] > 0 and saved["rows"][0]["repeats"] == 2 and len(saved["runs"]) == 2
    assert saved["config"]["isolate"] is False and saved["config"]["repeats"] == 2
    assert "repeat 2 of 2" in ok.output and "median of 2 repeats" in " ".join(ok.output.split())
    zero = runner.invoke(app, ["bench", "step", "--device", "cpu", "--methods", "ddp", "--repeats", "0"])
    assert zero.exit_code == 2 and "repeats must be" in zero.output


@pytest.mark.parametrize("kwargs, message", [(dict(amp="fp16"), "amp"), (dict(steps=0), "steps"),
                                             (dict(device="tpu"), "device"), (dict(warmup=-1), "warmup"),
                                             (dict(repeats=0), "repeats"),
                                             (dict(memory_snapshot="snapshots"), "needs --device cuda")])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        step.run(["ddp"], **{**TINY, **kwargs})


@pytest.mark.parametrize("names, message", [(["torch-fp16:rank=4"], "only gradzip's methods take parameters"),
                                            (["powersgd:nosuch=1"], "unknown parameter"),
                                            (["powersgd:rank"], "expected NAME:KEY=VALUE"),
                                            (["topk:bucketed=maybe"], "bucketed must be true, false or none"),
                                            (["topk:bucketed=1"], "bucketed must be true, false or none"),
                                            (["ddp", "topk", "ddp"], "named twice")])
def test_bad_contenders_are_refused_before_any_run(names, message):
    with pytest.raises(ValueError, match=message):
        step.run(names, **TINY)


def test_methods_with_parameters_of_their_own(tmp_path):
    """``NAME:KEY=VALUE,...`` contenders through the command line: split from the list with their own
    commas, over BENCH_PARAMS, the spec naming the row; gradzip PowerSGD rows against torch-powersgd's."""
    assert step.split_methods("ddp, powersgd:rank=4,dense_steps=2 ,topk,,qsgd:levels=4") == [
        "ddp", "powersgd:rank=4,dense_steps=2", "topk", "qsgd:levels=4"]
    out = tmp_path / "specs.json"
    ok = CliRunner().invoke(app, ["bench", "step", "--device", "cpu", "--width", "32", "--depth", "1", "--context",
                                  "16", "--steps", "1", "--warmup", "2", "--no-isolate", "--json", str(out),
                                  "--methods", "torch-powersgd,powersgd,powersgd:rank=1,dense_steps=1,topk,"
                                  "topk:bucketed=true"])
    assert ok.exit_code == 0, ok.output
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["torch-powersgd", "powersgd", "powersgd:rank=1,dense_steps=1", "topk", "topk:bucketed=true"]
    # the route is the state's key: the bucket route's operations do not grow with the bucket's tensors
    assert rows["topk:bucketed=true"]["note"] == "bucketed=True"
    assert rows["topk:bucketed=true"]["aten_ops"] < rows["topk"]["aten_ops"] / 2
    assert rows["powersgd"]["note"] == "dense_steps=0"  # BENCH_PARAMS alone
    one = rows["powersgd:rank=1,dense_steps=1"]
    assert one["note"] == "dense_steps=1,rank=1"
    # the parameters reached the method: a rank-1 basis needs no Gram-Schmidt step between columns
    assert one["aten_ops"] < rows["powersgd"]["aten_ops"]
    for name in ("powersgd", "powersgd:rank=1,dense_steps=1"):
        assert rows[name]["x_torch_powersgd"] == pytest.approx(rows[name]["ms"] / rows["torch-powersgd"]["ms"])
    assert "x_torch_powersgd" not in rows["topk"] and "x_torch_powersgd" not in rows["torch-powersgd"]
    assert ok.output.count("x torch-powersgd") == 2, ok.output  # in the notes of both PowerSGD rows


def test_isolated_and_repeated(tmp_path):
    """Each contender in a child process of its own, the list run twice in turn: medians, spread, ratios."""
    out = tmp_path / "iso.json"
    lines = []
    result = step.main(["ddp", "topk"], json_out=str(out), echo=lines.append, isolate=True, repeats=2, **TINY)
    assert not dist.is_initialized()
    runs = result["runs"]
    assert [(r["method"], r["repeat"]) for r in runs] == [("ddp", 0), ("topk", 0), ("ddp", 1), ("topk", 1)]
    pids = [r["pid"] for r in runs]
    assert len(set(pids)) == 4 and os.getpid() not in pids  # four fresh processes
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["ddp", "topk"]
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        mine = [x["ms"] for x in runs if x["method"] == name]
        assert r["repeats"] == 2 and r["ms_lo"] == min(mine) and r["ms_hi"] == max(mine)
        assert r["ms"] == pytest.approx(sum(mine) / 2)  # the median of two
        assert math.isfinite(r["spread"]) and r["spread"] == pytest.approx(max(mine) / min(mine) - 1)
        for key in ("ms", "min_ms", "first_ms", "aten_ops"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
        assert r["x_fp16"] is None  # no torch-fp16 among the contenders
    assert rows["ddp"]["x_ddp"] == 1.0
    per_repeat = [runs[1]["ms"] / runs[0]["ms"], runs[3]["ms"] / runs[2]["ms"]]
    assert rows["topk"]["x_ddp"] == pytest.approx(sum(per_repeat) / 2)
    assert rows["topk"]["aten_ops"] > rows["ddp"]["aten_ops"]
    assert result["config"]["isolate"] is True and result["config"]["repeats"] == 2
    assert result["env"]["world_size"] == 1 and result["env"]["torch"]
    assert json.loads(out.read_text())["rows"] == result["rows"]
    table = "\n".join(lines)
    flat = " ".join(table.split())
    assert "topk (repeat 2 of 2) ..." in table and "process of its own" in flat and "median of 2 repeats" in flat
    assert "%" in next(line for line in table.splitlines() if line.startswith("topk   "))
    assert max(len(line) for line in table.splitlines()) <= 100


def test_a_failing_child_is_a_row(monkeypatch):
    """A child that exits non-zero is an error row with its stderr's last line; one that exits 0 with no
    JSON too; the others' rows stand.  The children here are stand-ins, not the benchmark."""
    argv = step._child_argv

    def fake(name, cfg, device, json_path):
        assert argv(name, cfg, device, json_path)[1:3] == ["-m", "gradzip"]
        if name == "topk":
            return [sys.executable, "-c", f"import sys; sys.stderr.write('warning\\nchild boom{WORDY}\\n\\n'); sys.exit(3)"]
        if name == "fp16":
            return [sys.executable, "-c", "pass"]
        # a loaded machine's numbers: wider than a quiet one's
        row = dict(method="ddp", repeat=0, pid=1, ms=2.0, min_ms=1.0, first_ms=123456789.0, peak_mb=None, note="",
                   compile_wait_ms=987654321.0, launches=0.0, syncs=0.0, aten_ops=10.0, host_reads=1.0,
                   all_threads=True)
        code = f"import json; json.dump({{'env': {{}}, 'runs': [{row!r}]}}, open({json_path!r}, 'w'))"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(step, "_child_argv", fake)
    said = []
    result = step.run(["ddp", "topk", "fp16"], isolate=True, repeats=2, progress=said.append, **TINY)
    ddp, topk, fp16 = result["rows"]
    assert ddp["ms"] == 2.0 and ddp["x_ddp"] == 1.0 and ddp["spread"] == 0.0
    assert topk == {"method": "topk", "error": f"child exited 3: child boom{WORDY} (2 of 2 repeats)"}
    assert fp16 == {"method": "fp16", "error": "child exited 0: no output (2 of 2 repeats)"}
    table = step.format_table(result)
    assert "topk             error: child exited 3: child boom" in table
    assert " ".join(table.split()).count(WORDY.strip()) == 1  # wrapped, not cut
    lines = [line for text in said + [table] for line in text.splitlines()]
    assert max(map(len, lines)) <= step.WIDTH, max(lines, key=len)


#: A long error's tail, as a child's traceback line can be.
WORDY = ": the reason" * 12


def test_table_fits_100_columns():
    """CUDA columns, the longest method name and DGC's long note: no line over 100 columns."""
    def row(method, note):
        return dict(method=method, ms=30.41, min_ms=1.0, first_ms=1234.5, peak_mb=4948.0, note=note, launches=1234.0,
                    syncs=0.5, aten_ops=1.0, host_reads=123.0, all_threads=True, x_ddp=1.0, x_fp16=0.95, repeats=3,
                    spread=0.123)

    result = dict(env=dict(device="cuda:0", gpu="NVIDIA H200", cpu="x", torch="2.11", world_size=1, backend="nccl"),
                  config=dict(parameters=109_000_000, width=1024, depth=8, context=256, vocab=8192, batch=16,
                              amp="bf16", bucket_mb=25, steps=30, warmup=3, profile_steps=2, repeats=3, isolate=True),
                  rows=[row("adaptive_threshold", ""), row("dgc", "ratio=0.001,warmup_epochs=0,SGD"),
                        row("torch-powersgd", "rank 4")])
    table = step.format_table(result)
    assert max(len(line) for line in table.splitlines()) <= 100
    assert "note: ratio=0.001,warmup_epochs=0,SGD" in table and " 12.3% " in table and "launches" in table
    assert next(line for line in table.splitlines() if line.startswith("torch-powersgd")).endswith("  rank 4")


def test_ratios_are_per_repeat_medians():
    """x DDP is the median of each repeat's ratio, not the ratio of the medians."""
    def run(method, repeat, ms):
        return dict(method=method, repeat=repeat, ms=ms, min_ms=ms, first_ms=ms, peak_mb=None, note="",
                    launches=0.0, syncs=0.0, aten_ops=1.0, host_reads=0.0, all_threads=True)

    runs = [run("ddp", 0, 10.0), run("torch-fp16", 0, 20.0), run("topk", 0, 20.0),
            run("ddp", 1, 40.0), run("torch-fp16", 1, 40.0), run("topk", 1, 40.0),
            run("ddp", 2, 20.0), run("torch-fp16", 2, 10.0), run("topk", 2, 100.0)]
    rows = {r["method"]: r for r in step._aggregate(runs, ["ddp", "torch-fp16", "topk"])}
    assert rows["topk"]["ms"] == 40.0 and rows["topk"]["ms_lo"] == 20.0 and rows["topk"]["ms_hi"] == 100.0
    assert rows["topk"]["spread"] == 4.0
    assert rows["topk"]["x_ddp"] == 2.0  # ratios 2, 1, 5 (the medians' ratio would be 40 / 20 = 2 too)
    assert rows["torch-fp16"]["x_ddp"] == 1.0  # ratios 2, 1, 0.5; medians' ratio 20 / 20
    assert rows["topk"]["x_fp16"] == 1.0  # ratios 1, 1, 10; medians' ratio 40 / 20 = 2


def test_memory_peak_replays_a_snapshot():
    """benchmarks/memory_peak.py on an allocator history of the form torch.cuda.memory._dump_snapshot
    writes: the peak is the most bytes alive (a block counts until its free completes), listed by the
    innermost gradzip line that allocated it."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_peak.py"
    spec = importlib.util.spec_from_file_location("memory_peak", path)
    memory_peak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_peak)

    def frames(*where):
        return [{"filename": f, "line": line, "name": name} for f, line, name in where]
    sketch = frames(("/x/torch/_tensor.py", 1, "empty"), ("/r/gradzip/compressors/sketch.py", 197, "bucket_exchange"),
                    ("/r/gradzip/state.py", 9, "exchange"))
    model = frames(("/r/gradzip/harness/models.py", 50, "__init__"))
    user = frames(("/x/torch/nn/modules/linear.py", 7, "forward"), ("/home/u/train.py", 3, "step"))
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": model},
              {"action": "alloc", "addr": 2, "size": 40, "frames": sketch},
              {"action": "alloc", "addr": 3, "size": 40, "frames": sketch},
              {"action": "free_requested", "addr": 2, "size": 40, "frames": sketch},  # still counted
              {"action": "alloc", "addr": 4, "size": 10, "frames": user},            # the peak: 190
              {"action": "free_completed", "addr": 2, "size": 40, "frames": sketch},
              {"action": "free_completed", "addr": 3, "size": 40, "frames": sketch},
              {"action": "alloc", "addr": 5, "size": 60, "frames": user}]            # 170: not a peak
    peak, live = memory_peak.peak_allocations({"device_traces": [events]})
    assert peak == 190 and sorted(e["addr"] for e in live) == [1, 2, 3, 4]
    assert memory_peak.by_site(live) == [("gradzip/harness/models.py:50 __init__", 100, 1),
                                         ("gradzip/compressors/sketch.py:197 bucket_exchange", 80, 2),
                                         ("train.py:3 step", 10, 1)]

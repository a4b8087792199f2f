"""The end-to-end benchmark's own code: one tiny unthrottled run, the table and the target lines."""
from __future__ import annotations

import pytest

from gradzip.bench import e2e


def test_tiny_unthrottled_run_reports_every_contender(tmp_path):
    contenders = [c for c in e2e.CONTENDERS if c[0] in ("sync only", "gradzip topk 1%")]
    # decides at step 5 (verify=0: no whole-step verification, whose length would depend on timing)
    contenders.append(("gradzip auto", None, "auto", {"trials": 1, "verify": 0}))
    results = e2e.run(links=["unthrottled"], workers=2, steps=6, contenders=contenders, test_size=200,
                      out_dir=str(tmp_path), log=lambda line: None)
    assert [r.label for r in results] == ["sync only", "gradzip topk 1%", "gradzip auto"]
    for r in results:
        assert r.error is None and r.epoch_s > 0 and r.step_s > 0 and 0 <= r.accuracy <= 1
    assert results[0].mb_sent is None and results[1].mb_sent > 0
    auto = results[2]
    assert auto.note and " x" in auto.note
    text = e2e.table(results, 6, 2)
    assert "| gradzip topk 1% |" in text and "gradzip auto chose:" in text
    assert "every gradzip method completed on every link: met" in text
    assert all(r.passes == pytest.approx(6 * 32 * 2 / 60_000) for r in results)
    assert "- Passes over the training data: 0.01\n" in text and "- Seeds: 0 " in text
    assert "CPU cores" in text.split("- Machine: ")[1].splitlines()[0]
    # Where each bucket's time went: Top-k's buckets on gradzip's thread, every exchange of them counted
    # (DDP rebuilds its buckets after the first step, so that step's bucket has a line of its own).
    assert results[0].buckets is None and results[1].buckets
    for b in results[1].buckets:
        assert b["plain"] == 0 and b["compress_s"] > 0 and b["hook_s"] > 0 and b["queued_s"] > 0
    assert sum(b["elements"] * b["exchanges"] for b in results[1].buckets) == 6 * 1_199_882  # the CNN's parameters
    assert text.count("| gradzip topk 1% | ") == 1 + len(results[1].buckets)
    e2e.save(results, str(tmp_path / "r.json"))
    assert e2e.load(str(tmp_path / "r.json")) == results


def test_diloco_contenders_exist_and_run_with_bytes_per_inner_step(tmp_path):
    """The outer-loop contenders (H=50 in the benchmark; H=3 here, to sync twice in 6 steps)."""
    diloco = [c for c in e2e.CONTENDERS if len(c) > 4]
    assert [(c[0], c[2], c[4]) for c in diloco] == [("gradzip diloco H=50", "none", "diloco:sync_every=50"),
                                                    ("gradzip diloco H=50 topk 1%", "topk", "diloco:sync_every=50")]
    label, baseline, compressor, params, outer = diloco[1]
    results = e2e.run(links=["unthrottled"], workers=2, steps=6, test_size=100, out_dir=str(tmp_path),
                      contenders=[(label, baseline, compressor, params, outer.replace("50", "3"))],
                      log=lambda line: None)
    (r,) = results
    assert r.error is None and r.step_s > 0 and 0 <= r.accuracy <= 1
    cnn_bytes = 4 * 1_199_882  # PyTorch's MNIST example CNN in fp32: what DDP allreduces every step
    assert 0 < r.mb_sent * 2**20 < 2 * cnn_bytes / 20  # 2 syncs of 1% of the model (values and indices)
    assert 0 < r.median_step_s <= r.epoch_s
    assert (f"| gradzip diloco H=50 topk 1% | {r.epoch_s:.2f} | {1000 * r.step_s:.1f} | {1000 * r.median_step_s:.1f} | "
            f"{r.accuracy:.4f} | "
            f"{r.mb_sent:.1f} | {r.mb_sent * 1024 / 6:.1f} |") in e2e.table(results, 6, 2)


def test_targets_say_not_met_and_name_crashes():
    rows = [e2e.Result("rate=100mbit", "dense allreduce", 10.0, 0.1, 0.80),
            e2e.Result("rate=100mbit", "torch fp16 hook", 5.0, 0.05, 0.80),
            e2e.Result("rate=100mbit", "gradzip topk 1%", 2.5, 0.025, 0.78),
            e2e.Result("rate=100mbit", "gradzip dgc 0.1%", error="worker(s) [1] failed")]
    lines = "\n".join(e2e.targets(rows))
    assert "4.00x dense (5x: NOT met)" in lines and "2.00x torch fp16 (2.5x: NOT met)" in lines
    assert "accuracy 2.00 points below dense (0.5: NOT met)" in lines
    rows[2] = e2e.Result("rate=100mbit", "gradzip topk 1%", 1.0, 0.01, 0.81)
    assert "accuracy 1.00 points above dense (0.5: met)" in "\n".join(e2e.targets(rows))
    assert "completed on every link: NOT met (gradzip dgc 0.1% did not)" in lines
    # An outer-loop contender, however fast, is not the per-step methods' "fastest": it gets its own line.
    rows.append(e2e.Result("rate=100mbit", "gradzip diloco H=50", 0.5, 0.005, 0.79))
    lines = "\n".join(e2e.targets(rows))
    assert "fastest gradzip method gradzip topk 1%, 10.00x dense" in lines
    assert "rate=100mbit, outer loop (not counted above): fastest gradzip diloco H=50, 20.00x dense, " \
           "accuracy -1.00 points against dense" in lines


def test_plot_marks_a_crashed_contender_in_the_legend(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    legends = []
    savefig = Figure.savefig
    titles = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (legends.extend(
        t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()),
        titles.extend(ax.get_title() for ax in fig.axes), savefig(fig, *a, **k)))
    rows = [e2e.Result(link, "dense allreduce", t, t / 300, 0.8) for link, t in (("rate=100mbit", 200.0),
                                                                                   ("unthrottled", 20.0))]
    rows += [e2e.Result(link, "torch PowerSGD hook", error="worker(s) [0] failed")
             for link in ("rate=100mbit", "unthrottled")]
    e2e.plot(rows, str(tmp_path / "plot.png"), 2)
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert legends == ["dense allreduce", "torch PowerSGD hook: crashed"]
    assert titles == ["Epoch time vs bandwidth (2 workers, Fashion-MNIST CNN)"]

    legends.clear()  # more crashed contenders than crash markers: every one still gets its entry
    crashed = [f"gradzip method {k}" for k in range(6)]
    e2e.plot(rows[:2] + [e2e.Result("unthrottled", label, error="worker(s) [0] failed") for label in crashed],
             str(tmp_path / "plot6.png"), 4)
    assert legends == ["dense allreduce"] + [f"{label}: crashed" for label in crashed]


def test_repeats_run_in_turn_under_their_own_names(tmp_path):
    contenders = [c for c in e2e.CONTENDERS if c[0] in ("dense allreduce", "gradzip topk 1%")]
    lines = []
    results = e2e.run(links=["unthrottled"], workers=2, steps=4, contenders=contenders, test_size=100,
                      out_dir=str(tmp_path), repeats=2, log=lines.append)
    assert [(r.label, r.repeat) for r in results] == [("dense allreduce", 0), ("gradzip topk 1%", 0),
                                                      ("dense allreduce", 1), ("gradzip topk 1%", 1)]
    assert all(r.error is None for r in results)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unthrottled-dense_allreduce-r0", "unthrottled-dense_allreduce-r1",
                                                         "unthrottled-gradzip_topk_1%-r0", "unthrottled-gradzip_topk_1%-r1"]
    assert "gradzip topk 1%-r1" in lines[-1]
    assert "Median of 2 repeats" in e2e.table(results, 4, 2)
    e2e.save(results, str(tmp_path / "r.json"))
    assert e2e.load(str(tmp_path / "r.json")) == results


def test_repeats_give_medians_and_ratios_paired_within_each_repeat():
    def repeat(k, dense_s, auto_s):
        return [e2e.Result("unthrottled", "dense allreduce", dense_s, dense_s / 300, 0.86, repeat=k),
                e2e.Result("unthrottled", "gradzip auto", auto_s, auto_s / 300, 0.85 + k / 1000, repeat=k,
                           note="none x8")]

    # The machine drifts between repeats: auto is 2%, 4% and 3% slower than dense in the same repeat.
    rows = repeat(0, 20.0, 20.4) + repeat(1, 25.0, 26.0) + repeat(2, 22.0, 22.66)
    dense, auto = e2e.medians(rows)
    assert (dense.epoch_s, auto.epoch_s, auto.accuracy, auto.note) == (22.0, 22.66, 0.851, "none x8")
    assert e2e._ratios(rows, "unthrottled", "gradzip auto", "dense allreduce") == pytest.approx([1.02, 1.04, 1.03])
    text = e2e.table(rows, 300, 4)
    assert "Median of 3 repeats" in text
    assert "| gradzip auto | 22.66 | 75.5 | - | 0.8510 | - | - | 0.97x (0.96-0.98) | - |" in text
    assert "auto 1.030x dense's epoch time (1.020x-1.040x over 3 repeats)" in text
    assert "(at most 1.03x dense: met)" in text


def test_a_crash_in_any_repeat_is_reported_as_a_crash():
    rows = [e2e.Result("unthrottled", "dense allreduce", 20.0, 0.07, 0.86, repeat=k) for k in range(3)]
    rows += [e2e.Result("unthrottled", "gradzip topk 1%", 21.0, 0.07, 0.85, repeat=0),
             e2e.Result("unthrottled", "gradzip topk 1%", error="worker(s) [1] failed (rank 1: SIGABRT)", repeat=1),
             e2e.Result("unthrottled", "gradzip topk 1%", 21.0, 0.07, 0.85, repeat=2)]
    text = e2e.table(rows, 300, 4)
    assert "| gradzip topk 1% | crashed: worker(s) [1] failed (rank 1: SIGABRT) (1 of 3 repeats) |" in text
    assert "completed on every link: NOT met (gradzip topk 1% did not)" in text


def test_repeats_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        e2e.run(links=["unthrottled"], repeats=0)


def test_a_refused_baseline_is_a_crashed_contender_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    results = e2e.run(links=["unthrottled"], workers=2, steps=2, contenders=[c for c in e2e.CONTENDERS
                                                                             if c[0] == "torch bf16 hook"],
                      out_dir=str(tmp_path), log=lambda line: None)
    assert results[0].error.startswith("baseline 'torch-bf16': PyTorch's bf16 hook refuses to run without CUDA")


def test_targets_against_pytorchs_hooks():
    rows = [e2e.Result("rate=1gbit", "dense allreduce", 10.0, 0.1, 0.80),
            e2e.Result("rate=1gbit", "torch fp16 hook", 8.0, 0.08, 0.80),
            e2e.Result("rate=1gbit", "torch bf16 hook", 8.0, 0.08, 0.80),
            e2e.Result("rate=1gbit", "no communication (limit)", 5.0, 0.05, 0.75),
            e2e.Result("rate=1gbit", "gradzip fp16", 7.6, 0.076, 0.80),
            e2e.Result("rate=1gbit", "gradzip bf16", 8.4, 0.084, 0.80),
            e2e.Result("rate=1gbit", "gradzip topk 1%", 6.0, 0.06, 0.78),
            e2e.Result("rate=1gbit", "gradzip auto", 8.4, 0.084, 0.80)]
    lines = "\n".join(e2e.targets(rows))
    assert "gradzip fp16 0.950x torch's fp16 hook (at most 1.0x: met)" in lines
    assert "gradzip bf16 1.050x torch's bf16 hook (at most 1.0x: NOT met)" in lines
    assert ("fastest gradzip method (gradzip topk 1%) 0.75x torch fp16 hook (0.8x: met), 1.20x the limit "
            "(1.2x: met)") in lines
    assert "auto 1.05x torch fp16 hook (0.8x: NOT met), 1.68x the limit (1.2x: NOT met)" in lines
    assert "auto 1.050x the faster of dense and torch fp16 (torch fp16 hook) (at most 1.03x: NOT met)" in lines

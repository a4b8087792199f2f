"""The end-to-end benchmark's own code: one tiny unthrottled run, the table and the target lines."""
from __future__ import annotations

from gradzip.bench import e2e


def test_tiny_unthrottled_run_reports_every_contender(tmp_path):
    contenders = [c for c in e2e.CONTENDERS if c[0] in ("dense allreduce", "gradzip topk 1%")]
    contenders.append(("gradzip auto", None, "auto", {"trials": 1}))  # decides at step 5
    results = e2e.run(links=["unthrottled"], workers=2, steps=6, contenders=contenders, test_size=200,
                      out_dir=str(tmp_path), log=lambda line: None)
    assert [r.label for r in results] == ["dense allreduce", "gradzip topk 1%", "gradzip auto"]
    for r in results:
        assert r.error is None and r.epoch_s > 0 and r.step_s > 0 and 0 <= r.accuracy <= 1
    assert results[0].mb_sent is None and results[1].mb_sent > 0
    auto = results[2]
    assert auto.note and " x" in auto.note
    text = e2e.table(results, 6, 2)
    assert "| gradzip topk 1% |" in text and "gradzip auto chose:" in text
    assert "every gradzip method completed on every link: met" in text
    e2e.save(results, str(tmp_path / "r.json"))
    assert e2e.load(str(tmp_path / "r.json")) == results


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


def test_plot_marks_a_crashed_contender_in_the_legend(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    legends = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (legends.extend(
        t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()), savefig(fig, *a, **k)))
    rows = [e2e.Result(link, "dense allreduce", t, t / 300, 0.8) for link, t in (("rate=100mbit", 200.0),
                                                                                   ("unthrottled", 20.0))]
    rows += [e2e.Result(link, "torch PowerSGD hook", error="worker(s) [0] failed")
             for link in ("rate=100mbit", "unthrottled")]
    e2e.plot(rows, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert legends == ["dense allreduce", "torch PowerSGD hook: crashed"]

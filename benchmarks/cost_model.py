"""Calibrate, validate and project the cost model (gradzip/costmodel.py); writes docs/results/cost_model.md.

    python benchmarks/cost_model.py            # full: N = 2, 4, 8 on 100 Mbit/s and 1 Gbit/s (root, ~10 min)
    python benchmarks/cost_model.py --quick    # reduced: N = 2, 4 on 100 Mbit/s, fewer steps

1. Calibration, in this process: the CNN's compute time per step and gradients (Fashion-MNIST, batch
   32), then each method's recorded collectives and codec time (gradzip.costmodel.profile_method).
2. Validation: per link and N, one emulated cluster of N workers times allreduces (-> alpha, beta of
   that link and N) and then trains each method for `steps` timed steps with DDP + gradzip.register,
   exactly the trainer's step (zero_grad, forward, backward with the hook, SGD step), plus DDP with a
   no-communication hook: the compute time at that N.  On this 2-core machine N workers share the cores,
   so compute time grows with N, and codec time is scaled by max(1, N / cores).  Predicted:
   T = T_nocomm(N) + T_codec(N) + (1 - overlap)·T_comm(N), with overlap = 0 and with the least-squares
   overlap over all runs.  All methods of one (link, N) run in one launch: a trainer run per
   method costs 20-50 s of process start-up and evaluation on this machine, which does not fit 10 minutes.
3. Projection for N = 2..1024 at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s (beta = the nominal rate, alpha
   fitted on the 1 Gbit/s link at N = 2), one worker per machine as fast as one core of this one.

All in-process timings use one thread (see main); the validation compares against what N processes on
this machine really do, so run it when nothing else is running.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gradzip  # noqa: E402
from gradzip import costmodel as cm  # noqa: E402
from gradzip.harness.data import load_dataset  # noqa: E402
from gradzip.harness.models import build_model  # noqa: E402
from gradzip.launcher import run_workers  # noqa: E402

# (label, method, params).  PowerSGD without its dense first steps: the timed steps are then steady.
VALIDATED = [("dense (none)", "none", {}), ("topk 1%", "topk", {"ratio": 0.01}),
             ("powersgd r2", "powersgd", {"rank": 2, "dense_steps": 0}), ("qsgd 2-bit", "qsgd", {"levels": 1})]
PROJECTED = VALIDATED + [("fp16", "fp16", {}), ("randomk 1%", "randomk", {"ratio": 0.01}),
                         ("dgc 0.1%", "dgc", {"ratio": 0.001}), ("efsignsgd", "efsignsgd", {}),
                         ("qsgd 4-bit", "qsgd", {"levels": 7})]
BATCH = 32


def _no_communication(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _measure(rank, world, x, y, info, methods, warmup, steps, link_sizes):
    """One worker of one (link, N) launch: allreduce timings, then each method's step time (median over
    steps of the slowest rank).

    The no-communication run goes first and last (the compute time is their mean), so slow drifts of
    the machine's load do not all land on one side.
    """
    points = cm.time_allreduces(link_sizes)
    x, y = x[rank::world], y[rank::world]  # this rank's shard
    out = {"link": points, "step_s": {}}
    for label, method, params in [("nocomm", None, {}), *methods, ("nocomm again", None, {})]:
        torch.manual_seed(0)
        model = build_model("cnn", info)
        net = torch.nn.parallel.DistributedDataParallel(model)
        momentum = 0.9
        if method is None:
            net.register_comm_hook(None, _no_communication)
        else:
            if gradzip.make(method, **params).applies_momentum:  # DGC, Signum: the optimizer adds none
                momentum = 0.0
            gradzip.register(net, method, **params)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
        times = []
        for i in range(warmup + steps):
            xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
            # Every step starts together, untimed, as the collectives of a real run force anyway; without
            # it the no-communication ranks drift apart and share the cores unevenly (too fast at N > cores).
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
            times.append(time.perf_counter() - start)
        # A step ends when its slowest rank is done: with communication every rank waits for it anyway,
        # without, rank 0's own time would miss the stragglers of N processes sharing the cores.
        slowest = torch.tensor(times[warmup:], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        # The median: one step hit by another process's burst should not move the whole run.
        out["step_s"][label] = float(slowest.median())
    out["step_s"]["nocomm"] = (out["step_s"]["nocomm"] + out["step_s"].pop("nocomm again")) / 2
    return out


def main(workers=(2, 4, 8), links=("rate=100mbit", "rate=1gbit"), warmup=5, steps=20,
         out="docs/results/cost_model.md", command=""):
    t_start = time.perf_counter()
    cores = os.cpu_count() or 1
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)  # noqa: E731

    # 1. Calibration in this process, on one thread: the validation workers run one thread each (as the
    # trainer does for N >= cores), and a 2-thread OpenMP team on a loaded 2-core machine times erratically.
    torch.set_num_threads(1)
    compute = cm.measure_compute("cnn", "fashion-mnist", batch_size=BATCH, steps=10)
    compute_s, timeline = compute.seconds, compute.timeline
    log(f"compute {1e3 * compute_s:.1f} ms/step (1 thread), backward ends at {timeline.backward_end:.0%}")
    profiles = {label: cm.profile_method(compute.grads, m, p, label=label) for label, m, p in PROJECTED}
    for p in profiles.values():
        log(f"{p.label:14s} {p.wire_bytes:9d} B/step in {len(p.collectives)} collectives, "
            f"codec {1e3 * p.codec_s:.1f} ms + {1e3 * p.codec_per_worker_s:.2f} ms/worker")

    # 2. Validation.
    data, info = load_dataset("fashion-mnist", train=True)
    need = max(workers) * BATCH * (warmup + steps)
    x, y = data[:need]
    rows, links_fitted = [], {}
    for link_spec in links:
        for n in workers:
            res = run_workers(_measure, n, x[:n * BATCH * (warmup + steps)], y[:n * BATCH * (warmup + steps)],
                              info, VALIDATED, warmup, steps, cm.LINK_SIZES, netem=link_spec, timeout=400)
            link = cm.fit_link(res["link"])
            links_fitted[link_spec, n] = link
            nocomm = res["step_s"]["nocomm"]
            log(f"{link_spec} N={n}: {link}; nocomm {1e3 * nocomm:.1f} ms")
            for label, _, _ in VALIDATED:
                p = profiles[label]
                scale = max(1.0, n / cores)
                pred = cm.step_time(p, nocomm, link, n, codec_scale=scale)
                pred["timeline_s"] = cm.step_time(p, nocomm, link, n, codec_scale=scale, timeline=timeline)["step_s"]
                rows.append({"link": link_spec, "workers": n, "label": label, "measured": res["step_s"][label],
                             **pred})
                log(f"  {label:14s} measured {1e3 * rows[-1]['measured']:7.1f} ms  predicted "
                    f"{1e3 * pred['step_s']:7.1f} ms (no overlap), {1e3 * pred['timeline_s']:7.1f} ms (timeline)")
    overlap = cm.fit_overlap([r["measured"] for r in rows], [r["compute_s"] + r["codec_s"] for r in rows],
                             [r["comm_s"] for r in rows])
    for r in rows:
        r["fitted"] = r["compute_s"] + r["codec_s"] + (1 - overlap) * r["comm_s"]

    # 3. Projection.
    ref = links_fitted.get(("rate=1gbit", 2))
    if ref is not None and ref.alpha > 0:
        alpha, source = ref.alpha, "fitted on the emulated 1 Gbit/s link at N = 2"
    else:
        alpha, source = cm.DEFAULT_ALPHA, "gradzip.costmodel.DEFAULT_ALPHA"
    tables = []
    for rate in ("100mbit", "1gbit", "10gbit"):
        link = cm.Link.from_rate(rate, alpha)
        rows_n = cm.project(list(profiles.values()), compute_s, link, timeline=timeline)
        tables.append((rate, cm.format_projection(rows_n)))

    text = _report(rows, overlap, links_fitted, list(profiles.values()), compute, (alpha, source), tables, cores,
                   warmup, steps, command, time.perf_counter() - t_start)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    log(f"wrote {out}")
    return rows


def _pct(pred, measured):
    return f"{100 * (pred - measured) / measured:+.0f}%"


def _report(rows, overlap, links, projected, compute, alpha_source, tables, cores, warmup, steps, command, wall):
    alpha, source = alpha_source
    mae = lambda key: 100 * statistics.mean(abs(r[key] - r["measured"]) / r["measured"] for r in rows)  # noqa: E731
    dense = next(p for p in projected if p.method == "none")
    ready = ", ".join(f"bucket {i + 1} ({len(names)} tensors) at {compute.timeline.bucket_ready(names):.0%}"
                      for i, names in enumerate(dense.bucket_names))
    lines = [
        "# Cost model: validation and projection", "",
        f"Generated by `{command}` in {wall:.0f} s on {platform.node() or 'this machine'} "
        f"({cores} CPU cores, torch {torch.__version__}).  The model and its assumptions: gradzip/costmodel.py.", "",
        "## Validation: predicted vs measured step time", "",
        f"Fashion-MNIST CNN, batch {BATCH} per worker, DDP + gradzip hook; measured = median over {steps} steps "
        f"(after {warmup} warm-up steps) of the slowest rank's step; every worker in its own network namespace "
        "behind a tbf-shaped link.  Per (link, N): alpha and beta fitted to that launch's allreduce timings; "
        "compute = the no-communication hook's step at that N (run first and last; "
        f"N workers share {cores} cores); codec measured in-process on one thread, times max(1, N/{cores}).  "
        "Two predictions: no overlap (T = compute + codec + comm) and the bucket timeline (each bucket's "
        f"communication starts when its gradients are ready, measured in-process: {ready}, backward ends at "
        f"{compute.timeline.backward_end:.0%} of the step; codec time is never hidden).",
        "",
        "| link | N | link fitted | method | measured ms | compute | codec | comm | no overlap | error | timeline "
        "| error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['link'].removeprefix('rate=')} | {r['workers']} | {links[r['link'], r['workers']]} | {r['label']} | "
            f"{1e3 * r['measured']:.1f} | {1e3 * r['compute_s']:.1f} | {1e3 * r['codec_s']:.1f} | "
            f"{1e3 * r['comm_s']:.1f} | {1e3 * r['step_s']:.1f} | {_pct(r['step_s'], r['measured'])} | "
            f"{1e3 * r['timeline_s']:.1f} | {_pct(r['timeline_s'], r['measured'])} |")
    lines += [
        "", f"Mean absolute error: {mae('step_s'):.0f}% without overlap, {mae('timeline_s'):.0f}% with the bucket "
        f"timeline; a constant overlap factor fitted to these same runs (least squares) is {overlap:.2f} and gives "
        f"{mae('fitted'):.0f}%.",
        "", "## What each method sends (per worker per step, recorded from gradzip's own collectives)", "",
        "| method | bytes | collectives | kinds and bytes | density | codec ms (1 worker) | + ms per extra worker |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in projected:
        kinds = ", ".join(f"{c.kind} {c.nbytes}" for c in p.collectives)
        lines.append(f"| {p.label} | {p.wire_bytes} | {len(p.collectives)} | {kinds} | {p.density:.4f} | "
                     f"{1e3 * p.codec_s:.1f} | {1e3 * p.codec_per_worker_s:.2f} |")
    lines += ["", "## Projection", "",
              f"One worker per machine, each as fast as one core here: compute {1e3 * compute.seconds:.1f} ms/step, "
              f"codec as above; beta = the nominal rate, alpha = {alpha * 1e6:.0f} us ({source}); bucket timeline "
              "overlap.  Ring collectives throughout (real libraries switch to trees at large N: latency-bound "
              "cells there are pessimistic).  Cells: step time (speedup vs dense).", ""]
    for rate, table in tables:
        lines += [f"### {rate}", "", table, ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 2, 4 on 100 Mbit/s only, 10 timed steps")
    parser.add_argument("--workers", default=None, help="comma-separated worker counts (default 2,4,8)")
    parser.add_argument("--links", default=None, help="comma-separated netem specs (default rate=100mbit,rate=1gbit)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "docs/results/cost_model.md"))
    args = parser.parse_args()
    workers = (2, 4) if args.quick else (2, 4, 8)
    links = ("rate=100mbit",) if args.quick else ("rate=100mbit", "rate=1gbit")
    if args.workers:
        workers = tuple(int(n) for n in args.workers.split(","))
    if args.links:
        links = tuple(args.links.split(","))
    steps = args.steps or (10 if args.quick else 20)
    main(workers, links, steps=steps, out=args.out,
         command=" ".join(["python benchmarks/cost_model.py", *sys.argv[1:]]))

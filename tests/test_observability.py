"""What a user can see of a run: ``GradzipState.describe()``, the ``gradzip`` log lines, and the exact
meaning of ``stats()``'s per-element fields, in real 2-process gloo jobs where the numbers depend on them."""
from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import gradzip
from gradzip.bits import index_dtype
from tests import workers
from tests.distributed import run_workers

STEPS = 3
TOPK_LINE = "topk(value_dtype=None, ratio=0.01); feedback residual; world size 2; route: bucket on CUDA, per-tensor on CPU"
FP16_LINE = "fp16(); feedback none; world size 2; route: bucket on CUDA, per-tensor on CPU"


class _Lines(logging.Handler):
    """Keeps the messages logged under ``gradzip`` in a worker process."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((record.name, record.getMessage()))


def _listen() -> _Lines:
    lines = _Lines()
    logger = logging.getLogger("gradzip")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    return lines


def _train_ddp(rank, method, steps, **params):
    model = workers.small_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    state = gradzip.register(ddp, method, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = workers.batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return ddp, state


def plain_methods(rank, world):
    """Top-k and fp16 under the DDP hook: describe(), stats(), the log, and a second register()."""
    lines = _listen()
    out = {}
    for method, params in (("topk", {"ratio": 0.01}), ("fp16", {})):
        ddp, state = _train_ddp(rank, method, STEPS, **params)
        sizes = [p.numel() for p in ddp.module.parameters()]
        out[method] = {"describe": state.describe(), "text": state.describe(as_text=True), "stats": state.stats(),
                       "bucket_stats": state.bucket_stats(), "sizes": sizes,
                       "named_sizes": {name: p.numel() for name, p in ddp.module.named_parameters()},
                       "exchanged": [(keys, record["exchanges"]) for keys, record in state._bucket_records()]}
        try:
            gradzip.register(ddp, "topk")
        except ValueError as exc:
            out[method]["again"] = str(exc)
        state.close()
    out["log"] = lines.lines
    return out


@pytest.fixture(scope="module")
def plain():
    return run_workers(plain_methods, 2)


def test_describe_names_method_parameters_feedback_route_and_buckets(plain):
    for rank, out in enumerate(plain):
        topk = out["topk"]
        d = topk["describe"]
        assert (d["method"], d["params"], d["feedback"], d["world_size"]) == ("topk", {"value_dtype": None, "ratio": 0.01},
                                                                            "residual", 2)
        assert (d["route"], d["group_vectors_below"]) == ("bucket on CUDA, per-tensor on CPU", 0)
        assert [{k: v for k, v in b.items() if k != "route"} for b in d["buckets"]] == topk["bucket_stats"]
        assert {b["route"] for b in d["buckets"]} == {"per-tensor"}  # CPU gradients
        # DDP's first step sends every gradient in one bucket, then it rebuilds its buckets.
        first, *rebuilt = d["buckets"]
        assert (first["tensors"], first["elements"], first["exchanges"]) == (6, sum(topk["sizes"]), 1)
        assert sum(b["elements"] for b in rebuilt) == sum(topk["sizes"]) and len(rebuilt) > 1
        assert {b["exchanges"] for b in rebuilt} == {STEPS - 1}
        assert topk["text"].splitlines()[0] == TOPK_LINE
        assert len(topk["text"].splitlines()) == 1 + len(d["buckets"])
        assert "auto" not in d
        # fp16 without feedback is one plain allreduce in DDP's own C++ path, bucket after bucket.
        assert {b["route"] for b in out["fp16"]["describe"]["buckets"]} == {"plain allreduce"}


def test_bits_per_element_is_exact(plain):
    for out in plain:
        fp16 = out["fp16"]["stats"]
        assert fp16["bits_per_element"] == 16.0 and fp16["density"] == 1.0
        topk, sizes = out["topk"]["stats"], out["topk"]["sizes"]
        # Each exchange allgathers the ceil(1% n) kept elements of each tensor as 4-byte values and indices
        # of the smallest integer type that addresses n, plus the one-byte non-finite flag, each rank's
        # row padded to 16 bytes (2 ranks: so that every rank's row starts where a field can be viewed).
        kept = sum(math.ceil(0.01 * n) for n in sizes)
        sent = lambda n: math.ceil(0.01 * n) * (4 + index_dtype(n).itemsize)  # noqa: E731
        payload = sum(sent(n) for n in sizes)
        named = out["topk"]["named_sizes"]
        wire = sum(count * -(-(sum(sent(named[k]) for k in keys) + 1) // 16) * 16 for keys, count in out["topk"]["exchanged"])
        assert topk["payload_bytes"] == STEPS * payload and topk["exchanges"] == sum(c for _, c in out["topk"]["exchanged"])
        assert topk["bytes_sent"] == wire
        assert topk["bits_per_element"] == 8 * wire / (STEPS * sum(sizes))
        assert topk["density"] == kept / sum(sizes)
        assert topk["ratio"] == 4 * STEPS * sum(sizes) / wire


def test_registration_is_logged_once_per_state(plain):
    for out in plain:
        registered = [m for name, m in out["log"] if name == "gradzip.integrations.ddp"]
        assert registered == [f"gradzip.register: {TOPK_LINE}", f"gradzip.register: {FP16_LINE}"]


def test_a_second_register_is_gradzips_one_line_error(plain):
    for out in plain:
        for method in ("topk", "fp16"):
            assert out[method]["again"] == (
                "gradzip.register() was already called on this DDP model, and DDP takes one hook per model: "
                "keep the state the first register() returned, or wrap the module in a new DistributedDataParallel")


def auto_settles(rank, world, steps):
    """auto (none or Top-k) with the optimizer integration, until every bucket has decided."""
    lines = _listen()
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), "auto",
                                       candidates=["none", "topk:ratio=0.01"], warmup=0, trials=1, verify=1,
                                       bucket_cap_mb=0.004)
    state = opt.gradzip_state
    for step in range(steps):
        x, y = workers.batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    recorded = {key: {name: slot[name] for name in ("auto_cost", "auto_explored", "auto_step_cost") if name in slot}
                for key, slot in state.tensors.items()}
    return {"describe": state.describe(), "text": state.describe(as_text=True),
            "choices": state.compressor.choices(state.tensors), "recorded": recorded, "log": lines.lines,
            "buckets": [[name for name, _ in bucket] for bucket in opt._buckets]}


def test_auto_describe_reports_what_it_recorded_and_logs_each_bucket_once():
    # Two candidates, one trial each: plan at step 2; plan and dense verified by step 11.
    results = run_workers(auto_settles, 2, 13)
    candidates = ["none", "topk:ratio=0.01"]
    assert results[0]["choices"] == results[1]["choices"]  # agreed
    for rank, out in enumerate(results):
        d = out["describe"]
        assert (d["method"], d["world_size"], d["feedback"]) == ("auto", 2, "residual")
        assert set(d["auto"]) == {name for bucket in out["buckets"] for name in bucket}
        assert {k: v["choice"] for k, v in d["auto"].items()} == out["choices"]
        for key, decision in d["auto"].items():
            assert decision["stage"] == "chosen"
            recorded = out["recorded"][key]
            assert decision["exchange_s"] == dict(zip(candidates, recorded["auto_cost"].tolist()))
            assert decision["explored_step_s"] == dict(zip(candidates, recorded["auto_explored"].tolist()))
            if "auto_step_cost" in recorded:
                plan_s, dense_s = recorded["auto_step_cost"].tolist()
                assert decision["step_s"] == {"plan": plan_s, "dense": dense_s}
            else:
                assert decision["step_s"] is None
            assert decision["reason"]
        # Each bucket: its tensors' choices, and one log line when it settled.
        assert [list(b["choices"]) for b in d["buckets"]] == out["buckets"]
        expected = []
        for bucket in d["buckets"]:
            (spec,) = set(bucket["choices"].values())
            why = d["auto"][next(iter(bucket["choices"]))]["reason"]
            name = bucket["bucket"] + (f" ({bucket['tensors']} tensors)" if bucket["tensors"] > 1 else "")
            expected.append(f"auto on rank {rank} settled bucket {name}: {spec} ({why})")
            assert f"; auto: {spec} ({why})" in out["text"]
        settled = [m for name, m in out["log"] if name == "gradzip.compressors.auto"]
        assert sorted(settled) == sorted(expected)  # in the order the buckets settled
        registered = [m for name, m in out["log"] if name == "gradzip.integrations.optimizer"]
        assert registered == [f"gradzip.DistributedOptimizer: {out['text'].splitlines()[0]}; 6 parameter tensors in "
                              f"{len(out['buckets'])} buckets"]


def test_nothing_is_logged_by_default_and_info_shows_construction(caplog):
    # No process group: the optimizer's state connects (world size 1) on first use; DiLoCo's at once.
    model = workers.small_model()
    gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "topk")
    gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=5, compressor="fp16")
    assert [r for r in caplog.records if r.name.startswith("gradzip")] == []
    caplog.set_level(logging.INFO, logger="gradzip")
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "topk")
    outer = gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=5, compressor="fp16")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("gradzip.integrations.optimizer", logging.INFO, "gradzip.DistributedOptimizer: topk(value_dtype=None, "
         "ratio=0.01); feedback residual; world size not known yet; route: bucket on CUDA, per-tensor on CPU; "
         "6 parameter tensors in 1 buckets"),
        ("gradzip.integrations.diloco", logging.INFO, "gradzip.DiLoCo: sync_every=5, fragments=1, outer_lr=0.7, "
         "outer_momentum=0.5, overlap=False; outer exchange: fp16(); feedback none; world size 1; route: bucket on "
         "CUDA, per-tensor on CPU")]
    assert opt.gradzip_state.describe()["buckets"] == [] and outer.state.describe()["method"] == "fp16"
    assert not logging.getLogger("gradzip").handlers  # gradzip adds no handler of its own

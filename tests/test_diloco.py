"""gradzip.DiLoCo: the outer loop of DiLoCo / Streaming DiLoCo, in real 2-process gloo groups.

The distributed checks share one pair of processes (``_scenarios``, a module fixture); each scenario reports
its own error, so one broken feature fails only its test.  Resuming uses fresh processes, and the dead- and
stuck-peer checks each use a pair of their own.
"""
from __future__ import annotations

import datetime
import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradzip
from gradzip import kernels
from tests.workers import run_scenarios
from tests import workers
from tests.distributed import run_workers

H = 2  # sync_every in the methods scenario


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, 5))


def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _inner_step(model, opt, rank, step):
    x, y = workers.batch(rank, step)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _outer_params(name):
    params = workers.params_for(name)
    if name == "powersgd":
        params = {"rank": 1, "dense_steps": 0}  # compress from the first sync on
    if name == "topk":
        params = {"ratio": 0.1}
    if name == "dgc":
        params = {**params, "warmup_steps": 0}  # DGC's warm-up counts exchanges: here, syncs
    momentum = 0.0 if gradzip.make(name, **params).applies_momentum else 0.9
    return params, momentum


# -- scenarios (run in the spawned processes) -------------------------------------------------------------
# Top-k with bf16 values and residual error feedback in place of outer momentum: the other way to drop it.
TOPK_NO_MOMENTUM = ("topk", {"ratio": 0.05, "value_dtype": "bfloat16"}, 0.0)


def scenario_methods(rank, world, tmp):
    """Every gradzip method as the outer compressor, from replicas that start different."""
    out = {}
    configs = {name: (name, *_outer_params(name)) for name in gradzip.compressors()}
    configs["topk_bf16_no_momentum"] = TOPK_NO_MOMENTUM
    for label, (name, params, momentum) in configs.items():
        model = _model(seed=rank)
        before = _flat(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = gradzip.DiLoCo(model, opt, sync_every=H, compressor=name, outer_momentum=momentum, **params)
        start = _flat(model)
        synced, between = [], []
        for step in range(3 * H):
            _inner_step(model, opt, rank, step)
            (synced if outer.step() else between).append(_flat(model))
        s = outer.stats()
        out[label] = {"before": before, "start": start, "synced": synced, "between": between,
                     "stats": {k: s[k] for k in ("syncs", "inner_steps", "bytes_sent", "bytes_per_inner_step",
                                                 "ddp_bytes_per_inner_step", "exchanges", "fragment_syncs")}}
    return out


def scenario_averaging(rank, world, tmp):
    """sync_every=1, dense, outer_lr=1, no momentum: one step of synchronous parameter averaging."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gradzip.DiLoCo(model, opt, sync_every=1, compressor="none", outer_lr=1.0, outer_momentum=0.0)
    rounds = []
    for step in range(3):
        start = _flat(model)
        _inner_step(model, opt, rank, step)
        local = _flat(model)
        outer.step()
        rounds.append((start, local, _flat(model)))
    return rounds


def scenario_fragments(rank, world, tmp):
    """Two fragments, sync_every=4: fragment 0 syncs at steps 4, 8; fragment 1 at 2, 6, 10."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # 128, 16, 64, 4 elements
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gradzip.DiLoCo(model, opt, sync_every=4, fragments=2, compressor="fp16")
    due, exchanged, params = [], [], []
    for step in range(10):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        due.append(outer.step())
        exchanged.append(dict(outer.state.steps))
        params.append([p.detach().clone() for p in model.parameters()])
    names = [[n for n, _ in frag] for frag in outer.fragments]
    return {"due": due, "exchanged": exchanged, "params": params, "names": names,
            "fragment_syncs": outer.stats()["fragment_syncs"], "syncs": outer.stats()["syncs"]}


def scenario_ddp_refused(rank, world, tmp):
    ddp = nn.parallel.DistributedDataParallel(_model())
    try:
        gradzip.DiLoCo(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), sync_every=2)
    except ValueError as exc:
        return str(exc)
    return None


def scenario_compiled(rank, world, tmp):
    """DiLoCo of ``torch.compile(model)``: its state names the model's own parameters, so a checkpoint
    loads into a run of the model uncompiled; a compiled DDP model is refused as DDP is."""
    model = _model()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    outer = gradzip.DiLoCo(compiled, opt, sync_every=2, compressor="topk", ratio=0.1, outer_momentum=0.0)
    for step in range(2):
        _inner_step(model, opt, rank, step)  # the same parameters: no graph to trace in this test
        outer.step()
    saved = outer.state_dict()
    plain = gradzip.DiLoCo(model, opt, sync_every=2, compressor="topk", ratio=0.1, outer_momentum=0.0)
    plain.load_state_dict(saved)
    ddp = torch.compile(nn.parallel.DistributedDataParallel(_model()), backend="eager")
    try:
        gradzip.DiLoCo(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), sync_every=2)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"theta": list(saved["theta"]), "names": [n for n, _ in model.named_parameters()],
            "syncs": outer.stats()["syncs"], "refused": refused}


def scenario_buffers(rank, world, tmp):
    """Buffers (float and bool) come from rank 0 too."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.tensor([rank == 0, rank == 1]))
    with torch.no_grad():
        model[1].running_mean.fill_(rank + 1.0)
    gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    return {name: b.clone() for name, b in model.named_buffers()}


def scenario_overlap(rank, world, tmp):
    """overlap=True, sync_every=4, two fragments (due at 4, 8 and 2, 6, 10): each exchange is merged one
    step late.  Records the replica and theta_g after every step, for merge_alpha 0 and 0.5."""
    out = {}
    for alpha in (0.0, 0.5):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # fragments: 0.weight | the rest
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = gradzip.DiLoCo(model, opt, sync_every=4, fragments=2, compressor="topk", ratio=0.25,
                               overlap=True, merge_alpha=alpha)
        steps = []
        for step in range(10):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            local = [p.detach().clone() for p in model.parameters()]
            due = outer.step()
            theta = {k: v.clone() for k, v in outer.global_parameters().items()}
            steps.append({"due": due, "local": local, "after": [p.detach().clone() for p in model.parameters()],
                          "theta": theta})
        outer.wait()
        out[alpha] = {"steps": steps, "final": [p.detach().clone() for p in model.parameters()],
                      "theta": {k: v.clone() for k, v in outer.theta.items()},
                      "own_group": outer.state.transport.group is not dist.group.WORLD}
        outer.close()
    return out


RESUME = dict(sync_every=3, fragments=2, compressor="topk", ratio=0.1, outer_momentum=0.9)
BEFORE, AFTER = 5, 6  # checkpoint mid-period: fragment 0 syncs at 3, 6, 9; fragment 1 at 1, 4, 7, 10
# With overlap, save at step 4, while fragment 1's exchange started at step 4 is in flight.
RESUMES = {"plain": (RESUME, BEFORE), "overlap": ({**RESUME, "overlap": True, "merge_alpha": 0.5}, 4)}


def _resume_setup(seed, kind):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, gradzip.DiLoCo(model, opt, **RESUMES[kind][0])


def scenario_checkpoint(rank, world, tmp):
    out = {}
    for kind, (_, before) in RESUMES.items():
        model, opt, outer = _resume_setup(seed=rank, kind=kind)
        for step in range(before):
            _inner_step(model, opt, rank, step)
            outer.step()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "outer": outer.state_dict()},
                   os.path.join(tmp, f"ckpt-{kind}-{rank}.pt"))
        out[kind] = _finish(model, opt, outer, rank, before)
    return out


def _finish(model, opt, outer, rank, before):
    """The steps after the checkpoint, then merge what is in flight."""
    for step in range(before, BEFORE + AFTER):
        _inner_step(model, opt, rank, step)
        outer.step()
    outer.wait()
    return {"params": _flat(model), "stats": outer.stats()["fragment_syncs"]}


SCENARIOS = ["methods", "averaging", "fragments", "overlap", "ddp_refused", "compiled", "buffers", "checkpoint"]


def _scenarios(rank, world, tmp):
    return run_scenarios({name: globals()[f"scenario_{name}"] for name in SCENARIOS}, rank, world, tmp)


def _resumed(rank, world, tmp):
    """A fresh process: build everything, then load this rank's checkpoint (after the constructor's
    broadcast, which would otherwise overwrite this replica with rank 0's), and go on."""
    out = {}
    for kind, (_, before) in RESUMES.items():
        model, opt, outer = _resume_setup(seed=7, kind=kind)
        saved = torch.load(os.path.join(tmp, f"ckpt-{kind}-{rank}.pt"), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        outer.load_state_dict(saved["outer"])
        out[kind] = _finish(model, opt, outer, rank, before)
    return out


def _lost_peer(rank, world, how, overlap, store_path):
    """Rank 1 exits (or hangs) just before the second sync; rank 0 must fail fast with a clear error (with
    overlap: when it waits for that sync's exchange, at the next step)."""
    dist.destroy_process_group()
    # The group's 5 s timeout is for its collectives; the rendezvous gets a store of its own with a longer
    # one, since on a loaded machine a rank can take more than 5 s to get here.
    store = dist.FileStore(store_path, world)
    store.set_timeout(datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=5))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = gradzip.DiLoCo(model, opt, sync_every=2, compressor="topk", ratio=0.1, overlap=overlap)
    for step in range(5):
        _inner_step(model, opt, rank, step)
        if rank == 1 and step == 3:
            if how == "exits":
                os._exit(0)
            time.sleep(120)
        start = time.monotonic()
        try:
            outer.step()
        except RuntimeError as exc:
            raise RuntimeError(f"rank {rank} stopped after {time.monotonic() - start:.1f} s: {exc}") from None
    return None


# -- tests ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("diloco"))


@pytest.fixture(scope="module")
def ranks(ckpt_dir):
    return run_workers(_scenarios, 2, ckpt_dir, timeout=180)


def _result(ranks, name):
    for r in ranks:
        if isinstance(r[name], dict) and "error" in r[name]:
            pytest.fail(f"scenario {name} raised:\n{r[name]['error']}")
    return [r[name] for r in ranks]


@pytest.mark.parametrize("name", [*gradzip.compressors(), "topk_bf16_no_momentum"])
def test_replicas_start_equal_and_are_bit_identical_after_every_sync(ranks, name):
    r0, r1 = (r[name] for r in _result(ranks, "methods"))
    assert not torch.equal(r0["before"], r1["before"])  # different seeds: different initial replicas
    assert torch.equal(r0["start"], r0["before"]) and torch.equal(r1["start"], r0["before"])  # rank 0's
    assert len(r0["synced"]) == 3 and len(r0["between"]) == 3
    for a, b in zip(r0["synced"], r1["synced"]):
        assert torch.equal(a, b)
    for a, b in zip(r0["between"], r1["between"]):
        assert not torch.equal(a, b)  # between syncs each replica trains on its own data
    assert not torch.equal(r0["synced"][-1], r0["start"])
    s = r0["stats"]
    assert s["syncs"] == s["exchanges"] == 3 and s["inner_steps"] == 3 * H and s["fragment_syncs"] == [3]
    assert s["bytes_sent"] > 0 and s["bytes_per_inner_step"] == s["bytes_sent"] / (3 * H)


def test_dense_bytes_are_the_parameters_once_per_sync(ranks):
    s = _result(ranks, "methods")[0]["none"]["stats"]
    assert s["ddp_bytes_per_inner_step"] == sum(p.numel() * 4 for p in _model().parameters())
    # fp32 pseudo-gradients plus gradzip's 4-byte health flag, once per sync
    assert s["bytes_sent"] == s["syncs"] * (s["ddp_bytes_per_inner_step"] + 4)
    assert _result(ranks, "methods")[0]["topk"]["stats"]["bytes_sent"] < s["bytes_sent"] / 3  # ratio 0.1


def test_sync_every_step_with_unit_outer_lr_and_no_momentum_is_parameter_averaging(ranks):
    r0, r1 = _result(ranks, "averaging")
    for (start, a, after0), (start1, b, after1) in zip(r0, r1):
        assert torch.equal(start, start1) and torch.equal(after0, after1)
        assert not torch.equal(a, b)
        # gradzip's dense mean divides each worker's pseudo-gradient by N before summing.
        expected = start - ((start - a) / 2 + (start - b) / 2)
        assert torch.equal(after0, expected)
        torch.testing.assert_close(after0, (a + b) / 2, rtol=0, atol=1e-6)


def test_fragments_sync_at_staggered_steps(ranks):
    r0, r1 = _result(ranks, "fragments")
    assert r0["names"] == [["0.weight"], ["0.bias", "2.weight", "2.bias"]]  # 128 | 84 elements
    expected_due = [(1,) if t in (2, 6, 10) else (0,) if t in (4, 8) else () for t in range(1, 11)]
    assert r0["due"] == expected_due
    assert r0["fragment_syncs"] == [2, 3] and r0["syncs"] == 5
    final = r0["exchanged"][-1]
    assert final == {"0.weight": 2, "0.bias": 3, "2.weight": 3, "2.bias": 3}
    assert r0["exchanged"][1] == {"0.bias": 1, "2.weight": 1, "2.bias": 1}  # step 2: fragment 1 only
    for t, due in enumerate(r0["due"]):
        p0, p1 = r0["params"][t], r1["params"][t]
        for f, idx in ((0, [0]), (1, [1, 2, 3])):
            same = all(torch.equal(p0[i], p1[i]) for i in idx)
            assert same == (f in due), (t + 1, f)  # synced fragments equal, the other still local


def test_ddp_wrapper_is_refused_with_a_pointer_to_module(ranks):
    msg = _result(ranks, "ddp_refused")[0]
    assert msg is not None and "ddp_model.module" in msg and "\n" not in msg


def test_a_compiled_model_keeps_its_own_parameter_names(ranks):
    for result in _result(ranks, "compiled"):
        assert result["theta"] == result["names"] and result["syncs"] == 1, result
        assert result["refused"] is not None and "ddp_model.module" in result["refused"], result["refused"]


def test_buffers_are_broadcast_from_rank_0_at_construction(ranks):
    b0, b1 = _result(ranks, "buffers")
    assert b0.keys() == b1.keys() and all(torch.equal(b0[k], b1[k]) for k in b0)
    assert torch.equal(b1["mask"], torch.tensor([True, False]))
    assert torch.equal(b1["1.running_mean"], torch.ones(4))


@pytest.fixture(scope="module")
def resumed(ranks, ckpt_dir):
    _result(ranks, "checkpoint")  # the checkpoints exist
    return run_workers(_resumed, 2, ckpt_dir, timeout=120)


@pytest.mark.parametrize("kind", RESUMES)
def test_resume_from_a_checkpoint_continues_bit_for_bit(ranks, resumed, kind):
    straight = _result(ranks, "checkpoint")
    for a, b in zip(straight, resumed):
        assert torch.equal(a[kind]["params"], b[kind]["params"])
        assert a[kind]["stats"] == b[kind]["stats"] == [3, 4]


def _check_overlap(r0, r1, alpha):
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    fragment_of = {0: 0, 1: 1, 2: 1, 3: 1}
    due = [s["due"] for s in r0["steps"]]
    assert due == [(1,) if t in (2, 6, 10) else (0,) if t in (4, 8) else () for t in range(1, 11)]
    for t in range(10):
        a, b = r0["steps"][t], r1["steps"][t]
        assert all(torch.equal(a["theta"][k], b["theta"][k]) for k in names)  # theta_g: equal on every rank
        merged = r0["steps"][t - 1]["due"] if t else ()
        for i, name in enumerate(names):
            if fragment_of[i] in merged:
                # merged one step late: alpha * (this step's local value) + (1 - alpha) * the new theta_g
                assert torch.equal(a["after"][i], a["local"][i].mul(alpha).add(a["theta"][name], alpha=1 - alpha))
                assert torch.equal(a["after"][i], b["after"][i]) == (alpha == 0), (t + 1, name)
            else:
                assert torch.equal(a["after"][i], a["local"][i]), (t + 1, name)  # not merged: untouched
                assert not torch.equal(a["after"][i], b["after"][i])  # and still each rank's own


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_overlap_merges_each_exchange_one_step_late(ranks, alpha):
    r0, r1 = (r[alpha] for r in _result(ranks, "overlap"))
    assert r0["own_group"] and r1["own_group"]  # exchanges on gradzip's thread use a group of their own
    _check_overlap(r0, r1, alpha)
    # after wait() the last exchange (step 10, fragment 1) is merged too
    for i in (1, 2, 3):
        assert torch.equal(r0["final"][i], r1["final"][i]) == (alpha == 0)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(torch.equal(r0["theta"][k], r1["theta"][k]) for k in names)


@pytest.mark.parametrize("how", ["exits", "hangs"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_lost_peer_stops_the_others_with_a_clear_error(how, overlap, tmp_path):
    with pytest.raises(RuntimeError) as err:
        run_workers(_lost_peer, 2, how, overlap, str(tmp_path / "store"), timeout=60)
    text = str(err.value)
    found = re.search(r"rank 0 stopped after ([\d.]+) s: DiLoCo: the sync at inner step 4 failed", text)
    assert found, text[-2000:]
    # A closed connection fails at once; a silent peer after the group's 5 s timeout.
    assert float(found.group(1)) < 3 if how == "exits" else 4 < float(found.group(1)) < 15


# -- single process (world size 1) -------------------------------------------------------------------------
def _single(**kwargs):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, gradzip.DiLoCo(model, opt, **{"sync_every": 2, **kwargs})


def test_an_overlapped_exchange_compiles_no_kernel(monkeypatch):
    """overlap=True: the exchange runs on gradzip's thread beside the inner steps, and a kernel compiled
    in-process meanwhile would make ``torch.compiler.is_compiling()`` true for them too (an optimizer's
    step then rounds otherwise); it takes the reference paths instead.  The same exchanges made in
    step compile theirs (here a stand-in for ``torch.compile`` that records where it was called)."""
    compiled = []

    def recorded(fn, **options):
        compiled.append(threading.current_thread().name)
        return fn
    monkeypatch.setattr(torch, "compile", recorded)
    monkeypatch.setattr(kernels, "MIN_NUMEL", 1)
    for kernel in kernels.KERNELS:  # every tensor large enough for its kernel, none compiled yet
        monkeypatch.setattr(kernel, "min_numel", 1)
        monkeypatch.setattr(kernel, "_compiled", {})
    for overlap in (True, False):
        model, opt, outer = _single(sync_every=2, overlap=overlap, compressor="qsgd")
        for step in range(5):
            _inner_step(model, opt, 0, step)
            outer.step()
        outer.close()
        assert outer.stats()["syncs"] == 2
        assert bool(compiled) == (not overlap), (overlap, compiled)


@pytest.mark.parametrize("bucketed", [False, True], ids=["per-tensor", "bucket"])
def test_outer_step_is_torch_sgd_with_nesterov_on_the_pseudo_gradient(bucketed):
    # The bucket route (CUDA's) leaves the skip flag on the device: the step is then taken by a select.
    model, opt, outer = _single(sync_every=3)  # the defaults: outer lr 0.7, Nesterov momentum 0.5
    outer.state.bucketed = bucketed
    reference = [p.detach().clone() for p in model.parameters()]
    ref_opt = torch.optim.SGD(reference, lr=0.7, momentum=0.5, nesterov=True)
    for step in range(9):
        _inner_step(model, opt, 0, step)
        local = [p.detach().clone() for p in model.parameters()]
        if outer.step():
            for ref, p in zip(reference, local):
                ref.grad = ref - p
            ref_opt.step()
            for ref, p, theta in zip(reference, model.parameters(), outer.theta.values()):
                assert torch.equal(p, ref) and torch.equal(theta, ref)
    assert outer.stats()["syncs"] == 3


def test_overlap_outer_step_uses_the_pseudo_gradient_taken_when_due():
    """One process, dense: theta_g after each merge is the Nesterov step on theta_g - local(t) of the due
    step t, and the replica takes it at t + 1 (the inner step made meanwhile is dropped, merge_alpha=0)."""
    model, opt, outer = _single(sync_every=3, overlap=True, outer_lr=0.5, outer_momentum=0.8)
    theta = [p.detach().clone() for p in model.parameters()]
    buf = [torch.zeros_like(t) for t in theta]
    pending = None
    for step in range(8):
        _inner_step(model, opt, 0, step)
        local = [p.detach().clone() for p in model.parameters()]
        due = outer.step()
        if pending is not None:
            for i, delta in enumerate(pending):
                buf[i] = buf[i] * 0.8 + delta
                theta[i] = theta[i] - 0.5 * (delta + 0.8 * buf[i])
            for got, want in zip(model.parameters(), theta):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        else:
            assert all(torch.equal(got, want) for got, want in zip(model.parameters(), local))
        pending = [t - l for t, l in zip(theta, local)] if due else None
        assert bool(due) == ((step + 1) % 3 == 0)
    assert outer.stats()["syncs"] == 2
    outer.close()


@pytest.mark.parametrize("bucketed", [False, True], ids=["per-tensor", "bucket"])
def test_a_nonfinite_replica_restarts_from_the_last_global_parameters(bucketed):
    model, opt, outer = _single(outer_momentum=0.5)
    outer.state.bucketed = bucketed
    for step in range(3):  # a good sync at the second step: theta_g and the momentum move
        _inner_step(model, opt, 0, step)
        outer.step()
    theta = {k: v.clone() for k, v in outer.theta.items()}
    momentum = {k: v.clone() for k, v in outer.momentum.items()}
    assert all(bool(v.abs().sum() > 0) for v in momentum.values())
    _inner_step(model, opt, 0, 3)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert outer.step() == (0,)
    assert all(torch.equal(theta[n], p) and torch.equal(theta[n], outer.theta[n]) for n, p in model.named_parameters())
    assert all(torch.equal(momentum[n], outer.momentum[n]) for n in momentum)  # the skipped step moved nothing
    assert outer.stats()["nonfinite_syncs"] == 1


def test_overlapped_merges_under_a_device_skip_flag_equal_the_host_ones_bit_for_bit():
    """The bucket route leaves the skip flag on the device: the outer step, the late merge (here mixed,
    merge_alpha 0.5) and the count of skipped syncs then wait for nothing on the host.  With a NaN sync
    among good ones, both routes give the same replica, theta_g, momentum and count."""
    runs = {}
    for bucketed in (False, True):
        model, opt, outer = _single(overlap=True, merge_alpha=0.5, outer_momentum=0.5)
        outer.state.bucketed = bucketed
        for step in range(9):
            _inner_step(model, opt, 0, step)
            if step == 5:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")  # due at this step: skipped; the merge restores it
            outer.step()
        outer.wait()
        runs[bucketed] = (_flat(model), torch.cat([t.reshape(-1) for t in outer.theta.values()]),
                          torch.cat([t.reshape(-1) for t in outer.momentum.values()]), outer.stats()["nonfinite_syncs"])
        outer.close()
    (p0, t0, m0, n0), (p1, t1, m1, n1) = runs[False], runs[True]
    assert n0 == n1 == 1 and torch.isfinite(p0).all()
    assert torch.equal(p0, p1) and torch.equal(t0, t1) and torch.equal(m0, m1)


def test_fragments_are_contiguous_and_balanced_by_elements():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 1), nn.Linear(1, 100), nn.Linear(100, 1))
    outer = gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=6, fragments=3)
    assert [[n for n, _ in f] for f in outer.fragments] == [["0.weight", "0.bias", "1.weight", "1.bias"],
                                                            ["2.weight", "2.bias"], ["3.weight", "3.bias"]]
    assert outer.offsets == [0, 2, 4]
    assert [len(f) for f in gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           sync_every=2, fragments=8).fragments] == [1] * 8


def test_state_dict_loads_with_weights_only(tmp_path):
    model, opt, outer = _single(compressor="topk", ratio=0.1)
    for step in range(3):
        _inner_step(model, opt, 0, step)
        outer.step()
    torch.save(outer.state_dict(), tmp_path / "outer.pt")
    loaded = torch.load(tmp_path / "outer.pt", weights_only=True)
    _, _, fresh = _single(compressor="topk", ratio=0.1)
    fresh.load_state_dict(loaded)
    assert fresh.stats()["inner_steps"] == 3 and fresh.stats()["syncs"] == 1
    assert all(torch.equal(fresh.theta[k], outer.theta[k]) for k in outer.theta)
    assert all(torch.equal(fresh.momentum[k], outer.momentum[k]) for k in outer.momentum)
    assert fresh.state.tensors.keys() == outer.state.tensors.keys() and outer.state.tensors  # residuals
    with pytest.raises(ValueError, match="another sync_every") as err:
        _single(sync_every=5, compressor="topk", ratio=0.1)[2].load_state_dict(loaded)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs,message", [
    ({"sync_every": 0}, "sync_every must be an int >= 1, got 0"),
    ({"sync_every": 2.0}, "sync_every must be an int >= 1, got 2.0"),
    ({"sync_every": True}, "sync_every must be an int >= 1, got True"),
    ({"sync_every": None}, "sync_every must be an int >= 1, got None"),
    ({"fragments": 0}, r"fragments must be an int from 1 to the number of parameter tensors, got 0"),
    ({"fragments": 7}, r"fragments must be an int from 1 to the number of parameter tensors \(6\), got 7"),
    ({"fragments": 1.5}, r"fragments must be an int from 1 .*got 1.5"),
    ({"compressor": "nope"}, "unknown compressor 'nope'"),
    ({"compressor": "topk", "rank": 2}, "rank"),
    ({"compressor": "dgc"}, "dgc applies momentum to the pseudo-gradient itself; use outer_momentum=0"),
    ({"compressor": "signum"}, "signum applies momentum .* use outer_momentum=0"),
    ({"outer_lr": 0}, "outer_lr must be a number > 0, got 0"),
    ({"outer_momentum": 1.0}, "outer_momentum must be a number with 0 <= outer_momentum < 1, got 1.0"),
    ({"overlap": True, "sync_every": 1}, r"overlap=True needs sync_every >= 2 .*, got 1"),
    ({"overlap": 1}, "overlap must be True or False, got 1"),
    ({"merge_alpha": 0.5}, "merge_alpha mixes a late exchange into the replica: it needs overlap=True"),
    ({"overlap": True, "merge_alpha": -0.1}, "merge_alpha must be a number with 0 <= merge_alpha < 1, got -0.1"),
])
def test_bad_input_raises_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        _single(**kwargs)
    assert "\n" not in str(err.value)


def test_an_inner_optimizer_over_other_parameters_is_refused():
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="inner_optimizer steps none of the model's trainable parameters") as err:
        gradzip.DiLoCo(_model(), torch.optim.SGD(other.parameters(), lr=0.1), sync_every=2)
    assert "\n" not in str(err.value)


def test_a_state_dict_of_another_model_or_kind_is_refused_before_anything_loads():
    model, opt, outer = _single(compressor="topk", ratio=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        outer.step()
    saved = outer.state_dict()
    before = {name: t.clone() for name, t in outer.theta.items()}
    name = next(iter(saved["theta"]))
    other = {**saved, "theta": {**saved["theta"], name: saved["theta"][name][:1]}}
    with pytest.raises(ValueError, match=f"holds other shapes for {name}: it was saved for another model"):
        outer.load_state_dict(other)
    with pytest.raises(ValueError, match=r"not a DiLoCo state_dict \(from DiLoCo.state_dict\(\)\): it has no sync_every"):
        outer.load_state_dict({k: v for k, v in saved.items() if k != "sync_every"})
    assert all(torch.equal(before[n], t) for n, t in outer.theta.items())
    outer.load_state_dict(saved)


def _subgroup_start(rank, world):
    alone, pair = dist.new_group([0]), dist.new_group([1, 2])
    torch.manual_seed(rank)
    model = nn.Linear(3, 2)
    gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, group=alone if rank == 0 else pair)
    return [p.detach().clone() for p in model.parameters()]


def test_replicas_start_from_their_groups_first_rank():
    """group=: the replicas of a group start from its first rank's parameters (global rank 1 here)."""
    alone, first, second = run_workers(_subgroup_start, 3)
    torch.manual_seed(1)
    assert all(torch.equal(a, b) and torch.equal(a, c.detach())
               for a, b, c in zip(first, second, nn.Linear(3, 2).parameters()))
    torch.manual_seed(0)
    assert all(torch.equal(a, c.detach()) for a, c in zip(alone, nn.Linear(3, 2).parameters()))


def test_an_inner_optimizer_that_is_not_one_is_refused():
    model = _model()
    with pytest.raises(TypeError, match="inner_optimizer must be a torch.optim.Optimizer, got list"):
        gradzip.DiLoCo(model, list(model.parameters()), sync_every=2)


def test_dgc_without_outer_momentum_is_accepted():
    _, _, outer = _single(compressor="dgc", outer_momentum=0.0)
    assert outer.state.compressor.name == "dgc"

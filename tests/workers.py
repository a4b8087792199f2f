"""Worker functions run in worker processes (or threads) by the distributed tests."""
from __future__ import annotations

import contextlib
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradzip
from gradzip.collectives import ThreadGroup, Transport
from gradzip.testing import odd_inputs  # noqa: F401  (re-exported: tests import it from here)

# Parameters that make each method actually compress the small test model within a few steps.
TEST_PARAMS = {
    "powersgd": {"dense_steps": 2},
    "dgc": {"min_numel": 256, "warmup_epochs": 0, "ratio": 0.05},
    "threshold": {"tau": 0.01},
    # Four candidates, one trial each: plan at step 4, plan steps 4-7, dense steps 8-12, decision at step 13.
    "auto": {"warmup": 0, "trials": 1, "verify": 1},
}


@contextlib.contextmanager
def one_rank_group(backend, folder, **options):
    """A process group of this process alone (``backend``, a store in ``folder``), destroyed however the
    block ends; the test is skipped where a group is already up in this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(backend, store=dist.FileStore(str(folder / "store"), 1), rank=0, world_size=1, **options)
    try:
        yield
    finally:
        dist.destroy_process_group()


def params_for(name: str) -> dict:
    valid = gradzip.parameters_of(name)
    return {k: v for k, v in TEST_PARAMS.get(name, {}).items() if k in valid}


class DelayedTransport(Transport):
    """Sleeps a random, rank-specific time before every collective: ranks reach them out of step."""

    def __init__(self, inner: Transport, seed: int, max_ms: float = 15.0):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.rng = random.Random(seed)
        self.max_s = max_ms / 1000

    def delay_s(self, flat) -> float:
        return self.rng.random() * self.max_s

    def allreduce(self, flat, op):
        time.sleep(self.delay_s(flat))
        return self.inner.allreduce(flat, op)

    def allgather(self, flat):
        time.sleep(self.delay_s(flat))
        return self.inner.allgather(flat)


class EmulatedLink(DelayedTransport):
    """Sleeps ``latency_s + bytes * s_per_byte`` before each collective: a link of known speed."""

    def __init__(self, inner: Transport, latency_s: float, s_per_byte: float):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.latency_s, self.s_per_byte = latency_s, s_per_byte

    def delay_s(self, flat) -> float:
        return self.latency_s + flat.numel() * flat.element_size() * self.s_per_byte


_INIT_LOCK = threading.Lock()  # simulated workers are threads sharing the global RNG


def small_model() -> nn.Module:
    with _INIT_LOCK:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, 5))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def train(rank, world, integration, name, steps, transport=None, delays=False):
    """Train the small model for ``steps`` steps with compressor ``name``; returns (params, stats)."""
    model = small_model()
    params = params_for(name)
    if integration == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
        state = gradzip.register(ddp, name, **params)
        net, opt = ddp, torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        base = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = gradzip.DistributedOptimizer(base, model.named_parameters(), name, bucket_cap_mb=0.004,
                                           transport=transport, **params)
        state, net = opt.gradzip_state, model
    if delays:
        state.transport = DelayedTransport(state.transport, seed=rank * 7919 + len(name))
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return _flat(model), state.stats()


def train_every_method(rank, world, integration, steps, delays):
    return {name: train(rank, world, integration, name, steps, delays=delays) for name in gradzip.compressors()}


def run_threads(world, fn, timeout: float = 60.0):
    """``fn(rank, transport)`` for ``world`` workers as threads joined by a :class:`ThreadGroup`."""
    group = ThreadGroup(world)
    out = [None] * world
    errors = []

    def run(rank):
        try:
            out[rank] = fn(rank, group.transport(rank))
        except BaseException as exc:  # surfaced in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return out


def simulate_training(world, name, steps):
    """The same training as ``train(..., 'optimizer', ...)`` for ``world`` workers as threads of this process."""
    group = ThreadGroup(world)
    results = [None] * world

    def run(rank):
        torch.set_num_threads(1)
        results[rank] = train(rank, world, "optimizer", name, steps, transport=group.transport(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def exchange_odd_inputs(rank, world, steps):
    out = {}
    for name in gradzip.compressors():
        state = gradzip.GradzipState(name, **params_for(name))
        state.transport = DelayedTransport(state.transport, seed=rank, max_ms=3)
        results = []
        for _ in range(steps):
            results.append(state.exchange(odd_inputs(rank)))
        out[name] = (results, state.stats())
    return out


def exchange_nonfinite(rank, world):
    out = {}
    for name in gradzip.compressors():
        state = gradzip.GradzipState(name, **params_for(name))
        grads = odd_inputs(rank)
        first = state.exchange(grads)
        before = {k: {n: v.clone() for n, v in s.items()} for k, s in state.tensors.items()}
        steps_before = dict(state.steps)
        bad = [(k, g.clone()) for k, g in grads]
        if rank == world - 1:
            bad[5][1][3] = float("inf")  # only the last rank sees an overflow
        poisoned = state.exchange(bad)
        unchanged = state.tensors.keys() == before.keys() and all(
            torch.equal(state.tensors[k][n], v) for k, s in before.items() for n, v in s.items()
        ) and state.steps == steps_before
        after = state.exchange(grads)
        out[name] = (first, poisoned, unchanged, after)
    return out


def ddp_uses_world_group_untouched(rank, world):
    """gradzip's own group must leave the default group usable by the script between steps."""
    model = small_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = gradzip.register(ddp, "powersgd", dense_steps=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(3):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t))
    return losses, state.stats()


def train_digits(rank, world, name, params, epochs, optimizer_momentum):
    """A 2-hidden-layer MLP on scikit-learn's 8x8 digits through the DDP hook; returns test accuracy."""
    from gradzip.harness.data import _digits_table  # load_digits's table, without importing scikit-learn

    table = torch.from_numpy(_digits_table())
    x = table[:, :-1].float() / 16.0
    y = table[:, -1].long()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(x))
    x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]
    with _INIT_LOCK:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = gradzip.register(ddp, name, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=optimizer_momentum)
    batch_size = 32
    for epoch in range(epochs):
        state.set_epoch(epoch)
        order = torch.randperm(split, generator=torch.Generator().manual_seed(epoch))
        shard = order[rank::world]
        for i in range(0, len(shard) - batch_size + 1, batch_size):
            idx = shard[i : i + batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x_train[idx]), y_train[idx]).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return accuracy, state.stats()


def train_with_checkpoints(rank, world, names, steps, resume_from, ckpt_dir):
    """:func:`train_with_checkpoint` for each method of ``names`` in turn, in one process; a list."""
    return [train_with_checkpoint(rank, world, name, steps, resume_from, ckpt_dir) for name in names]


def train_with_checkpoint(rank, world, name, steps, resume_from, ckpt_dir):
    """DDP + gradzip; saves model/optimizer/gradzip state after ``steps`` steps, or resumes from a save."""
    import os

    model = small_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = gradzip.register(ddp, name, **params_for(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if name == "dgc" else 0.9)
    path = os.path.join(ckpt_dir, f"{name}-rank{rank}.pt")
    first = 0
    if resume_from is not None:
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["gradzip"])
        first = resume_from
    for step in range(first, steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    if resume_from is None:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gradzip": state.state_dict()}, path)
    state.close()
    return _flat(model)


def ddp_auto_against_plain_ddp(rank, world, steps):
    """The same training with DDP's own allreduce and with auto restricted to dense (so after its
    decision every bucket takes the plain-allreduce path); returns both parameter vectors and stats."""
    out = []
    for hooked in (False, True):
        model = small_model()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
        state = gradzip.register(ddp, "auto", candidates=["none"], warmup=1, trials=1) if hooked else None
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        plain = []  # plain allreduces per step
        for step in range(steps):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            if state:
                plain.append(state.stats()["plain_allreduces"] - sum(plain))
        out.append((_flat(model), plain))
    return out


def auto_on_a_slow_link(rank, world, steps, busy_after_compressed_s, busy_exploring_s=None):
    """auto (none or Top-k; plan at step 2, verified by step 11) on a 3.1 MB/s emulated link, with the
    optimizer integration so every step crosses the link.  ``busy_after_compressed_s``: extra compute
    after each step that compressed, as a codec taking time from backward would (``busy_exploring_s``
    in exploration's steps 0 and 1, if given); the exchange's own time does not show it.  Returns
    parameters, choices, step costs and whether a residual is left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = gradzip.DistributedOptimizer(base, model.named_parameters(), "auto", candidates=["none", "topk:ratio=0.01"],
                                       warmup=0, trials=1, verify=1)
    state = opt.gradzip_state
    state.transport = EmulatedLink(state.transport, 0.0, 320e-9)  # 0.55 MB of weights: 175 ms dense
    for step in range(steps):
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1000 * step + rank))
        before = state.stats()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        after = state.stats()
        compressed = after["payload_bytes"] - before["payload_bytes"] < 0.5 * (after["dense_bytes"] - before["dense_bytes"])
        if compressed:
            time.sleep(busy_exploring_s if step < 2 and busy_exploring_s is not None else busy_after_compressed_s)
    cost = {key: slot.get("auto_step_cost") for key, slot in state.tensors.items()}
    residual = any("residual" in slot for slot in state.tensors.values())
    return _flat(model), state.compressor.choices(state.tensors), cost, residual


def run_scenarios(scenarios: dict, rank: int, world: int, tmp) -> dict:
    """Run each ``name -> fn(rank, world, tmp)`` in one worker; a failing scenario's traceback is its
    result, reported by that scenario's test (every rank raises alike, so the ranks stay in step)."""
    import traceback

    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn(rank, world, tmp)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def ddp_with_a_skipped_branch(rank, world, scenarios):
    """DDP(find_unused_parameters=True) over a model whose branch runs where ``uses(rank, step)``, for each
    ``(name, params, uses)`` of ``scenarios``: per step, the branch's feedback state (its residual, or
    DGC's momentum and velocity) before and after, and whether the branch's weights changed; then the
    final parameters."""
    return [_train_with_a_skipped_branch(rank, *scenario) for scenario in scenarios]


def _train_with_a_skipped_branch(rank, name, params, uses):
    torch.manual_seed(0)
    model = nn.ModuleDict({"trunk": nn.Linear(8, 8), "branch": nn.Linear(8, 8), "head": nn.Linear(8, 3)})

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x, branch):
            h = torch.relu(self.m["trunk"](x))
            return self.m["head"](self.m["branch"](h) if branch else h)

    ddp = nn.parallel.DistributedDataParallel(Net(), find_unused_parameters=True, bucket_cap_mb=0.0005)
    state = gradzip.register(ddp, name, **params)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    branch = ("m.branch.weight", "m.branch.bias")

    def owed():
        return {(key, field): value.clone() for key in branch for field, value in state.tensors.get(key, {}).items()
                if field in gradzip.feedback.STATE_KEYS and isinstance(value, torch.Tensor)}

    steps = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        before, weight = owed(), model["branch"].weight.detach().clone()
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x, uses(rank, step)), y).backward()
        opt.step()
        steps.append((before, owed(), not torch.equal(weight, model["branch"].weight)))
    state.close()
    return steps, _flat(model)


def branch_on_even_steps(rank, step):
    return step % 2 == 0


def branch_on_rank0_odd_steps(rank, step):
    return step < 2 or step % 2 == 0 or rank == 0


def where_started(rank, world, names):
    """The environment variables ``names`` as this worker sees them, its parent's pid, and whether that
    parent (the launcher's fork server) has torch's library mapped."""
    import os

    parent = os.getppid()
    with open(f"/proc/{parent}/maps") as maps:
        parent_has_torch = "libtorch_cpu" in maps.read()
    return {name: os.environ.get(name) for name in names}, parent, parent_has_torch


def leaves_a_file_at_exit(rank, world, folder):
    """Registers an exit handler that writes ``folder``/exit<rank>: a worker's exit handlers must run."""
    import atexit

    atexit.register(lambda: open(f"{folder}/exit{rank}", "w").close())

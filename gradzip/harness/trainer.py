"""Data-parallel training with any gradzip compressor: ``gradzip train`` runs this.

``launch(config)`` starts ``config.workers`` local processes (torch.multiprocessing + gloo, NCCL when
CUDA is present), or, under ``torchrun``, runs the current process as one worker of torchrun's group.
Each worker trains with DDP + ``gradzip.register`` (or ``gradzip.DistributedOptimizer``; with ``outer``, its
own replica under ``gradzip.DiLoCo``'s outer loop), shards data with DistributedSampler, and rank 0 writes
``runs/<name>/metrics.jsonl`` (one line per step and per epoch), TensorBoard scalars and ``summary.json``.
Every rank checkpoints its own file (residuals differ between ranks; under DiLoCo, replicas and optimizers
too) each epoch and every ``checkpoint_steps`` steps;
``resume`` continues bit for bit, and a worker restarted by ``torchrun --max-restarts`` resumes by itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

import gradzip
from gradzip.compressors import Compressor, compressor_class, parse_value
from gradzip.integrations.diloco import OPTIONS as OUTER_OPTIONS, check_options
from gradzip.launcher import free_port, start_worker, wait_for_workers, worker_context
from gradzip.state import check_group_vectors_below

from .data import load_dataset, passes_over_data
from .models import build_model

__all__ = ["TrainConfig", "launch", "run_dir", "parse_outer", "BASELINES", "OUTER_OPTIONS"]

BASELINES = ("allreduce", "torch-fp16", "torch-bf16", "torch-powersgd", "nocomm", "sync")
OPTIMIZERS = ("sgd", "adamw")


def parse_outer(spec: str) -> dict:
    """``"diloco:sync_every=50,fragments=4"`` -> the options of ``gradzip.DiLoCo``: ``{"sync_every": 50,
    "fragments": 4}``.  sync_every is required; bad input raises a one-line ValueError naming the valid keys."""
    name, _, rest = str(spec).partition(":")
    if name.strip() != "diloco":
        raise ValueError(f"outer must be 'diloco:sync_every=H[,KEY=VALUE...]' (DiLoCo is the only outer loop), "
                         f"got {spec!r}")
    options = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or key not in OUTER_OPTIONS:
            raise ValueError(f"bad outer option {item!r} in {spec!r}; valid keys: {', '.join(OUTER_OPTIONS)} "
                             f"(KEY=VALUE)")
        options[key] = parse_value(raw)
    if "sync_every" not in options:
        raise ValueError(f"outer {spec!r} needs sync_every=H (inner steps between syncs); valid keys: "
                         f"{', '.join(OUTER_OPTIONS)}")
    try:
        check_options(**options)
    except ValueError as exc:
        raise ValueError(f"outer {spec!r}: {exc}") from None
    return options


@dataclass
class TrainConfig:
    """Everything that defines a run.  Defaults: the PyTorch MNIST CNN on Fashion-MNIST, 2 workers."""

    model: str = "cnn"
    dataset: str = "fashion-mnist"
    data_dir: Optional[str] = None
    compressor: str = "none"
    params: dict = field(default_factory=dict)
    integration: str = "ddp"  # "ddp" (comm hook) or "optimizer" (DistributedOptimizer)
    # Biases and norms' weights under this many elements compressed as one tensor per bucket (0: each alone);
    # GradzipState's group_vectors_below.
    group_vectors_below: int = 0
    # DiLoCo's outer loop instead of DDP, e.g. "diloco:sync_every=50,fragments=4" (see parse_outer): each rank
    # trains its replica with the optimizer above, and every sync_every steps the compressor sends the
    # pseudo-gradient.
    outer: Optional[str] = None
    # Instead of gradzip, a reference DDP hook: "allreduce" (DDP's own), "torch-fp16", "torch-bf16" and
    # "torch-powersgd" (PyTorch's ddp_comm_hooks), "nocomm" (no exchange at all: the compute-only limit)
    # or "sync" (a one-element allreduce per bucket and no exchange: the floor of any synchronous method).
    baseline: Optional[str] = None
    workers: int = 2
    epochs: int = 1
    batch_size: int = 32  # per worker
    optimizer: str = "sgd"  # "sgd" (with momentum) or "adamw" (default betas; lr and weight_decay from here)
    lr: float = 0.01
    momentum: float = 0.9  # SGD's, or given to DGC, which applies it itself
    weight_decay: float = 0.0
    lr_warmup_epochs: float = 0.0
    clip: Optional[float] = None  # clip the averaged gradient's global norm
    seed: int = 0
    target: Optional[float] = None  # test accuracy (perplexity for language models) to reach
    train_size: Optional[int] = None  # use the first N training samples
    test_size: Optional[int] = None
    validation: float = 0.0  # hold out this fraction of the training set and evaluate on it instead of test
    max_steps: Optional[int] = None  # per epoch
    seq_len: int = 35
    synthetic_shape: tuple = (1, 28, 28)
    netem: Optional[str] = None  # e.g. "rate=100mbit": each worker in its own network namespace (root)
    timeout_s: Optional[float] = None  # stop the workers and fail if the run takes longer (a hang)
    stall_s: Optional[float] = None  # ... or if, after the first step, no rank finishes a step or test batch for this long
    checkpoint_steps: Optional[int] = None
    resume: bool = False
    out_dir: str = "runs"
    name: Optional[str] = None
    progress: bool = True

    def __post_init__(self):
        if self.integration not in ("ddp", "optimizer"):
            raise ValueError(f"integration must be 'ddp' or 'optimizer', got {self.integration!r}")
        for key in ("workers", "epochs", "batch_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {getattr(self, key)!r}")
        if self.baseline is not None and self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {', '.join(BASELINES)}, got {self.baseline!r}")
        if self.baseline is not None and (self.compressor != "none" or self.integration != "ddp"):
            raise ValueError("a baseline hook replaces gradzip: use it with compressor 'none' and integration 'ddp'")
        if self.baseline == "torch-bf16" and not torch.cuda.is_available():
            raise ValueError("baseline 'torch-bf16': PyTorch's bf16 hook refuses to run without CUDA (it needs "
                             "CUDA 11+ and NCCL 2.10+) and this machine has no CUDA GPU; compare with 'torch-fp16'")
        for key in ("timeout_s", "stall_s"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{key} must be a number of seconds > 0 or None, got {value!r}")
        if check_group_vectors_below(self.group_vectors_below) and (self.baseline is not None or self.outer is not None):
            raise ValueError("group_vectors_below applies to gradzip's DDP hook and DistributedOptimizer, not to a "
                             "baseline hook or an outer loop")
        if not 0 <= self.validation < 1:
            raise ValueError(f"validation must be a fraction in [0, 1), got {self.validation!r}")
        self.synthetic_shape = tuple(self.synthetic_shape)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        compressor = gradzip.make(self.compressor, **self.params)  # fail early, in the launcher, on a bad method
        if self.outer is not None:
            if self.baseline is not None or self.integration != "ddp":
                raise ValueError("outer replaces DDP and DistributedOptimizer: use it without a baseline and with "
                                 "integration 'ddp' (the default)")
            default = inspect.signature(gradzip.DiLoCo).parameters["outer_momentum"].default
            momentum = parse_outer(self.outer).get("outer_momentum", default)
            if compressor.applies_momentum and momentum > 0:
                raise ValueError(f"compressor {self.compressor!r} applies momentum to the pseudo-gradient itself: "
                                 f"add outer_momentum=0 to outer")
        elif self.optimizer == "adamw" and compressor.applies_momentum:
            raise ValueError(f"compressor {self.compressor!r} applies momentum itself and AdamW applies its own: "
                             f"use --optimizer sgd")
        if self.netem is not None:
            from ..netem import parse_netem

            parse_netem(self.netem)
        if self.name is None:
            loop = "" if self.outer is None else "-" + re.sub(r"[^A-Za-z0-9._+-]", "_", self.outer)
            self.name = f"{self.model}-{self.dataset}-{self.compressor}{loop}-w{self.workers}-s{self.seed}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def run_dir(config: TrainConfig) -> Path:
    return Path(config.out_dir) / config.name



def launch(config: TrainConfig) -> dict:
    """Train; returns rank 0's summary.  Under torchrun this process is one worker of its group."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        if config.netem is not None:
            raise ValueError("--netem starts its own emulated hosts; it cannot run under torchrun")
        return _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), config, torchrun=True)
    if config.netem is None:
        return _spawn(config, None)
    from ..netem import EmulatedCluster, parse_netem

    with EmulatedCluster(config.workers, parse_netem(config.netem)) as cluster:
        return _spawn(config, cluster)


def _spawn(config: TrainConfig, cluster) -> dict:
    os.environ["MASTER_ADDR"] = cluster.address(0) if cluster else "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    ctx = worker_context()
    ticks = ctx.Array("q", config.workers, lock=False) if config.stall_s else None  # one counter per rank
    procs = [start_worker(_worker, (r, config.workers, config, False, cluster.namespace(r) if cluster else None,
                                    ticks), ctx)
             for r in range(config.workers)]
    stall = _StallWatch(ticks, config.stall_s) if ticks is not None else None
    if not wait_for_workers(procs, config.timeout_s, stalled=stall):
        if stall is not None and stall.fired:
            raise TimeoutError(f"run {config.name} made no progress for {config.stall_s:g} s (hung)")
        raise TimeoutError(f"run {config.name} did not finish within {config.timeout_s:g} s (hung)")
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        how = ", ".join(f"rank {r}: {_exit_text(procs[r].exitcode)}" for r in failed)
        raise RuntimeError(f"worker(s) {failed} failed ({how}); once one fails the others are killed (SIGKILL); "
                           f"see the messages above")
    return json.loads((run_dir(config) / "summary.json").read_text())


def _exit_text(code: int) -> str:
    """A worker's exit code as a reader wants it: 'exit 1', or the signal that ended it ('SIGABRT')."""
    if code >= 0:
        return f"exit {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _StallWatch:
    """True once the workers' tick counters have not moved for ``limit_s`` seconds.

    Armed by the first tick, so the start-up (imports, data, rendezvous) is left to the overall timeout.
    A hung collective stops every rank, a frozen peer stops the others at their next collective.
    """

    def __init__(self, ticks, limit_s: float):
        self.ticks, self.limit_s = ticks, limit_s
        self.seen, self.since, self.fired = 0, time.monotonic(), False

    def __call__(self) -> bool:
        total, now = sum(self.ticks), time.monotonic()
        if total != self.seen:
            self.seen, self.since = total, now
        self.fired = total > 0 and now - self.since > self.limit_s
        return self.fired


class _Writer:
    """metrics.jsonl + TensorBoard, rank 0 only."""

    def __init__(self, path: Path, keep_lines: Optional[int]):
        self.path = path / "metrics.jsonl"
        lines = self.path.read_text().splitlines() if (keep_lines is not None and self.path.exists()) else []
        lines = lines[:keep_lines] if keep_lines is not None else []
        self.path.write_text("".join(line + "\n" for line in lines))
        self.lines = len(lines)
        self.file = self.path.open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(path / "tensorboard"))
        except ImportError:  # TensorBoard is optional: the JSON lines hold the same numbers
            self.tb = None

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.lines += 1
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.tb.add_scalar(f"{record['kind']}/{key}", value, step)

    def close(self):
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _split(dataset, config: TrainConfig):
    n = len(dataset)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed)).tolist()
    n_val = int(config.validation * n)
    return Subset(dataset, perm[n_val:]), Subset(dataset, perm[:n_val])


def _datasets(config: TrainConfig):
    # The data (synthetic data's teacher included) does not change with the run's seed; the seed changes
    # initialisation, shuffling and dropout.
    kwargs = dict(data_dir=config.data_dir, seq_len=config.seq_len, synthetic_shape=config.synthetic_shape)
    train, info = load_dataset(config.dataset, train=True, **kwargs)
    if config.train_size is not None:
        train = Subset(train, range(min(config.train_size, len(train))))
    if config.validation > 0:
        train, evaluation = _split(train, config)
    else:
        evaluation, _ = load_dataset(config.dataset, train=False, **kwargs)
        if config.test_size is not None:
            evaluation = Subset(evaluation, range(min(config.test_size, len(evaluation))))
    return train, evaluation, info


def _loss_and_correct(model, x, y, language_model: bool):
    out = model(x)
    if language_model:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    loss = nn.functional.cross_entropy(out, y)
    return loss, (out.argmax(-1) == y).sum(), y.numel()


@torch.no_grad()
def _evaluate(model, dataset, rank, world, device, language_model, batch_size=512, tick=lambda: None):
    """Each rank scores its shard; sums are allreduced on the default group (not gradzip's)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    for i in range(rank * batch_size, len(dataset), world * batch_size):
        x, y = zip(*(dataset[j] for j in range(i, min(i + batch_size, len(dataset)))))
        x, y = torch.stack(x).to(device), torch.stack(y).to(device)
        loss, correct, count = _loss_and_correct(model, x, y, language_model)
        totals += torch.tensor([loss.item() * count, correct.item(), count], dtype=torch.float64)
        tick()
    model.train()
    if world > 1:
        dist.all_reduce(totals)
    loss = totals[0].item() / max(totals[2].item(), 1)
    return loss, totals[1].item() / max(totals[2].item(), 1)


def _checkpoint_path(directory: Path, rank: int, step: int) -> Path:
    return directory / f"checkpoint-rank{rank}-step{step}.pt"


def _checkpoint_steps(directory: Path, rank: int) -> list[int]:
    return sorted(int(p.stem.rsplit("step", 1)[1]) for p in directory.glob(f"checkpoint-rank{rank}-step*.pt"))


def _save(directory: Path, rank: int, step: int, payload: dict) -> None:
    path = _checkpoint_path(directory, rank, step)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # atomic: a kill during the save leaves the previous checkpoints intact
    # Keep two: ranks are at most one step apart, so a rank killed before its newest save can still
    # resume together with the others from the one before.
    for old in _checkpoint_steps(directory, rank)[:-2]:
        _checkpoint_path(directory, rank, old).unlink(missing_ok=True)


def _resume_step(directory: Path, rank: int, world: int) -> int:
    """The newest checkpoint step every rank has (-1: none), agreed over the default group."""
    mine = _checkpoint_steps(directory, rank)
    steps = torch.tensor([mine[-1] if mine else -1], dtype=torch.int64)
    if world > 1:
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    step = int(steps)
    if step >= 0 and step not in mine:
        raise RuntimeError(f"rank {rank} has no checkpoint of step {step} to resume with the other ranks")
    return step


def _worker(rank: int, world: int, config: TrainConfig, torchrun: bool = False,
            namespace: Optional[str] = None, ticks=None) -> dict:
    if namespace is not None:
        from ..netem import INTERFACE, enter_namespace

        enter_namespace(namespace)  # before any socket: gloo's threads inherit the namespace
        os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if torchrun:
        dist.init_process_group(backend, store=_restart_store(rank, world), rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        return _train(rank, world, config, device, torchrun, ticks)
    finally:
        dist.destroy_process_group()


def _no_communication(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _sync_only(state, bucket):
    """Wait for every rank once per bucket, as any synchronous exchange must, and exchange nothing: each
    rank keeps its own gradient, so only the timing means anything."""
    buffer = bucket.buffer()
    return dist.all_reduce(torch.zeros(1, dtype=buffer.dtype), async_op=True).get_future().then(lambda _: buffer)


def _register_baseline(net, baseline: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if baseline == "torch-fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif baseline == "torch-bf16":
        net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif baseline == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=10)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif baseline == "nocomm":
        net.register_comm_hook(None, _no_communication)
    elif baseline == "sync":
        net.register_comm_hook(None, _sync_only)


def _restart_store(rank: int, world: int):
    """torchrun's store outlives a restart: without a per-restart prefix, the new workers read the dead
    ones' addresses from it and fail to connect (seen with gloo on torch 2.13)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_hosts_it and rank == 0)
    return dist.PrefixStore(f"gradzip/restart{restart}/", store)


def _compressor(config: TrainConfig) -> tuple[Compressor, dict]:
    """The run's compressor, built once per worker, and the parameters it was built with."""
    params = dict(config.params)
    # A method whose error feedback is DGC's momentum correction applies momentum itself and takes the
    # run's momentum (DGC, CSC); the optimizer then adds none (see _optimizer), as for Signum, which keeps
    # its own beta.  Under an outer loop the method compresses pseudo-gradients, not the optimizer's
    # gradients.
    feedback = params.get("feedback") or compressor_class(config.compressor).default_feedback  # as make() resolves it
    if (config.outer is None and feedback == "momentum" and "momentum" not in params
            and "momentum" in gradzip.parameters_of(config.compressor)):
        params["momentum"] = config.momentum
    return gradzip.make(config.compressor, **params), params


def _optimizer(config: TrainConfig, parameters, compressor: Compressor) -> torch.optim.Optimizer:
    """The run's optimizer; with a method that applies momentum itself, SGD adds none."""
    if config.optimizer == "adamw":  # TrainConfig refuses AdamW with a method that applies momentum
        return torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    momentum = 0.0 if config.outer is None and compressor.applies_momentum else config.momentum
    return torch.optim.SGD(parameters, lr=config.lr, momentum=momentum, weight_decay=config.weight_decay)


def _exchange(config: TrainConfig, model, optimizer, compressor, device) -> tuple:
    """How this worker exchanges gradients: ``(net, opt, state, outer)``, where ``net`` runs the forward
    pass, ``opt`` steps and ``state`` is the GradzipState whose stats the metrics read."""
    if config.outer is not None:  # each rank steps its own replica; DiLoCo syncs every sync_every steps
        outer = gradzip.DiLoCo(model, optimizer, compressor=compressor, seed=config.seed, **parse_outer(config.outer))
        return model, optimizer, outer.state, outer
    if config.integration == "ddp":
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if config.baseline is None:
            return net, optimizer, gradzip.register(net, compressor, seed=config.seed,
                                                    group_vectors_below=config.group_vectors_below), None
        state = gradzip.GradzipState(compressor)  # "none", unused: keeps the bookkeeping uniform (zeros)
        _register_baseline(net, config.baseline)
        return net, optimizer, state, None
    opt = gradzip.DistributedOptimizer(optimizer, model.named_parameters(), compressor, seed=config.seed,
                                       group_vectors_below=config.group_vectors_below)
    return model, opt, opt.gradzip_state, None


@dataclass
class _Run:
    """One worker's run: what _setup builds, and the counters the loop, the checkpoints and the summary share."""

    config: TrainConfig
    rank: int
    world: int
    device: torch.device
    directory: Path
    model: nn.Module
    net: nn.Module  # what the forward pass runs: the DDP wrapper, or the model itself
    optimizer: torch.optim.Optimizer  # the torch optimizer, whose state is checkpointed
    opt: torch.optim.Optimizer  # what steps: the optimizer, or gradzip's DistributedOptimizer around it
    state: gradzip.GradzipState
    outer: Optional[gradzip.DiLoCo]
    eval_set: object
    language_model: bool
    sampler: DistributedSampler
    loader: DataLoader
    steps_per_epoch: int
    ticks: object = None  # the launcher's stall-watch counters, one per rank
    start_epoch: int = 0
    start_batch: int = 0
    global_step: int = 0
    elapsed: float = 0.0  # wall seconds of the runs this one resumes
    reached: Optional[dict] = None
    writer: Optional[_Writer] = None  # rank 0 only
    progress: object = None
    t_start: float = 0.0
    lr: Optional[float] = None  # the last step's
    epoch_record: Optional[dict] = None
    step_times: dict = field(default_factory=dict)  # this process's sums (rank 0), for the summary's means
    train_samples: int = 0  # the training set's size, for the passes over it

    def passes(self) -> float:
        """Passes over the training data so far (all workers' samples)."""
        return passes_over_data(self.global_step, self.config.batch_size, self.world, self.train_samples)

    def wall(self) -> float:
        return self.elapsed + time.perf_counter() - self.t_start

    def tick(self) -> None:  # for the launcher's stall watch: this rank has finished one more step or test batch
        if self.ticks is not None:
            self.ticks[self.rank] += 1


def _setup(rank, world, config: TrainConfig, device, torchrun: bool, ticks) -> _Run:
    directory = run_dir(config)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}.pid").write_text(str(os.getpid()))
    train_set, eval_set, info = _datasets(config)
    torch.manual_seed(config.seed)
    model = build_model(config.model, info).to(device)
    compressor, _ = _compressor(config)
    optimizer = _optimizer(config, model.parameters(), compressor)
    net, opt, state, outer = _exchange(config, model, optimizer, compressor, device)

    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=config.seed,
                                 drop_last=True)
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader) if config.max_steps is None else min(len(loader), config.max_steps)
    if steps_per_epoch == 0:
        raise ValueError(f"no full batch of {config.batch_size} per worker: the training set has "
                         f"{len(train_set)} samples for {world} workers")
    run = _Run(config, rank, world, device, directory, model, net, optimizer, opt, state, outer, eval_set,
               info.task == "language_model", sampler, loader, steps_per_epoch, ticks, train_samples=len(train_set))
    lines = _resume(run, torchrun)
    run.writer = _Writer(directory, lines) if rank == 0 else None
    if rank == 0:
        (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    run.progress = _progress(rank == 0 and config.progress, config.epochs * steps_per_epoch,
                             run.start_epoch * steps_per_epoch + run.start_batch, config.name)
    run.t_start = time.perf_counter()
    return run


def _resume(run: _Run, torchrun: bool) -> Optional[int]:
    """Continue from the newest checkpoint every rank has, if asked (or restarted by torchrun); a fresh
    run deletes this rank's older checkpoints instead.  Returns the metrics lines to keep (None: none)."""
    restarted = torchrun and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    step = _resume_step(run.directory, run.rank, run.world) if (run.config.resume or restarted) else -1
    if step < 0:
        for stale in _checkpoint_steps(run.directory, run.rank):  # never resume an older run's files
            _checkpoint_path(run.directory, run.rank, stale).unlink()
        return None
    saved = torch.load(_checkpoint_path(run.directory, run.rank, step), map_location=run.device, weights_only=True)
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    if run.outer is None:
        run.state.load_state_dict(saved["gradzip"])
    else:  # after DiLoCo's constructor, whose broadcast of rank 0's replica would overwrite this one
        run.outer.load_state_dict(saved["outer"])
    run.start_epoch, run.start_batch, run.global_step = saved["epoch"], saved["batch"], saved["global_step"]
    run.elapsed, run.reached = saved["elapsed"], saved.get("reached")
    return saved["metrics_lines"]


def _checkpoint(run: _Run, epoch: int, batch: int) -> None:
    """This rank's checkpoint: resuming from it continues with batch ``batch`` of epoch ``epoch``."""
    exchange = {"gradzip": run.state.state_dict()} if run.outer is None else {"outer": run.outer.state_dict()}
    _save(run.directory, run.rank, run.global_step, {
        "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), **exchange, "epoch": epoch,
        "batch": batch, "global_step": run.global_step, "elapsed": run.wall(),
        "metrics_lines": run.writer.lines if run.writer else None, "reached": run.reached})


def _train(rank, world, config, device, torchrun, ticks=None):
    run = _setup(rank, world, config, device, torchrun, ticks)
    for epoch in range(run.start_epoch, config.epochs):
        _train_epoch(run, epoch)
    return _finish(run)


def _train_epoch(run: _Run, epoch: int) -> None:
    config, state, outer = run.config, run.state, run.outer
    run.sampler.set_epoch(epoch)
    if outer is None:  # under DiLoCo, step-counted schedules (DGC's warm-up) count syncs, as documented
        state.set_epoch(epoch)
    before_epoch = state.stats()
    sums = torch.zeros(3, dtype=torch.float64)
    epoch_t = time.perf_counter()
    for batch, (x, y) in enumerate(run.loader):
        if batch >= run.steps_per_epoch:
            break
        if epoch == run.start_epoch and batch < run.start_batch:
            continue  # resuming inside an epoch: same permutation, skip what was done
        x, y = x.to(run.device), y.to(run.device)
        run.lr = _lr(config, epoch + batch / run.steps_per_epoch)
        for group in run.optimizer.param_groups:
            group["lr"] = run.lr
        torch.manual_seed(config.seed * 1_000_003 + run.rank * 7919 + run.global_step)  # dropout, reproducibly
        before = state.stats()
        t0 = time.perf_counter()
        run.opt.zero_grad()
        loss, correct, count = _loss_and_correct(run.net, x, y, run.language_model)
        loss.backward()
        if config.clip is not None:
            if config.integration == "optimizer":
                run.opt.synchronize()
            nn.utils.clip_grad_norm_(run.model.parameters(), config.clip)
        run.opt.step()
        if outer is not None:
            outer.step()
        step_s = time.perf_counter() - t0
        run.global_step += 1
        after = state.stats()
        sums += torch.tensor([loss.item() * count, correct.item(), count], dtype=torch.float64)
        _record_step(run, epoch, loss.item(), correct.item() / count, step_s, before, after)
        run.progress(loss.item())
        run.tick()
        if config.checkpoint_steps and run.global_step % config.checkpoint_steps == 0:
            _checkpoint(run, epoch, batch + 1)
    if outer is not None:
        outer.global_parameters()  # wait for an overlapped exchange in flight: training time, not eval's
    train_s = time.perf_counter() - epoch_t
    _end_epoch(run, epoch, sums, before_epoch, epoch_t, train_s)


def _record_step(run: _Run, epoch, loss, accuracy, step_s, before, after) -> None:
    """One step's line in metrics.jsonl (rank 0)."""
    if not run.writer:
        return
    record = _step_record(epoch, run.global_step, loss, accuracy, run.lr, step_s, before, after, run.wall(),
                          run.language_model)
    if run.outer is not None:
        record.update(_outer_fields(run.outer))
    run.writer.write(record)
    for key in _TIMES:
        run.step_times[key] = run.step_times.get(key, 0.0) + record[key]


def _end_epoch(run: _Run, epoch, sums, before_epoch, epoch_t, train_s) -> None:
    """Evaluate, write the epoch's line and checkpoint."""
    if run.world > 1:
        dist.all_reduce(sums)
    with _global_parameters(run.outer, run.model):
        eval_loss, eval_acc = _evaluate(run.model, run.eval_set, run.rank, run.world, run.device,
                                        run.language_model, tick=run.tick)
    wall = run.wall()
    target, language_model = run.config.target, run.language_model
    score = math.exp(min(eval_loss, 50)) if language_model else eval_acc
    if run.reached is None and target is not None and (score <= target if language_model else score >= target):
        run.reached = {"epoch": epoch + 1, "wall_s": wall, "step": run.global_step}
    after = run.state.stats()
    record = {
        "kind": "epoch", "epoch": epoch, "step": run.global_step,
        "train_loss": sums[0].item() / sums[2].item(), "train_accuracy": sums[1].item() / sums[2].item(),
        "test_loss": eval_loss, "test_accuracy": eval_acc, "epoch_s": time.perf_counter() - epoch_t,
        "train_s": train_s, "passes": run.passes(),
        "wall_s": wall, "lr": run.lr, "density": _ratio(after, before_epoch, "elements_sent", "elements"),
        **_byte_fields(before_epoch, after),
    }
    if language_model:
        record["test_perplexity"] = math.exp(min(eval_loss, 50))
        record["train_perplexity"] = math.exp(min(record["train_loss"], 50))
    run.epoch_record = record
    if run.writer:
        run.writer.write(record)
    _checkpoint(run, epoch + 1, 0)


def _finish(run: _Run) -> Optional[dict]:
    """Close the outputs; rank 0 writes and returns summary.json (other ranks: None)."""
    run.progress(None)
    summary = None
    if run.writer:
        run.writer.close()
        state, outer = run.state, run.outer
        summary = _summary(run.config, state.stats(), run.epoch_record, run.reached, run.wall(), run.world,
                           run.global_step)
        steps_here = run.global_step - (run.start_epoch * run.steps_per_epoch + run.start_batch)
        summary.update({f"mean_{k}": v / steps_here for k, v in run.step_times.items()} if steps_here else {})
        summary.update(train_samples=run.train_samples, passes=run.passes())
        if outer is not None:
            summary.update(_outer_fields(outer), evaluated="theta_g: DiLoCo's global parameters, equal on every "
                                                          "rank (a replica equals them only right after a sync)")
        summary["buckets"] = state.bucket_stats()
        summary.update(state.compressor.describe(state.tensors))  # auto: the candidate of each tensor
        (run.directory / "summary.json").write_text(json.dumps(summary, indent=2))
    if run.world > 1:
        dist.barrier()
    return summary


def _outer_fields(outer) -> dict:
    """DiLoCo's counters for metrics and the summary (bytes per worker, cumulative)."""
    s = outer.stats()
    return {k: s[k] for k in ("syncs", "bytes_per_inner_step", "ddp_bytes_per_inner_step")}


@contextlib.contextmanager
def _global_parameters(outer, model):
    """Under DiLoCo, hold theta_g (each fragment's parameters as of its last sync, equal on every rank)
    instead of this rank's replica, which differs from the others' between syncs; the replica is put
    back after.  Without an outer loop, nothing changes."""
    if outer is None:
        yield
        return
    params, theta_g = dict(model.named_parameters()), outer.global_parameters()
    replica = {name: params[name].detach().clone() for name in theta_g}
    with torch.no_grad():
        for name, theta in theta_g.items():
            params[name].copy_(theta)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in replica.items():
                params[name].copy_(value)


def _lr(config: TrainConfig, epoch_float: float) -> float:
    if config.lr_warmup_epochs > 0 and epoch_float < config.lr_warmup_epochs:
        return config.lr * (epoch_float + 1e-3) / config.lr_warmup_epochs
    return config.lr


def _ratio(after, before, num, den):
    d = after[den] - before[den]
    return (after[num] - before[num]) / d if d else float("nan")


def _byte_fields(before, after) -> dict:
    wire = after["wire_bytes"] - before["wire_bytes"]
    dense = after["dense_bytes"] - before["dense_bytes"]
    return {"bytes_sent": wire, "payload_bytes": after["payload_bytes"] - before["payload_bytes"],
            "dense_bytes": dense, "ratio": dense / wire if wire else float("nan")}


_TIMES = ("step_s", "compute_s", "compress_s", "communicate_s", "decompress_s")


def _step_record(epoch, step, loss, accuracy, lr, step_s, before, after, wall, language_model) -> dict:
    times = {k: after[f"{k}_s"] - before[f"{k}_s"] for k in ("compress", "communicate", "decompress")}
    record = {
        "kind": "step", "epoch": epoch, "step": step, "loss": loss, "accuracy": accuracy, "lr": lr,
        "density": _ratio(after, before, "elements_sent", "elements"), **_byte_fields(before, after),
        "step_s": step_s,
        # Work on the communication thread overlaps backward, so compute is step time minus gradzip's
        # time: a lower bound when overlap hides some of gradzip's work.
        "compute_s": max(0.0, step_s - sum(times.values())),
        **{f"{k}_s": v for k, v in times.items()},
        "wall_s": wall,
    }
    if language_model:
        record["perplexity"] = math.exp(min(loss, 50))
    return record


def _summary(config, stats, last_epoch, reached, wall, world, steps) -> dict:
    score_key = "test_perplexity" if last_epoch and "test_perplexity" in last_epoch else "test_accuracy"
    return {
        "name": config.name, "compressor": config.compressor, "params": config.params, "outer": config.outer,
        "group_vectors_below": config.group_vectors_below,
        "workers": world, "model": config.model, "dataset": config.dataset, "seed": config.seed, "optimizer": config.optimizer,
        "lr": config.lr, "epochs": config.epochs,
        "final_test_accuracy": last_epoch["test_accuracy"] if last_epoch else None,
        "final_test_loss": last_epoch["test_loss"] if last_epoch else None,
        "final_score": last_epoch.get(score_key) if last_epoch else None, "score": score_key,
        "target": config.target, "time_to_target_s": reached["wall_s"] if reached else None,
        "epochs_to_target": reached["epoch"] if reached else None,
        "total_bytes_sent": stats["wire_bytes"], "total_dense_bytes": stats["dense_bytes"],
        "mean_ratio": stats["ratio"], "mean_density": stats["density"],
        "mean_bits_per_element": stats["bits_per_element"], "wall_s": wall,
        "steps": steps,
    }


def _progress(enabled: bool, total: int, done: int, name: str):
    """A rich progress bar on rank 0; returns ``update(loss)`` (``update(None)`` closes it)."""
    if not enabled:
        return lambda loss: None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   TextColumn("loss {task.fields[loss]}"))
    task = bar.add_task(name, total=total, completed=done, loss="-")
    bar.start()

    def update(loss):
        if loss is None:
            bar.stop()
        else:
            bar.update(task, advance=1, loss=f"{loss:.4f}")

    return update

"""``gradzip sweep CONFIG.toml``: a grid of training runs described by one TOML file.

    name = "kpercent"              # optional; default: the file's stem
    out_dir = "runs/sweeps"        # the sweep lives in <out_dir>/<name>/
    description = "..."            # optional; heads results.md

    [base]                         # TrainConfig fields shared by every run
    model = "cnn"
    dataset = "fashion-mnist"
    max_steps = 200

    [grid]
    workers = [1, 2]
    seeds = [0, 1]

    [[grid.methods]]
    compressor = "none"

    [[grid.methods]]
    compressor = "topk"
    label = "topk-noef"            # names the runs; default: the compressor and its params
    params = { feedback = "none" }
    lr = 0.02                      # a method may override any [base] key
    sweep_param = "ratio"          # one method per value: a compressor parameter or a [base] key
    values = [0.1, 0.01]

    [tuning]                       # optional: a learning rate per method, chosen on a validation split
    lrs = [0.003, 0.01, 0.03]
    validation = 0.1               # fraction of the training set held out (TrainConfig.validation)
    seeds = [0]
    workers = 2                    # default: tune at every grid worker count ("tuned per setting")
    max_steps = 100                # default: [base]'s (also: epochs)
    tuned = "both"                 # true (default): tuned runs only; "both": tuned and untuned
    widen = 3                      # optional: while the best lr is at an edge of those tried, try one more
                                   # beyond it (edge x the grid's ratio there), at most 3 times per setting

Each run is named ``<label>-w<workers>-s<seed>`` (``<label>-tuned-w<workers>-s<seed>`` with the tuned lr) in
``<out_dir>/<name>/runs/``; tuning runs go to ``tuning/``.  With ``widen`` the grid of a setting (method and
tuning worker count) grows until its best lr is not at an edge (:func:`bracket_lr`), so a plan lists only the
grid's runs: widening adds up to ``widen`` x tuning seeds runs per setting.  Runs execute one after another with
``trainer.launch``.  A run whose ``summary.json`` exists is skipped and an unfinished one resumes from its
last checkpoint, so rerunning a killed sweep continues where it stopped.  ``sweep.json`` lists the planned
runs for :mod:`gradzip.harness.report`; ``tuned_lrs.json`` records the chosen learning rates.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .report import machine
from .trainer import TrainConfig, launch, run_dir

__all__ = ["Method", "Tuning", "Sweep", "Run", "load_sweep", "parse_sweep", "tuning_runs", "main_runs",
           "pick_lr", "bracket_lr", "run_sweep"]

# The sweep itself sets these for every run; everything else in TrainConfig may go in [base].
_SET_BY_SWEEP = ("compressor", "params", "workers", "seed", "name", "out_dir", "resume")
BASE_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in _SET_BY_SWEEP)
TOP_KEYS = ("name", "description", "out_dir", "keep_checkpoints", "base", "grid", "tuning")
GRID_KEYS = ("workers", "seeds", "methods")
METHOD_KEYS = ("compressor", "params", "label", "sweep_param", "values") + BASE_KEYS
TUNING_KEYS = ("lrs", "validation", "seeds", "workers", "epochs", "max_steps", "tuned", "widen")
# Labels become directory names.
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
# Compared with a finished run's config.json to tell whether it is the run planned now.
_IGNORED_IN_COMPARISON = ("resume", "progress")


@dataclass(frozen=True)
class Method:
    """One compressor setting of the grid (a ``sweep_param`` entry expands to one per value)."""

    label: str  # unique in the sweep; names its runs
    group: str  # the [[grid.methods]] entry it came from: one line in the accuracy-vs-density plot
    compressor: str
    params: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)  # [base] keys this method sets differently
    sweep_param: Optional[str] = None
    value: Any = None


@dataclass(frozen=True)
class Tuning:
    lrs: tuple
    validation: float = 0.1
    seeds: tuple = (0,)
    workers: Optional[int] = None  # None: tune at every grid worker count
    epochs: Optional[int] = None
    max_steps: Optional[int] = None
    tuned: Any = True  # True, False or "both"
    widen: int = 0  # at most this many lrs beyond the grid's edges per setting, while the best is at an edge

    @property
    def variants(self) -> tuple:
        """The ``tuned`` flags of the main runs: (False,), (True,) or (False, True)."""
        return {True: (True,), False: (False,), "both": (False, True)}[self.tuned]


@dataclass
class Sweep:
    name: str
    out_dir: Path
    base: dict
    workers: tuple
    seeds: tuple
    methods: list
    tuning: Optional[Tuning] = None
    description: str = ""
    keep_checkpoints: bool = False
    source: dict = field(default_factory=dict)  # the TOML as read, kept in sweep.json
    command: str = ""  # how to rerun it, for the report's provenance

    @property
    def directory(self) -> Path:
        return self.out_dir / self.name


@dataclass
class Run:
    """One training run of the sweep."""

    config: TrainConfig
    method: Method
    tuned: Optional[bool] = None  # None: a tuning run, or a sweep without [tuning]

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def directory(self) -> Path:
        return run_dir(self.config)

    def manifest(self) -> dict:
        """What the report needs to know beyond the run's summary.json."""
        m = self.method
        # The path is relative to the sweep's directory, so that a moved sweep still reports.
        return {"name": self.name, "path": f"{Path(self.config.out_dir).name}/{self.name}", "label": m.label,
                "group": m.group, "compressor": m.compressor, "params": m.params, "overrides": m.overrides,
                "sweep_param": m.sweep_param,
                "value": m.value, "workers": self.config.workers, "seed": self.config.seed, "lr": self.config.lr,
                "tuned": self.tuned}


# -- parsing ------------------------------------------------------------------------------------------------


def load_sweep(path, *, out_dir: Optional[str] = None, name: Optional[str] = None) -> Sweep:
    """Read and check a sweep's TOML file; ``out_dir``/``name`` override the file's."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from None
    sweep = parse_sweep(data, default_name=path.stem, out_dir=out_dir, name=name)
    sweep.command = "gradzip sweep " + str(path) + "".join(
        f" --{flag} {value}" for flag, value in (("out-dir", out_dir), ("name", name)) if value)
    return sweep


def parse_sweep(data: dict, *, default_name: str = "sweep", out_dir: Optional[str] = None,
                name: Optional[str] = None) -> Sweep:
    """Check a sweep's parsed TOML and expand its methods."""
    _check_keys(data, TOP_KEYS, "the sweep's top level")
    name = name or data.get("name", default_name)
    if not isinstance(name, str) or not _LABEL.match(name):
        raise ValueError(f"name must be letters, digits and . _ + - (a directory name), got {name!r}")
    base = _table(data, "base", "the sweep")
    _check_keys(base, BASE_KEYS, "[base]")
    grid = _table(data, "grid", "the sweep")
    _check_keys(grid, GRID_KEYS, "[grid]")
    workers = _int_list(grid.get("workers", [2]), "[grid] workers", low=1)
    seeds = _int_list(grid.get("seeds", [0]), "[grid] seeds", low=0)
    tuning = _tuning(data["tuning"]) if "tuning" in data else None
    keep = data.get("keep_checkpoints", False)
    if not isinstance(keep, bool):
        raise ValueError(f"keep_checkpoints must be true or false, got {keep!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"description must be a string, got {description!r}")
    sweep = Sweep(name=name, out_dir=Path(out_dir or data.get("out_dir", "runs/sweeps")), base=base,
                  workers=workers, seeds=seeds, methods=_methods(grid.get("methods")), tuning=tuning,
                  description=description, keep_checkpoints=keep, source=data)
    # Build every TrainConfig now: a bad compressor, parameter or [base] value fails before anything runs.
    tuning_runs(sweep)
    main_runs(sweep)
    return sweep


def _check_keys(table: dict, allowed, where: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(allowed)}")


def _table(data: dict, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{key} in {where} must be a table ([{key}]), got {value!r}")
    return value


def _int_list(value, where: str, low: int) -> tuple:
    if (not isinstance(value, list) or not value
            or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in value)):
        raise ValueError(f"{where} must be a non-empty list of integers >= {low}, got {value!r}")
    return tuple(value)


def _optional_int(table: dict, key: str, where: str) -> Optional[int]:
    value = table.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{key} in {where} must be an integer >= 1, got {value!r}")
    return value


def _tuning(table) -> Tuning:
    if not isinstance(table, dict):
        raise ValueError(f"tuning must be a table ([tuning]), got {table!r}")
    _check_keys(table, TUNING_KEYS, "[tuning]")
    lrs = table.get("lrs")
    if (not isinstance(lrs, list) or not lrs
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in lrs)):
        raise ValueError(f"lrs in [tuning] must be a non-empty list of numbers > 0, got {lrs!r}")
    validation = table.get("validation", 0.1)
    if isinstance(validation, bool) or not isinstance(validation, (int, float)) or not 0 < validation < 1:
        raise ValueError(f"validation in [tuning] must be a fraction with 0 < validation < 1, got {validation!r}")
    tuned = table.get("tuned", True)
    if not (isinstance(tuned, bool) or tuned == "both"):
        raise ValueError(f"tuned in [tuning] must be true, false or \"both\", got {tuned!r}")
    widen = table.get("widen", 0)
    if isinstance(widen, bool) or not isinstance(widen, int) or widen < 0:
        raise ValueError(f"widen in [tuning] must be an integer >= 0, got {widen!r}")
    if widen and len(set(lrs)) < 2:
        raise ValueError(f"widen in [tuning] steps beyond the grid by its ratio at the edge: it needs at least two "
                         f"distinct lrs, got {lrs!r}")
    return Tuning(lrs=tuple(float(v) for v in lrs), validation=float(validation),
                  seeds=_int_list(table.get("seeds", [0]), "[tuning] seeds", low=0),
                  workers=_optional_int(table, "workers", "[tuning]"),
                  epochs=_optional_int(table, "epochs", "[tuning]"),
                  max_steps=_optional_int(table, "max_steps", "[tuning]"), tuned=tuned, widen=widen)


def _methods(entries) -> list:
    if not isinstance(entries, list) or not entries:
        raise ValueError("the sweep needs at least one [[grid.methods]] table with a compressor")
    methods = []
    for i, entry in enumerate(entries, 1):
        where = f"[[grid.methods]] #{i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a table, got {entry!r}")
        _check_keys(entry, METHOD_KEYS, where)
        compressor = entry.get("compressor")
        if not isinstance(compressor, str):
            raise ValueError(f"{where} needs compressor = \"NAME\" (see `gradzip methods`), got {compressor!r}")
        params = entry.get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"params in {where} must be a table, got {params!r}")
        overrides = {k: v for k, v in entry.items() if k in BASE_KEYS}
        label = entry.get("label", _default_label(compressor, params))
        if not isinstance(label, str) or not _LABEL.match(label):
            raise ValueError(f"label in {where} must be letters, digits and . _ + - (it names directories), "
                             f"got {label!r}")
        sweep_param, values = entry.get("sweep_param"), entry.get("values")
        if sweep_param is None and values is None:
            methods.append(Method(label, label, compressor, params, overrides))
            continue
        if not isinstance(sweep_param, str) or not isinstance(values, list) or not values:
            raise ValueError(f"{where}: sweep_param (a parameter name) and values (a non-empty list) go together, "
                             f"got sweep_param={sweep_param!r}, values={values!r}")
        if sweep_param in params or sweep_param in overrides or sweep_param in _SET_BY_SWEEP:
            raise ValueError(f"{where}: sweep_param {sweep_param!r} is also set elsewhere in the method, or is "
                             f"set by the sweep ({', '.join(_SET_BY_SWEEP)})")
        for value in values:
            p, o = dict(params), dict(overrides)
            # A [base] key (e.g. "lr") goes to the run's config; anything else is the compressor's.
            (o if sweep_param in BASE_KEYS else p)[sweep_param] = value
            methods.append(Method(f"{label}-{sweep_param}{_fmt(value)}", label, compressor, p, o, sweep_param,
                                  value))
    seen = set()
    for m in methods:
        if m.label in seen:
            raise ValueError(f"two methods are labelled {m.label!r}; give the [[grid.methods]] distinct labels")
        seen.add(m.label)
    return methods


def _fmt(value) -> str:
    text = str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def _default_label(compressor, params: dict) -> str:
    return "-".join([str(compressor)] + [f"{k}{_fmt(v)}" for k, v in params.items()])


# -- planning -----------------------------------------------------------------------------------------------


def _config(sweep: Sweep, method: Method, workers: int, seed: int, name: str, where: str, *,
            lr: Optional[float] = None, tuning: bool = False) -> TrainConfig:
    fields = {"progress": False, **sweep.base, **method.overrides}
    if lr is not None:
        fields["lr"] = lr
    if tuning:
        t = sweep.tuning
        fields["validation"] = t.validation
        fields.update({k: getattr(t, k) for k in ("epochs", "max_steps") if getattr(t, k) is not None})
    try:
        return TrainConfig(compressor=method.compressor, params=dict(method.params), workers=workers, seed=seed,
                           name=name, out_dir=str(sweep.directory / where), resume=True, **fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"run {name}: {exc}") from None


def _tuning_workers(sweep: Sweep) -> tuple:
    return sweep.workers if sweep.tuning.workers is None else (sweep.tuning.workers,)


def tuning_runs(sweep: Sweep) -> list:
    """The short validation runs, one per method, tuning worker count, lr and tuning seed."""
    if sweep.tuning is None:
        return []
    t = sweep.tuning
    return [run for m in sweep.methods for w in _tuning_workers(sweep) for lr in t.lrs for run in _tuning_at(sweep, m, w, lr)]


def _tuning_at(sweep: Sweep, method: Method, workers: int, lr: float) -> list:
    """The tuning runs of one setting at one lr, one per tuning seed."""
    return [Run(_config(sweep, method, workers, s, f"{method.label}-w{workers}-lr{_fmt(lr)}-s{s}", "tuning", lr=lr,
                        tuning=True), method) for s in sweep.tuning.seeds]


def main_runs(sweep: Sweep, lrs: Optional[dict] = None) -> list:
    """The sweep's runs.  ``lrs`` maps (label, workers) to the tuned lr; a tuned run without one (a dry run)
    is planned with the base lr.  A tuned run whose lr equals the untuned one shares that run."""
    runs = []
    variants = (None,) if sweep.tuning is None else sweep.tuning.variants
    for m in sweep.methods:
        for w in sweep.workers:
            for s in sweep.seeds:
                untuned = None
                for tuned in variants:
                    lr = (lrs or {}).get((m.label, w)) if tuned else None
                    if tuned and untuned is not None and lr == untuned.config.lr:
                        runs.append(Run(untuned.config, m, True))
                        continue
                    name = f"{m.label}-tuned-w{w}-s{s}" if tuned else f"{m.label}-w{w}-s{s}"
                    run = Run(_config(sweep, m, w, s, name, "runs", lr=lr), m, tuned)
                    runs.append(run)
                    if tuned is False:
                        untuned = run
    return runs


def pick_lr(scores: dict, lower_is_better: bool = False) -> float:
    """The lr with the best mean score over its seeds (``{lr: [score, ...]}``).

    A NaN or missing score (a diverged or failed run) counts as the worst; ties go to the earlier lr.
    """
    def mean(values):
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if len(finite) < len(values) or not finite:
            return -math.inf
        return -sum(finite) / len(finite) if lower_is_better else sum(finite) / len(finite)

    if not scores:
        raise ValueError("pick_lr needs at least one lr with scores")
    return max(scores, key=lambda lr: mean(scores[lr]))  # max returns the first of equal keys


def bracket_lr(scores_of: Callable[[float], list], lrs, widen: int, lower_is_better: bool = False) -> tuple:
    """Score ``lrs`` and, while the best (:func:`pick_lr`) is the smallest or the largest lr tried, try one
    more beyond that edge, at most ``widen`` times: the edge times the ratio between it and its neighbour
    (0.01 after 0.03, 0.1 on a grid 0.01, 0.03 with 0.03 best; three significant digits).

    ``scores_of(lr)`` returns that lr's scores (one per seed; None or NaN: failed).  Returns ``(best lr,
    {lr: scores} in the order tried, whether the best is still at an edge)``: True after ``widen`` steps
    means the grid should grow further before the choice is trusted.
    """
    scores = {float(lr): scores_of(float(lr)) for lr in dict.fromkeys(lrs)}
    for _ in range(widen):
        if all(v is None or not math.isfinite(v) for values in scores.values() for v in values):
            break  # nothing trained: no edge to move
        ordered = sorted(scores)
        best = pick_lr(scores, lower_is_better)
        if best == ordered[0]:
            step = ordered[0] * ordered[0] / ordered[1]
        elif best == ordered[-1]:
            step = ordered[-1] * ordered[-1] / ordered[-2]
        else:
            break
        lr = float(f"{step:.3g}")
        scores[lr] = scores_of(lr)
    best = pick_lr(scores, lower_is_better)
    return best, scores, len(scores) > 1 and best in (min(scores), max(scores))


# -- running ------------------------------------------------------------------------------------------------


def _check_same_config(run: Run) -> None:
    """Refuse to reuse (skip or resume) a run directory that holds a different config."""
    path = run.directory / "config.json"
    if not path.exists():
        return
    stored = json.loads(path.read_text())
    planned = json.loads(json.dumps(run.config.to_dict()))
    # A field added to TrainConfig after the run was made is absent from its config.json: it ran with
    # that field's default.
    defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(TrainConfig)
                                      if f.default is not dataclasses.MISSING}))
    differ = sorted(k for k in set(stored) | set(planned)
                    if k not in _IGNORED_IN_COMPARISON and stored.get(k, defaults.get(k)) != planned.get(k))
    if differ:
        raise ValueError(f"{run.directory} holds a run with another config (differs in {', '.join(differ)}); "
                         f"delete it or give the sweep another name")


def _execute(run: Run, index: int, total: int, keep_checkpoints: bool, log: Callable) -> tuple:
    """(summary or None, "skipped" | "ran" | "failed")."""
    summary_path = run.directory / "summary.json"
    prefix = f"[{index}/{total}] {run.name}"
    if summary_path.exists():
        log(f"{prefix}: finished before, skipped")
        return json.loads(summary_path.read_text()), "skipped"
    log(f"{prefix} ...")
    start = time.perf_counter()
    try:
        summary = launch(run.config)
    except RuntimeError as exc:  # a worker died: note it, keep going; a rerun retries it
        log(f"{prefix}: FAILED ({exc})")
        return None, "failed"
    if not keep_checkpoints:  # a finished run is never resumed; checkpoints would fill the disk
        for path in run.directory.glob("checkpoint-rank*.pt"):
            path.unlink()
    log(f"{prefix}: {summary['score']} {summary['final_score']:.4f}, {time.perf_counter() - start:.1f} s")
    return summary, "ran"


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _choose(sweep: Sweep, summaries: dict, execute: Callable[[list], dict]) -> tuple:
    """Tuned lr per (label, grid workers), the record written to tuned_lrs.json, and the tuning runs behind
    them.  ``summaries`` holds the grid's tuning runs; with ``widen``, ``execute`` runs the lrs beyond it."""
    lower = any(s.get("score") == "test_perplexity" for s in summaries.values() if s)
    chosen, record, made = {}, {}, {}
    for m in sweep.methods:
        for w in _tuning_workers(sweep):
            def scores_of(lr, m=m, w=w):
                runs = _tuning_at(sweep, m, w, lr)
                new = [r for r in runs if r.name not in summaries]
                if new:
                    summaries.update(execute(new))
                made.update((r.name, r) for r in runs)
                return [summaries[r.name]["final_score"] if summaries.get(r.name) else None for r in runs]

            lr, scores, at_edge = bracket_lr(scores_of, sweep.tuning.lrs, sweep.tuning.widen, lower)
            if all(v is None for values in scores.values() for v in values):
                continue  # every tuning run failed: no tuned runs for this setting
            targets = sweep.workers if sweep.tuning.workers is not None else (w,)
            for target in targets:
                chosen[(m.label, target)] = lr
                record.setdefault(m.label, {})[str(target)] = {
                    "lr": lr, "tuned_at_workers": w, "at_edge": at_edge,
                    "scores": {_fmt(k): (sum(v) / len(v) if None not in v else None) for k, v in scores.items()}}
    tried = sorted({r.config.lr for r in made.values()})
    return chosen, {"score": "validation_" + ("perplexity" if lower else "accuracy"),
                    "validation": sweep.tuning.validation, "lrs": tried, "widen": sweep.tuning.widen,
                    "seeds": list(sweep.tuning.seeds), "methods": record}, list(made.values())


def _manifest(sweep: Sweep, tuning: list, runs: list, lrs: Optional[dict]) -> dict:
    return {"name": sweep.name, "description": sweep.description, "config": sweep.source,
            "command": sweep.command, "machine": machine(),
            "tuned_lrs": lrs, "tuning_runs": [r.manifest() for r in tuning], "runs": [r.manifest() for r in runs]}


def run_sweep(sweep: Sweep, *, log: Callable[[str], None] = print, report: bool = True) -> dict:
    """Run (or continue) a sweep; returns counts ``{"ran", "skipped", "failed", "directory", "tuned_lrs"}``.

    ``report`` renders results.md, results.csv and the plots at the end (:func:`report.render`).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ValueError("a sweep starts its own workers for each run; run it without torchrun")
    directory = sweep.directory
    tuning = tuning_runs(sweep)
    planned = main_runs(sweep)
    for run in tuning + [r for r in planned if not r.tuned]:  # tuned runs' lrs are not known yet
        _check_same_config(run)
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / "sweep.json", _manifest(sweep, tuning, planned, None))
    counts = {"ran": 0, "skipped": 0, "failed": [], "directory": str(directory), "tuned_lrs": None}

    def execute(runs, what):
        summaries = {}
        unique = list({r.name: r for r in runs}.values())  # tuned runs may share an untuned run
        for i, run in enumerate(unique, 1):
            summary, status = _execute(run, i, len(unique), sweep.keep_checkpoints, lambda s: log(f"{what} {s}"))
            summaries[run.name] = summary
            if status == "failed":
                counts["failed"].append(run.name)
            else:
                counts[status] += 1
        return summaries

    lrs = None
    if tuning:
        chosen, record, tuning = _choose(sweep, execute(tuning, "tune"), lambda runs: execute(runs, "tune"))
        _write_json(directory / "tuned_lrs.json", record)
        log("tuned lrs: " + (", ".join(f"{label} w{w} {lr:g}" for (label, w), lr in chosen.items()) or "none"))
        counts["tuned_lrs"] = record["methods"]
        lrs = {f"{label}-w{w}": lr for (label, w), lr in chosen.items()}
        planned = [r for r in main_runs(sweep, chosen)
                   if not r.tuned or (r.method.label, r.config.workers) in chosen]
        for run in planned:
            _check_same_config(run)
        _write_json(directory / "sweep.json", _manifest(sweep, tuning, planned, lrs))
    execute(planned, "run")
    if report:
        from .report import render

        try:
            render(directory)
        except ValueError as exc:  # e.g. every run failed: the counts still say which
            log(f"no report: {exc}")
    return counts

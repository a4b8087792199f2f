"""Run the user scripts in ``scripts/`` under torchrun and read what their ranks wrote.

:func:`torchrun` is one launch: ``python -m torch.distributed.run --nproc-per-node N`` on a free port,
killed (with its whole process group) at the timeout.  :class:`Plan` runs many training runs in as few
launches as it can: the runs go to one launch in sequence; when a launch dies in a run, that run is
reported failed (with the launch's output) and the runs after it go to a new launch.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gradzip.launcher import free_port

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Launch:
    command: list
    returncode: int | None  # None: killed at the timeout
    output: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def aborted(self) -> bool:
        """A worker died of SIGABRT (e.g. "terminate called without an active exception")."""
        return "SIGABRT" in self.output or "terminate called" in self.output

    def describe(self, chars: int = 6000) -> str:
        status = "killed at the timeout" if self.returncode is None else f"exit code {self.returncode}"
        return (f"{' '.join(map(str, self.command))}\n-> {status} after {self.seconds:.1f} s; "
                f"output tail:\n{self.output[-chars:]}")


def torchrun(script: str, *args, nproc: int = 2, timeout: float = 300, log: Path | None = None,
             env: dict | None = None) -> Launch:
    """Launch ``scripts/<script>`` with ``nproc`` workers; stdout and stderr together go to ``log``."""
    # torchrun keeps its workers' log folders in a new temporary directory that it never removes
    logs = tempfile.TemporaryDirectory(prefix="torchrun-logs-")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--log-dir", logs.name, "--master-port", str(free_port()), str(SCRIPTS / script), *map(str, args)]
    full_env = {**os.environ, **(env or {})}
    # The library under test is this checkout (the scripts are run from their own folder).
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    log = Path(log) if log is not None else Path(os.devnull)
    start = time.perf_counter()
    with logs, open(log, "w+b") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: their own session
            proc.wait()
            returncode = None
        out.seek(0)
        output = out.read().decode(errors="replace")
    return Launch(command, returncode, output, time.perf_counter() - start)


def identical_across_ranks(states: list[dict]) -> list[str]:
    """Names of the tensors that are not bit-identical on every rank, with how they differ."""
    return differences(states[0], *states[1:])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def differences(reference: dict, *others: dict) -> list[str]:
    """Tensors of ``others`` that are not bit-identical to ``reference``'s (equal dtype, shape, bits)."""
    found = []
    for i, other in enumerate(others, 1):
        if other.keys() != reference.keys():
            found.append(f"#{i}: other tensor names {sorted(other.keys() ^ reference.keys())}")
        for name in reference.keys() & other.keys():
            a, b = reference[name], other[name]
            if a.dtype != b.dtype or a.shape != b.shape:
                found.append(f"#{i} {name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            elif not torch.equal(_bits(a), _bits(b)):
                diff = (a.double() - b.double()).abs()
                found.append(f"#{i} {name}: {int((a != b).sum())} of {a.numel()} elements differ, "
                             f"max |diff| {float(diff.nan_to_num(float('inf')).max()):.3g}")
    return sorted(found)


@dataclass
class Result:
    """What every rank of one run wrote: ``reports[r]`` (the JSON) and ``params[r]`` (the state_dict)."""

    name: str
    reports: list
    params: list

    def assert_completed(self) -> None:
        errors = [f"rank {r}:\n{rep['error']}" for r, rep in enumerate(self.reports) if rep["error"]]
        assert not errors, f"{self.name} raised:\n" + "\n".join(errors)

    def assert_ranks_identical(self) -> None:
        diff = identical_across_ranks(self.params)
        assert not diff, f"{self.name}: final parameters differ between ranks:\n" + "\n".join(diff)

    def assert_learned(self) -> None:
        for r, rep in enumerate(self.reports):
            losses = rep["losses"]
            assert losses and all(isinstance(v, float) for v in losses), f"{self.name} rank {r}: losses {losses}"
            assert rep["eval_after"] < rep["eval_before"], (
                f"{self.name} rank {r}: held-out loss did not decrease: {rep['eval_before']} -> {rep['eval_after']} "
                f"(training losses {losses})")

    def assert_gradzip_exchanged(self, world_size: int = 2) -> None:
        for r, rep in enumerate(self.reports):
            stats = rep["stats"]
            assert stats["exchanges"] > 0, f"{self.name} rank {r}: gradzip exchanged nothing: {stats}"
            assert stats["world_size"] == world_size, f"{self.name} rank {r}: gradzip's world size: {stats}"

    def assert_same_params(self, other: "Result") -> None:
        """Every rank ended with bit for bit the parameters it ended with in ``other``."""
        for rank, (a, b) in enumerate(zip(other.params, self.params)):
            diff = differences(a, b)
            assert not diff, f"rank {rank}: {self.name} != {other.name}:\n" + "\n".join(diff)

    def assert_compressed(self) -> None:
        """gradzip handed fewer bytes to collectives than dense averaging would have."""
        for r, rep in enumerate(self.reports):
            stats = rep["stats"]
            assert stats["ratio"] > 1, (f"{self.name} rank {r}: sent more bytes than dense: ratio {stats['ratio']:.3g} "
                                        f"(density {stats['density']:.3g}, {stats['bytes_sent']} bytes sent)")


def load_result(folder: Path, name: str, nproc: int = 2) -> Result:
    """The run ``name`` as every rank wrote it under ``folder`` (scripts/scenarios.py); it must have
    completed on every rank."""
    missing = [r for r in range(nproc) if not (folder / name / f"rank{r}.json").exists()]
    assert not missing, f"{name}: no result from rank(s) {missing} in {folder / name}"
    reports = [json.loads((folder / name / f"rank{r}.json").read_text()) for r in range(nproc)]
    result = Result(name, reports, [])
    result.assert_completed()
    result.params = [torch.load(folder / name / f"rank{r}.pt", weights_only=True) for r in range(nproc)]
    return result


@dataclass
class Plan:
    """Runs of one script, launched as few times as possible; see the module docstring."""

    script: str
    runs: list
    folder: Path
    args: tuple = ()
    nproc: int = 2
    timeout: float = 300   # one launch
    budget: float = 480    # all launches: no relaunch after this many seconds (pytest's timeout is 600 s)
    max_launches: int = 6
    launches: list = field(default_factory=list)
    died_in: dict = field(default_factory=dict)  # run name -> the Launch that died in it

    def _wrote(self, name: str, suffix: str) -> bool:
        return all((self.folder / name / f"rank{r}.{suffix}").exists() for r in range(self.nproc))

    def _started(self, name: str) -> bool:
        return any((self.folder / name / f"rank{r}.started").exists() for r in range(self.nproc))

    def execute(self) -> "Plan":
        self.folder.mkdir(parents=True, exist_ok=True)
        pending = list(self.runs)
        start = time.perf_counter()
        while pending and len(self.launches) < self.max_launches:
            left = self.budget - (time.perf_counter() - start)
            if left < 30:
                break
            plan_file = self.folder / f"plan{len(self.launches)}.json"
            plan_file.write_text(json.dumps(pending))
            launch = torchrun(self.script, "--plan", plan_file, "--out", self.folder, *self.args, nproc=self.nproc,
                              timeout=min(self.timeout, left), log=self.folder / f"launch{len(self.launches)}.log")
            self.launches.append(launch)
            done = [run for run in pending if self._wrote(run["name"], "json")]
            pending = [run for run in pending if run not in done]
            if launch.ok or not pending:
                break
            culprit = next((run for run in pending if self._started(run["name"])), None)
            if culprit is None:  # died before its first run: relaunching would do the same
                break
            self.died_in[culprit["name"]] = launch
            pending.remove(culprit)
        return self

    def result(self, name: str) -> Result:
        if name in self.died_in:
            raise AssertionError(f"{name}: the launch died in this run:\n{self.died_in[name].describe()}")
        if not self._wrote(name, "json"):
            last = self.launches[-1] if self.launches else None
            raise AssertionError(f"{name}: not run (launches: {len(self.launches)}); last launch:\n"
                                 + (last.describe() if last else "none"))
        return load_result(self.folder, name, self.nproc)

    def assert_exit_codes(self) -> None:
        """Every launch that did not die in a run exited with 0 (an abort at exit fails this)."""
        bad = [launch for launch in self.launches if not launch.ok and launch not in self.died_in.values()]
        assert not bad, "\n\n".join(launch.describe() for launch in bad)

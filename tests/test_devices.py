"""The one seam between the CPU and the GPU paths (:mod:`gradzip.devices`): the library outside the lab
asks its predicates instead of testing a device's type itself."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from gradzip import devices

PACKAGE = pathlib.Path(devices.__file__).parent
#: The lab (models, trainer, benchmarks, cost model, test helpers) picks devices for a run: not the seam's.
LAB = ("harness", "bench", "costmodel.py", "advise.py", "cli.py", "netem.py", "launcher.py", "testing.py")
#: A branch on a device's kind: ``x.device.type == ...``, ``device.type != ...``, ``t.is_cuda``, ``is_cpu``.
BRANCH = re.compile(r"\.type\s*(==|!=|in\b|not in\b)|\.is_cuda\b|\.is_cpu\b|\bdevice_type\s*(==|!=)")


def _library_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name != "devices.py" and relative.parts[0] not in LAB:
            yield relative, path


def test_no_device_branch_outside_the_seam():
    found = [f"{relative}:{number}: {line.strip()}" for relative, path in _library_files()
             for number, line in enumerate(path.read_text().splitlines(), 1) if BRANCH.search(line)]
    assert not found, "device branches outside gradzip/devices.py:\n" + "\n".join(found)


def test_the_pattern_finds_what_it_should():  # the check above cannot pass by matching nothing
    for line in ['if g.device.type == "cpu":', "if flag.is_cuda:", 'x.device.type != "cpu" or n', "device.type in CPUS"]:
        assert BRANCH.search(line), line
    assert list(_library_files()) and not BRANCH.search("layout.dtype == torch.float32")


@pytest.mark.parametrize("name", [n for n in devices.__all__ if n != "cuda"])
def test_every_cpu_fast_path_is_taken_on_a_cpu(name):
    predicate = getattr(devices, name)
    assert predicate(torch.zeros(1)) and predicate(torch.device("cpu")) and predicate("cpu")
    assert not predicate(torch.device("meta")) and not predicate("cuda")


def test_cuda_is_cuda():
    assert devices.cuda("cuda:1") and devices.cuda(torch.device("cuda")) and not devices.cuda(torch.zeros(1))

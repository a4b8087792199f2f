"""The package's shape: core layers import only downward, and no function is longer than 80 lines."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "gradzip"
# bit codecs -> compressors (and their fused kernels) -> error feedback -> collectives -> state; the
# integrations and the lab sit above and may import anything below them.
CORE = {"bits": 0, "devices": 0, "ahead": 0, "kernels": 1, "compressors": 1, "feedback": 2, "collectives": 3, "buckets": 4, "state": 4}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield path, parts


def _imported(parts: tuple, node: ast.ImportFrom) -> tuple:
    """The gradzip-relative module path an import names (empty when it is not gradzip's)."""
    if node.level == 0:
        name = (node.module or "").split(".")
        return tuple(name[1:]) if name[0] == "gradzip" else ()
    package = parts[:-1]  # a module's package; an __init__ is its own package, which parts[:-1] is too
    base = package[: len(package) - (node.level - 1)]
    return base + tuple((node.module or "").split(".")) if node.module else base


@pytest.mark.parametrize("path, parts", [(p, q) for p, q in _modules() if q[0] in CORE],
                         ids=lambda v: "/".join(v) if isinstance(v, tuple) else "")
def test_core_layers_import_only_downward(path, parts):
    layer = CORE[parts[0]]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            targets = [_imported(parts, node)]
        elif isinstance(node, ast.Import):
            targets = [tuple(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "gradzip"]
        else:
            continue
        for target in targets:
            if not target:
                continue
            assert target[0] in CORE and CORE[target[0]] <= layer, (
                f"{path.relative_to(ROOT.parent)}:{node.lineno} imports gradzip.{'.'.join(target)}, above "
                f"its layer")


def test_no_function_over_80_lines():
    long = [f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, _ in _modules() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert not long, long


def test_import_gradzip_needs_no_framework():
    """HF Transformers and the other frameworks are optional: ``import gradzip`` imports none of them."""
    code = ("import sys, gradzip, gradzip.integrations\n"
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent, env={**os.environ, "PYTHONPATH": str(ROOT.parent)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""Stand-ins for a compile that a compiling child of :mod:`gradzip.ahead` runs (``ahead.spawn(spec,
"tests.compile_targets:name")``): each takes the request's spec, as :func:`gradzip.ahead._main` does."""
import json
import os
import signal
import sys
import tempfile
import time
import traceback

from gradzip import ahead


def _say(path: str, what) -> None:
    """Write ``what`` to ``path`` whole (the test polls for the file)."""
    with open(path + ".part", "w") as f:
        json.dump(what, f)
    os.replace(path + ".part", path)


def _writes_part(spec: dict) -> None:
    """Where the spec has a ``path``: write a package and sidecar under the compile's own name, as
    :func:`gradzip.ahead._main` does before it checks the package and renames it."""
    if spec.get("path"):
        part = ahead._PART[0] = ahead._part(spec["path"], ahead._SCRATCH[0])
        for suffix in (".pt2", ".json"):
            with open(part + suffix, "w") as f:
                f.write("half")


def nothing(spec: dict) -> None:
    pass


def unpacking(spec: dict) -> None:
    """As a compile goes for its files: unpack something into the directory TMPDIR names, as AOTInductor does
    for every package it loads, say where, and wait to be stopped; the package written first (where the spec
    has a ``path``)."""
    _writes_part(spec)
    ahead._unpack_in_scratch()
    unpacked = tempfile.mkdtemp(prefix="aotinductor_", dir=os.environ["TMPDIR"])
    _say(spec["said"], [os.getpid(), unpacked])
    time.sleep(600)


def where(spec: dict) -> None:
    """Say this child's process and temporary directory, as the environment and Python's ``tempfile`` have
    it (the compile's scratch directory, taken as a compile takes it, where ``scratch``)."""
    if spec.get("scratch"):
        ahead._unpack_in_scratch()
        tempfile.tempdir = None  # as if first asked for now: from TMPDIR
    _say(spec["said"], [os.getpid(), os.environ.get("TMPDIR"), tempfile.gettempdir()])


#: How many times this child has run :func:`logged`.
_LOGGED = [0]


def _log(path: str) -> None:
    """Add this child's process to the file ``path``, a line each."""
    with open(path, "a") as log:
        log.write(f"{os.getpid()}\n")


def logged(spec: dict) -> None:
    """Add this child's process to the file ``log``; raise where ``raises``, or where ``raises_if_run_before``
    and this child has run this before."""
    _LOGGED[0] += 1
    _log(spec["log"])
    if spec.get("raises") or (spec.get("raises_if_run_before") and _LOGGED[0] > 1):
        raise ValueError("the compile's own failure")


def sleeping(spec: dict) -> None:
    """Add this child's process to the file ``log``, then sleep."""
    _log(spec["log"])
    time.sleep(600)


def exits_after_a_traceback(spec: dict) -> None:
    """A failure printed, then more output (a warning's source line at shutdown), then exit status 1; the
    package written first (where the spec has a ``path``)."""
    _writes_part(spec)
    try:
        raise ValueError("the real reason")
    except ValueError:
        traceback.print_exc()
    print("    return cls.__new__(cls, *args)")
    sys.exit(1)


def terminated(spec: dict) -> None:
    """Stopped from outside (a job's time limit) after some output; the package written first (where the
    spec has a ``path``)."""
    _writes_part(spec)
    print("half", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

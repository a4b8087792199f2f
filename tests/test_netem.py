"""The emulated cluster: real network namespaces, veth pairs, a bridge and tbf; always cleaned up."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gradzip import netem
from gradzip.netem import EmulatedCluster, LinkSpec, leftover_namespaces, parse_netem

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")
DIGITS = ["--dataset", "digits", "--model", "mlp", "--batch-size", "16", "--no-progress"]


def test_parse_netem():
    assert parse_netem("rate=100mbit,delay=1ms,loss=0%") == LinkSpec(100e6, 1.0, 0.0)
    assert parse_netem("rate=10gbit") == LinkSpec(10e9, 0.0, 0.0)
    assert parse_netem("rate=none") == LinkSpec(None, 0.0, 0.0)
    assert str(parse_netem("rate=1gbit,delay=500us")) == "rate=1gbit,delay=0.5ms,loss=0%"
    for bad in ("rate=fast", "speed=1gbit", "loss=120%", "delay=1hour"):
        with pytest.raises(ValueError, match="allowed: rate="):
            parse_netem(bad)


def test_without_root_the_error_is_clear(monkeypatch):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="--netem needs root"):
        with EmulatedCluster(2, LinkSpec(1e9)):
            pass


def _send(cluster, src, dst, nbytes):
    server = subprocess.Popen(
        ["ip", "netns", "exec", cluster.namespace(dst), sys.executable, "-c",
         "import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
         "s.bind(('0.0.0.0',5999));s.listen();c,_=s.accept();n=0\nwhile True:\n d=c.recv(1<<20)\n if not d: break\n"
         " n+=len(d)\nprint(n)"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    client = subprocess.run(
        ["ip", "netns", "exec", cluster.namespace(src), sys.executable, "-c",
         f"import socket,time\ns=socket.create_connection(('{cluster.address(dst)}',5999))\nt=time.perf_counter()\n"
         f"s.sendall(b'x'*{nbytes});s.shutdown(socket.SHUT_WR);s.recv(1);print(time.perf_counter()-t)"],
        capture_output=True, text=True, timeout=60)
    received = int(server.communicate(timeout=60)[0])
    return received, float(client.stdout)


@needs_root
def test_link_is_rate_limited_and_removed_afterwards():
    with EmulatedCluster(2, parse_netem("rate=100mbit")) as cluster:
        received, seconds = _send(cluster, 0, 1, 8 << 20)
        assert received == 8 << 20
        mbit = 8 * received / seconds / 1e6
        assert 60 < mbit < 110, f"measured {mbit:.0f} Mbit/s on a 100 Mbit/s link"
        assert len(leftover_namespaces(os.getpid())) == 3
    assert leftover_namespaces(os.getpid()) == []


@needs_root
def test_delay_is_applied_or_refused_clearly():
    # Kernels without sch_netem (this project's CI machine) must refuse delay= with a clear error and
    # leave nothing behind; kernels with it must delay: 20 ms on each host's egress, so a round trip
    # between two hosts takes at least 40 ms.
    try:
        with EmulatedCluster(2, parse_netem("delay=20ms")) as cluster:
            received, seconds = _send(cluster, 0, 1, 1)
            assert received == 1 and seconds >= 0.038, f"round trip {1e3 * seconds:.1f} ms with 2 x 20 ms delay"
    except RuntimeError as exc:
        assert "need the kernel's netem qdisc (sch_netem)" in str(exc)
    assert leftover_namespaces(os.getpid()) == []


@needs_root
def test_failure_while_inside_the_cluster_still_cleans_up():
    with pytest.raises(ZeroDivisionError):
        with EmulatedCluster(3, parse_netem("rate=1gbit")):
            1 / 0
    assert leftover_namespaces(os.getpid()) == []


@needs_root
def test_namespaces_of_a_dead_launcher_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"{netem.PREFIX}{dead.pid}-stale-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in netem.remove_stale_namespaces()
    assert name not in leftover_namespaces()


@needs_root
def test_training_over_an_emulated_link(tmp_path):
    train = subprocess.Popen([sys.executable, "-m", "gradzip", "train", *DIGITS, "-c", "topk", "-p", "ratio=0.1",
                              "--netem", "rate=1gbit", "--out-dir", str(tmp_path), "--name", "r"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = train.communicate(timeout=180)
    finally:
        _stop(train)
    assert train.returncode == 0, stderr[-2000:]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["final_test_accuracy"] > 0.3
    assert leftover_namespaces(train.pid) == []  # its own: another run on the machine may hold others


def _default_sigint():
    # A shell that starts the test run in the background hands its children SIGINT ignored, and Python then
    # keeps it ignored; the launcher should see Ctrl-C as a user at a terminal sends it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_and_wait_for_pids(tmp_path, world=2):
    proc = subprocess.Popen([sys.executable, "-m", "gradzip", "train", *DIGITS, "-n", str(world), "--epochs", "200",
                             "--netem", "rate=100mbit", "--out-dir", str(tmp_path), "--name", "r"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_default_sigint)
    deadline = time.time() + 60
    while time.time() < deadline:
        metrics = tmp_path / "r" / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count("\n") > 3:
            return proc
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("training did not start")


def _stop(proc):
    """A launcher a failed test leaves running gets SIGTERM, which unwinds through its cleanup."""
    if proc.poll() is None:
        proc.terminate()
        proc.communicate(timeout=60)


@needs_root
def test_killed_worker_leaves_nothing_behind(tmp_path):
    proc = _start_and_wait_for_pids(tmp_path)
    try:
        assert leftover_namespaces(proc.pid)
        os.kill(int((tmp_path / "r" / "rank1.pid").read_text()), signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode != 0
    assert leftover_namespaces(proc.pid) == []


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_launcher_leaves_nothing_behind(tmp_path, sig):
    proc = _start_and_wait_for_pids(tmp_path)
    try:
        proc.send_signal(sig)
        proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode != 0
    assert leftover_namespaces(proc.pid) == []

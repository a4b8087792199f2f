"""An emulated cluster on one Linux machine: one network namespace per worker, a slow link each.

Topology: a "switch" namespace holds a bridge; every host namespace is joined to it by a veth pair.
Each host's link is shaped in both directions with ``tc``: netem (delay, loss) and tbf (rate) on the
host's egress, tbf (rate) on the switch port's egress.  Host-to-host round trips are therefore
2 x delay and every host sends and receives at ``rate``, like a machine on a switched network.

Only addresses inside the namespaces created here are used (10.213.0.0/24), and everything is removed
on exit — normal end, exception, Ctrl-C or SIGTERM; namespaces left by a launcher that was itself
SIGKILLed are removed by the next run (their names carry the dead launcher's pid).  Needs root.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass
from typing import Optional

__all__ = ["LinkSpec", "parse_netem", "EmulatedCluster", "enter_namespace", "leftover_namespaces",
           "remove_stale_namespaces"]

PREFIX = "gradzip-"
SUBNET = "10.213.0"
INTERFACE = "eth0"
_CLONE_NEWNET = 0x40000000

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


@dataclass(frozen=True)
class LinkSpec:
    """One host's link: ``rate`` in bits/s (None: unthrottled), one-way ``delay_ms``, ``loss_pct``."""

    rate_bps: Optional[float] = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0

    def __str__(self) -> str:
        rate = "unthrottled" if self.rate_bps is None else _format_rate(self.rate_bps)
        return f"rate={rate},delay={self.delay_ms:g}ms,loss={self.loss_pct:g}%"


def _format_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def parse_netem(text: str) -> LinkSpec:
    """``"rate=100mbit,delay=1ms,loss=0%"`` -> LinkSpec.  Keys: rate (bit|kbit|mbit|gbit, or
    'none'), delay (ms|us|s), loss (%)."""
    allowed = "rate=<N>(bit|kbit|mbit|gbit), delay=<N>(us|ms|s), loss=<N>%"
    rate, delay, loss = None, 0.0, 0.0
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if key == "rate":
            if value in ("none", "unlimited", "inf"):
                rate = None
                continue
            m = re.fullmatch(r"([0-9.]+)\s*(bit|kbit|mbit|gbit|tbit)", value)
            if not m or float(m.group(1)) <= 0:
                raise ValueError(f"bad netem rate {value!r}; allowed: {allowed}")
            rate = float(m.group(1)) * _UNITS[m.group(2)]
        elif key == "delay":
            m = re.fullmatch(r"([0-9.]+)\s*(us|ms|s)", value)
            if not m:
                raise ValueError(f"bad netem delay {value!r}; allowed: {allowed}")
            delay = float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
        elif key == "loss":
            m = re.fullmatch(r"([0-9.]+)\s*%?", value)
            if not m or not 0 <= float(m.group(1)) < 100:
                raise ValueError(f"bad netem loss {value!r}; allowed: {allowed}")
            loss = float(m.group(1))
        else:
            raise ValueError(f"unknown netem key {key!r} in {text!r}; allowed: {allowed}")
    return LinkSpec(rate, delay, loss)


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftover_namespaces(pid: Optional[int] = None) -> list[str]:
    """gradzip's namespaces that exist now (of launcher ``pid`` only, if given)."""
    mark = PREFIX if pid is None else f"{PREFIX}{pid}-"
    return [ns for ns in _namespaces() if ns.startswith(mark)]


def remove_stale_namespaces() -> list[str]:
    """Remove namespaces of launchers that no longer run (one SIGKILLed cannot clean up after itself)."""
    removed = []
    for ns in leftover_namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            removed.append(ns)
    return removed


def enter_namespace(name: str) -> None:
    """Move the calling thread (call it first thing in a worker process) into network namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


class EmulatedCluster:
    """``with EmulatedCluster(4, parse_netem("rate=100mbit,delay=1ms")) as cluster:`` — then worker r
    calls ``enter_namespace(cluster.namespace(r))`` and uses ``cluster.address(0)`` as MASTER_ADDR and
    ``INTERFACE`` as GLOO_SOCKET_IFNAME."""

    def __init__(self, hosts: int, link: LinkSpec):
        if hosts < 1 or hosts > 250:
            raise ValueError(f"an emulated cluster needs 1..250 hosts, got {hosts}")
        self.hosts, self.link = hosts, link
        self.tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._created: list[str] = []
        self._old_handlers: dict = {}

    def namespace(self, rank: int) -> str:
        return f"{self.tag}-h{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def __enter__(self) -> "EmulatedCluster":
        if os.geteuid() != 0:
            raise PermissionError("--netem needs root (network namespaces and tc); run as root or drop --netem")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"--netem needs {' and '.join(missing)} (Debian package iproute2)")
        remove_stale_namespaces()
        # SIGTERM (e.g. from a job scheduler) must unwind through __exit__ like Ctrl-C does.
        self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._netns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for rank in range(self.hosts):
            host, port = self.namespace(rank), f"p{rank}"
            self._netns(host)
            _run("ip", "link", "add", INTERFACE, "netns", host, "type", "veth", "peer", "name", port,
                 "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", host, "addr", "add", f"{self.address(rank)}/24", "dev", INTERFACE)
            _run("ip", "-n", host, "link", "set", INTERFACE, "up")
            self._shape(host, INTERFACE, with_delay=True)
            self._shape(self.switch, port, with_delay=False)

    def _shape(self, ns: str, dev: str, with_delay: bool) -> None:
        tc = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev)
        parent = ("root",)
        if with_delay and (self.link.delay_ms > 0 or self.link.loss_pct > 0):
            try:
                _run(*tc, "root", "handle", "1:", "netem", "delay", f"{self.link.delay_ms}ms",
                     "loss", f"{self.link.loss_pct}%", "limit", "100000")
            except RuntimeError as exc:
                if "unknown" in str(exc).lower():
                    raise RuntimeError("delay= and loss= need the kernel's netem qdisc (sch_netem), which this "
                                       "kernel does not have; rate= works (tbf): drop delay/loss or use "
                                       "another kernel") from None
                raise
            parent = ("parent", "1:")
        if self.link.rate_bps is not None:
            rate_bytes = self.link.rate_bps / 8
            # veth hands tbf GSO packets of up to 64 KiB: a smaller bucket would stall them forever.
            burst = max(int(rate_bytes * 0.002), 128 * 1024)
            _run(*tc, *parent, "handle", "2:", "tbf", "rate", f"{int(self.link.rate_bps)}bit",
                 "burst", str(burst), "latency", "200ms")

    def close(self) -> None:
        """Remove every namespace this cluster created (their veths and qdiscs go with them)."""
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")

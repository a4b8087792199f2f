"""What was allocated at a CUDA memory peak, grouped by the line of code that allocated it.

Reads a snapshot that ``gradzip bench step --device cuda --memory-snapshot DIR`` wrote for each contender
(``DIR/NAME.pickle``: the caching allocator's history over the contender's first and warm-up steps,
``torch.cuda.memory._dump_snapshot``), replays its allocations and frees, and lists what was alive when
the most bytes were:

    python benchmarks/memory_peak.py DIR/sketch.pickle [--top 15]

A line is the innermost frame in gradzip (else in the script, else the innermost Python frame). Memory
allocated before the history started (none for bench step's contenders: it starts before the model
is built) is not seen. A block counts until the allocator has really freed it (``free_completed``:
after the streams that used it are done), as ``torch.cuda.max_memory_allocated`` counts it.
"""
from __future__ import annotations

import argparse
import collections
import pickle


def _free_action(events: list) -> str:
    return "free_completed" if any(e["action"] == "free_completed" for e in events) else "free_requested"


def peak_allocations(snapshot: dict, device: int = 0) -> tuple[int, list]:
    """(peak bytes, the allocation events alive at the peak) of one device's trace."""
    events = snapshot["device_traces"][device]
    freed = _free_action(events)
    sizes, total, peak, peak_at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == freed and e["addr"] in sizes:
            total -= sizes.pop(e["addr"])
    live = {}
    for e in events[:peak_at + 1]:  # again up to the peak, keeping the events themselves this time
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == freed:
            live.pop(e["addr"], None)
    return peak, list(live.values())


def site(frames: list) -> str:
    """Where an allocation was made: ``file:line function`` of its innermost gradzip frame, else the
    innermost frame outside torch, else the innermost frame."""
    def text(f):
        name = f["filename"]
        short = "gradzip/" + name.split("/gradzip/", 1)[1] if "/gradzip/" in name else name.rsplit("/", 1)[-1]
        return f"{short}:{f['line']} {f['name']}"
    python = [f for f in frames if f["filename"].endswith(".py")]
    for wanted in (lambda f: "/gradzip/" in f["filename"] and "/bench/" not in f["filename"],
                   lambda f: "/torch/" not in f["filename"]):
        found = [f for f in python if wanted(f)]
        if found:
            return text(found[0])
    return text(python[0]) if python else "(no Python frame)"


def by_site(allocations: list) -> list:
    """(site, bytes, count) of the allocations, the largest first."""
    totals = collections.defaultdict(lambda: [0, 0])
    for e in allocations:
        entry = totals[site(e.get("frames") or [])]
        entry[0] += e["size"]
        entry[1] += 1
    return sorted(((s, b, n) for s, (b, n) in totals.items()), key=lambda row: -row[1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="a NAME.pickle of gradzip bench step --memory-snapshot")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    peak, live = peak_allocations(snapshot, args.device)
    print(f"{args.snapshot}: peak {peak / 2**20:.1f} MB in {len(live)} allocations; by where they were made:")
    for where, size, count in by_site(live)[:args.top]:
        print(f"  {size / 2**20:9.1f} MB  {count:5d}  {where}")


if __name__ == "__main__":
    main()

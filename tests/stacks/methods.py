"""Every gradzip method with the parameters the conformance scripts give it.

Defaults, except where a default would leave a small model's gradients uncompressed for the few steps
these scripts train: DGC skips tensors under ``min_numel`` elements and warms up for 4 epochs, PowerSGD
sends its first 10 steps densely.
"""
import os

import gradzip

METHODS = tuple(gradzip.compressors())
assert "auto" in METHODS

#: One method of each way of exchanging: DDP's own allreduce (none), the hook's C++ allreduce of a cast
#: (fp16), sparse pairs gathered (topk), sizes that depend on the data (threshold), chained low-rank
#: phases (powersgd), packed codes on the bucket route (qsgd), a majority vote (signsgd), momentum
#: correction (dgc), measured choices (auto).  The default run takes these where a launch would
#: otherwise run every method (the plain runs still do); GRADZIP_SLOW=1 takes every method.
EACH_WAY = ("none", "fp16", "topk", "threshold", "powersgd", "qsgd", "signsgd", "dgc", "auto")
SLOW_TIER = os.environ.get("GRADZIP_SLOW") == "1"


def kept_unless_slow(kept, methods=METHODS) -> tuple:
    """``methods``, only those in ``kept`` unless the slow tier runs."""
    return tuple(m for m in methods if SLOW_TIER or m in kept)

_PARAMS = {
    "dgc": {"min_numel": 0, "warmup_epochs": 0},
    "powersgd": {"dense_steps": 1},
}


def params(method: str) -> dict:
    return dict(_PARAMS.get(method, {}))


def deterministic(method: str) -> bool:
    """Whether a resumed run must equal an uninterrupted one bit for bit."""
    return gradzip.make(method, **params(method)).deterministic


def compresses(method: str, loss_scaled: bool = False) -> bool:
    """Whether the method sends fewer bytes than dense on these models (``none`` and ``auto`` may not).

    ``threshold``'s tau is absolute: on gradients multiplied by GradScaler's loss scale (65536 at first)
    it lets nearly every element through, and index + value pairs then cost more than dense values;
    docs/methods.md tells users to scale tau with the loss scale or to use Top-k.
    """
    return method not in ("none", "auto") and not (loss_scaled and method == "threshold")

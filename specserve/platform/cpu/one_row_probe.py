"""Which kernel runs a model's one-row half-precision linears (batch-1 decode) on this machine, measured at load.

Two kernels compete for a single row: PyTorch's own matrix-vector product (``packing.cpu_gemv``, on the plain weight
kept beside the packed one) and oneDNN's packed kernel. Which is faster depends on the CPU and on whether the
weights stream from memory or sit in the caches (docs/benchmarks.md, "Weight packing"): on a 2-core AMD EPYC
SmolLM2-135M's linears took 7.2 ms a token with gemv against 13.7 ms packed; on a 2-core Xeon with AMX (300 MiB of
shared L3) SmolLM2 decodes faster packed and the 12M-parameter demo with gemv. So when a model is packed with its
plain weights kept, a probe times one row through its own linears (at most PROBE_MAX_BYTES of them, in model
order) with each kernel; where the packed kernel wins, the plain copies are dropped (their memory is saved).

``SPECSERVE_ONE_ROW_KERNEL=gemv|packed`` skips the probe (``auto``, the default, runs it).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ENV = "SPECSERVE_ONE_ROW_KERNEL"
KERNELS = ("gemv", "packed")

#: The probe's passes run over the model's first linears up to this many bytes of weights (all of a small model's):
#: enough to stream from memory where the model does, short enough for a large model's start-up.
PROBE_MAX_BYTES = 256 * 2**20
PROBE_REPS = 5

#: gemv wins only when it is this much faster: its plain copies cost memory, the packed kernel none.
GEMV_MIN_GAIN = 0.05


def forced_kernel() -> str | None:
    """SPECSERVE_ONE_ROW_KERNEL's kernel, None for auto (the probe decides)."""
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced not in (*KERNELS, "auto"):
        raise ValueError(f"{ENV}={forced!r}: expected one of auto, gemv, packed")
    return None if forced == "auto" else forced


def pick_kernel(gemv_seconds: list[float], packed_seconds: list[float], min_gain: float = GEMV_MIN_GAIN) -> str:
    """The faster kernel from interleaved timings of one pass each: 'gemv' when its median is at least min_gain below
    the packed kernel's, else 'packed'."""
    faster = statistics.median(gemv_seconds) < (1.0 - min_gain) * statistics.median(packed_seconds)
    return "gemv" if faster else "packed"


def probed_linears(linears: list, max_bytes: int = PROBE_MAX_BYTES, weight=lambda lin: lin.plain) -> list:
    """The first linears (model order) whose weights (``weight(lin)``, default the plain copy) add up to at most
    max_bytes (at least one)."""
    chosen, total = [], 0
    for lin in linears:
        w = weight(lin)
        total += w.numel() * w.element_size()
        if chosen and total > max_bytes:
            break
        chosen.append(lin)
    return chosen


def probe(linears: list, reps: int = PROBE_REPS) -> dict:
    """Time one row through ``probed_linears(linears)`` (PackedLinears holding their plain weights) with each kernel,
    reps passes each, interleaved after a warm-up pass -> {"kernel", "gemv_ms", "packed_ms"} (medians of a pass)."""
    from specserve.platform.cpu.packing import _packed_matmul, cpu_gemv

    chosen = probed_linears(linears)
    gen = torch.Generator().manual_seed(0)  # not the global generator: the probe leaves seeded runs alone
    rows = {n: torch.randn(1, n, generator=gen).to(chosen[0].plain.dtype) for n in {m.in_features for m in chosen}}
    passes = {"gemv": lambda: [cpu_gemv(rows[m.in_features], m.plain, m.bias) for m in chosen],
              "packed": lambda: [_packed_matmul(rows[m.in_features], m.packed, m.bias) for m in chosen]}
    with torch.inference_mode():
        times = interleaved_times(passes, reps)
    return {"kernel": pick_kernel(times["gemv"], times["packed"]),
            "gemv_ms": round(statistics.median(times["gemv"]) * 1e3, 3),
            "packed_ms": round(statistics.median(times["packed"]) * 1e3, 3)}


def interleaved_times(passes: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Seconds of each of reps rounds of every pass, the passes interleaved round by round (so a neighbour's load
    falls on all alike), after one uncounted warm-up call each."""
    for fn in passes.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(reps):
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def choose_one_row_kernel(linears: list) -> dict:
    """The one-row kernel for these PackedLinears (their plain weights kept): SPECSERVE_ONE_ROW_KERNEL's, else the
    probe's; with 'packed' their plain weights are dropped. -> the verdict (server info)."""
    forced = forced_kernel()
    verdict = {"kernel": forced, "source": ENV} if forced else {**probe(linears), "source": "probe"}
    if verdict["kernel"] == "packed":
        for lin in linears:
            lin.plain = None
    logger.info("one-row linears: %s", verdict)
    return verdict

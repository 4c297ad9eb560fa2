"""Up to how many rows a float32 draft's linears stay in float32, measured at load.

A small draft runs in float32 under a bf16 target on CPU, each of its linears a ``MixedLinear``: calls of up to
``fp32_max_rows`` rows run ``F.linear`` in float32, larger ones cast to bf16 and run the weight's packed bf16 copy.
Where the crossover lies depends on the CPU (docs/benchmarks.md, "Draft dtype"): on a 2-core Xeon with AMX float32
wins small calls (the whole float32 draft measured faster at batch 1), while on a 2-core AMD EPYC (AVX512-BF16, no
AMX) float32 matmuls of 3 rows took 1.6-4.5x the packed bf16 time, casts included, so a batch-1 tree level of 3 rows
ran slower in float32. So the first draft module mixed on a machine times a pass over its own linears at
each row count from 1 to ``FP32_MAX_ROWS``, both ways, and the crossover becomes the largest row count up to which
float32 won every time by FP32_MIN_GAIN; the draft's forwards switch their activations to bf16 above it
(``CpuPolicy.runs_half_precision``).

``SPECSERVE_DRAFT_FP32_MAX_ROWS=N`` (0 = always bf16) skips the probe (``auto``, the default, runs it).
"""

from __future__ import annotations

import logging
import os
import statistics

import torch

from specserve.platform.cpu.one_row_probe import interleaved_times
from specserve.platform.cpu.packing import FP32_MAX_ROWS

logger = logging.getLogger(__name__)

ENV = "SPECSERVE_DRAFT_FP32_MAX_ROWS"
PROBE_REPS = 5

#: float32 keeps a row count only when this much faster: a near tie (the demo head's one-row calls on an EPYC) would
#: otherwise flip from start to start, and bf16 passes half-size activations between the calls.
FP32_MIN_GAIN = 0.05


def forced_rows() -> int | None:
    """SPECSERVE_DRAFT_FP32_MAX_ROWS's crossover, None for auto (the probe decides)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value == "auto":
        return None
    if not value.isdigit():
        raise ValueError(f"{ENV}={value!r}: expected auto or a row count (0 = bf16 from one row)")
    return int(value)


def pick_crossover(fp32: dict[int, list[float]], bf16: dict[int, list[float]], min_gain: float = FP32_MIN_GAIN
                   ) -> int:
    """The largest row count r such that, at every probed row count up to r, the float32 pass's median time is at
    least min_gain below the bf16 pass's; 0 when float32 loses at the smallest. fp32 / bf16: {rows: seconds of each
    pass}."""
    crossover = 0
    for rows in sorted(fp32):
        if statistics.median(fp32[rows]) >= (1.0 - min_gain) * statistics.median(bf16[rows]):
            break
        crossover = rows
    return crossover


def probe(linears: list, max_rows: int = FP32_MAX_ROWS, reps: int = PROBE_REPS) -> dict:
    """Time one pass through ``linears`` (MixedLinears) at each row count 1..max_rows, their float32 path against
    their packed bf16 path (``MixedLinear.fp32`` / ``bf16``, casts included), reps passes each, interleaved after a
    warm-up pass -> {"fp32_max_rows", "fp32_ms", "bf16_ms"} (medians of a pass per row count)."""
    gen = torch.Generator().manual_seed(0)  # not the global generator: the probe leaves seeded runs alone
    widths = {m.in_features for m in linears}
    fp32: dict[int, list[float]] = {}
    bf16: dict[int, list[float]] = {}
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            xs = {n: torch.randn(rows, n, generator=gen) for n in widths}
            passes = {"fp32": lambda xs=xs: [m.fp32(xs[m.in_features]) for m in linears],
                      "bf16": lambda xs=xs: [m.bf16(xs[m.in_features]) for m in linears]}
            times = interleaved_times(passes, reps)
            fp32[rows], bf16[rows] = times["fp32"], times["bf16"]

    def ms(t: dict[int, list[float]]) -> dict[int, float]:
        return {r: round(statistics.median(v) * 1e3, 3) for r, v in t.items()}

    return {"fp32_max_rows": pick_crossover(fp32, bf16), "fp32_ms": ms(fp32), "bf16_ms": ms(bf16)}


def choose_crossover(linears: list) -> dict:
    """The float32 / bf16 crossover for these MixedLinears: SPECSERVE_DRAFT_FP32_MAX_ROWS's, else the probe's.
    -> the verdict (server info)."""
    forced = forced_rows()
    if forced is not None:
        verdict = {"fp32_max_rows": forced, "source": ENV}
    else:
        verdict = {**probe(linears), "source": "probe"}
    logger.info("float32 draft linears: float32 up to %d rows, packed bf16 above (%s)", verdict["fp32_max_rows"],
                verdict["source"])
    return verdict

"""From how many rows a half-precision linear runs on a float32 copy of its weight, measured at load.

Where oneDNN cannot pack half-precision weights (a CPU without AVX512, e.g. an AVX2-only AMD EPYC), PyTorch's bf16
matmul re-reads the weight for every row: a verify tree, a batch's decode step or a prefill costs about as many
weight reads as it has rows, where MKL's float32 sgemm reads a float32 weight once for many rows. Each such linear
becomes an ``UpcastLinear`` (``packing.py``) and this probe times a pass over the model's first linears at
PROBE_ROWS rows, the bf16 weight against the float32 copy (its casts included), interleaved; calls of
``min_rows`` rows or more take the copy, from the fewest probed rows where it won by MIN_GAIN at every larger count
(0: nowhere, and the copies are dropped). One-row calls keep the half-precision weight: half the bytes to read.

Off unless asked for: ``SPECSERVE_CPU_UPCAST=auto`` runs the probe, ``on`` takes the copy from 2 rows without
timing, ``off`` (the default) keeps no copy. A row's result then depends on the size of the call it is in (float32
sums over the copy, or PyTorch's bf16 dot products), so the same greedy request can end differently when a cached
prefix shortens its prefill, and bf16 greedy speculative output can part from plain decoding's at a near-tie.
"""

from __future__ import annotations

import logging
import statistics

import torch

from specserve.platform.cpu import native
from specserve.platform.cpu.one_row_probe import interleaved_times, probed_linears
from specserve.platform.cpu.packing import UPCAST_MIN_ROWS
from specserve.platform.cpu.small_gemm import amx_start

logger = logging.getLogger(__name__)

ENV = "SPECSERVE_CPU_UPCAST"
MODES = ("off", "auto", "on")
PROBE_ROWS = (2, 4, 8, 16)
PROBE_REPS = 5
MIN_GAIN = 0.05  # the copy takes a row count only when this much faster


def mode() -> str:
    """SPECSERVE_CPU_UPCAST's value (off, auto or on); ValueError naming it for anything else."""
    return native.env_mode(ENV, MODES)


def probe(linears: list, reps: int = PROBE_REPS) -> dict:
    """Time one pass through ``linears`` (UpcastLinears) at each of PROBE_ROWS, the half-precision weight against
    the float32 copy, reps passes each, interleaved after a warm-up pass -> {"min_rows", "half_float32_ms"}."""
    gen = torch.Generator().manual_seed(0)  # not the global generator: the probe leaves seeded runs alone
    dtype = linears[0].weight.dtype
    wins, ms = {}, {}
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            xs = {n: torch.randn(rows, n, generator=gen).to(dtype) for n in {m.in_features for m in linears}}
            passes = {"half": lambda xs=xs: [torch.nn.functional.linear(xs[m.in_features], m.weight, m.bias)
                                             for m in linears],
                      "float32": lambda xs=xs: [m.upcast(xs[m.in_features]) for m in linears]}
            times = {k: statistics.median(v) for k, v in interleaved_times(passes, reps).items()}
            wins[rows] = times["float32"] < (1.0 - MIN_GAIN) * times["half"]
            ms[rows] = (round(times["half"] * 1e3, 3), round(times["float32"] * 1e3, 3))
    return {"min_rows": amx_start(wins), "half_float32_ms": ms}


def choose_upcast_rows(linears: list) -> dict:
    """Sets each UpcastLinear's ``min_rows`` (SPECSERVE_CPU_UPCAST=on: UPCAST_MIN_ROWS; auto: the probe's, timed on
    the model's first linears) and drops the float32 copies where the copy won nowhere -> the verdict (server
    info)."""
    if mode() == "on":
        verdict = {"min_rows": UPCAST_MIN_ROWS, "source": ENV}
    else:
        verdict = {**probe(probed_linears(linears, weight=lambda lin: lin.wide)), "source": "probe"}
    for lin in linears:
        lin.min_rows = verdict["min_rows"]
        if lin.min_rows == 0:
            lin.wide = lin.wide_bias = None
    logger.info("half-precision linears on a float32 copy: %s", verdict)
    return verdict

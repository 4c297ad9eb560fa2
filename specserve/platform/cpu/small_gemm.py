"""A bf16 matmul for a few rows on CPUs with AVX512-BF16: specserve's own kernel (``small_gemm.cpp``).

On such a CPU without AMX (a 2-core AMD EPYC), oneDNN's packed bf16 kernel costs about 16-20 us a call whatever the
size and streams a weight at 12-19 GB/s; a verify tree of 8 rows through SmolLM2-135M's linears took 13.3 ms packed
against 7-10 ms for one row through PyTorch's gemv, so every verified node cost a speculative step dearly. This kernel
reads each weight once for up to 6 rows and re-reads it from the core's L2 for more, in passes of as even sizes as
can be: over SmolLM2's linears on that machine it took 9.2 ms for 1 row, 8.8 for 4, 10.3 for 8 and 15.2 for 16 when
its passes held 4 rows (docs/benchmarks.md, "Weight packing"); passes of 6 took a 9-row verify tree's pass 0.82x
the time of 4-row passes (docs/benchmarks.md, "specserve's few-row kernel").

It is built once per machine (``native``) and called through ctypes (an opaque custom op inside compiled graphs).
Where the CPU lacks AVX512-BF16, no compiler is found or the build fails, nothing changes: the other kernels run.

``SPECSERVE_SMALL_GEMM=auto`` (default) times the kernel against the one each row count would use otherwise, on the
model's own linears at load (``choose_small_rows``); ``on`` uses it up to SMALL_MAX_ROWS rows without timing; ``off``
never builds it.

On a CPU with AMX the kernel has a second path, the tile unit, for which one tile instruction multiplies 16 rows at
once: a SmolLM2 pass of 16 rows then costs about what one row does, against 2.4x on the vector loop (2-core Xeon,
docs/benchmarks.md). The vector loop stays a little faster for one row. ``SPECSERVE_SMALL_GEMM_AMX=auto`` (default)
times both paths in the probe and sends calls of ``amx_from`` rows or more to the tile unit, from the fewest probed
rows where it won at every larger count; ``all`` sends every call there (a row then has the same bits in any call: a
verify tree's row rounds as a one-row decode's, which the two paths, whose float32 sums round differently in a few
outputs in 10,000, do not guarantee); ``off`` never uses it.

The vector loop asks the core for its weights 4096 bytes ahead of the step it reads (software prefetch), which paid
on a Xeon whose memory a neighbour loaded; on a 2-core AMD EPYC the hardware prefetchers alone stream faster. So
``SPECSERVE_SMALL_GEMM_PREFETCH=auto`` (default) times one-row passes both ways over a model's weights where they
stream from memory (``choose_prefetch``) and turns it off where it loses; ``on`` / ``off`` set it without timing.
"""

from __future__ import annotations

import ctypes
import logging
import statistics

import torch
from torch import nn

from specserve.platform.cpu import native
from specserve.platform.cpu.ops import cpu_op

logger = logging.getLogger(__name__)

ENV = "SPECSERVE_SMALL_GEMM"
MODES = ("auto", "on", "off")
AMX_ENV = "SPECSERVE_SMALL_GEMM_AMX"
AMX_MODES = ("auto", "all", "off")
COLS = 64  # output columns per packed group (the kernel's COLS)
SMALL_MAX_ROWS = 16  # the most rows a call may have on the vector loop (passes of up to 6 rows)
AMX_MAX_ROWS = 64  # on the tile unit (blocks of 16), where the probe finds it ahead of oneDNN's kernel up to there
PROBE_ROWS = (1, 4, 8, 16)  # the row counts the probe times
AMX_PROBE_ROWS = (32, 64)  # and where the tile unit may run, these (on it only)
PROBE_REPS = 5
MIN_GAIN = 0.05  # the kernel takes a row count only when this much faster than the other kernel
# (and the tile unit only when this much faster than the vector loop)
# ...but one row where the model's decoder layers run as one operator call each (``fused_layer.py``) unless the kernel
# is this much slower: a layer whose linears do not all take a call runs its modules, about twenty operator calls from
# Python, which cost a demo decode step 2.3x its time on a 2-core AMD EPYC (SmolLM2's about a quarter), far more than
# the few percent the kernels differ by at one row
FUSED_ONE_ROW_SLACK = 0.25
AMX_UNTIMED_FROM = 5  # amx_from where nothing is timed (SPECSERVE_SMALL_GEMM=on): the 2-core Xeon's crossover
PREFETCH_ENV = "SPECSERVE_SMALL_GEMM_PREFETCH"
PREFETCH_MODES = ("auto", "on", "off")
PREFETCH_BYTES = 4096  # how far ahead the vector loop asks for its weights where prefetch is on (the kernel's default)
PREFETCH_PROBE_MIN_BYTES = 64 * 2**20  # the probe times prefetch over a model's weights only if they stream from
# memory: at least this many bytes of them (the demo's 20 MiB sit in a server CPU's L3, where it changes little)
PREFETCH_MIN_GAIN = 0.03  # prefetch goes off only when a one-row pass is this much faster without it
PREFETCH_PROBE_REPS = 15  # rounds of the two passes (a few ms each on a model worth timing)
_prefetch_probed: list[dict] = []  # the probe's verdict once it ran: it stands for the process (one distance for all)
# x, m, k, ldx, packed, n, bias, y, ldy, threads, amx_from
ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64)


def mode() -> str:
    """SPECSERVE_SMALL_GEMM's value (auto, on or off); ValueError naming it for anything else."""
    return native.env_mode(ENV, MODES)


def available() -> bool:
    """The kernel is wanted (SPECSERVE_SMALL_GEMM is not off) and runs here (its operator's C++ implementation
    loaded too, where it can be: ``native.native_ops``)."""
    return native.kernel_ready(ENV, MODES, kernel)


def kernel():
    """The compiled kernel as a ctypes function (built on the first call), or None where it cannot run here."""
    return native.function("small_gemm.cpp", "small_gemm_bf16", ARGTYPES)


def amx_mode() -> str:
    """SPECSERVE_SMALL_GEMM_AMX's value (auto, all or off); ValueError naming it for anything else."""
    return native.env_mode(AMX_ENV, AMX_MODES)


def amx_runs() -> bool:
    """The kernel's tile-unit path runs here (the CPU has AMX-TILE and AMX-BF16 and Linux granted the process its
    tile state), whatever SPECSERVE_SMALL_GEMM_AMX says."""
    if kernel() is None:
        return False
    ready = native.function("small_gemm.cpp", "small_gemm_amx_ready", (ctypes.c_void_p,))
    out = ctypes.c_int(0)
    ready(ctypes.byref(out))
    return out.value == 1


def prefetch_mode() -> str:
    """SPECSERVE_SMALL_GEMM_PREFETCH's value (auto, on or off); ValueError naming it for anything else."""
    return native.env_mode(PREFETCH_ENV, PREFETCH_MODES)


def _prefetch_setters() -> list:
    """small_gemm_set_prefetch in each loaded copy of the kernel: the ctypes library and the operators' (which
    links its own copy of small_gemm.cpp)."""
    argtypes = (ctypes.c_int64,)
    found = [native.function("small_gemm.cpp", "small_gemm_set_prefetch", argtypes),
             native.ops_function("small_gemm_set_prefetch", argtypes)]
    return [fn for fn in found if fn is not None]


def set_prefetch(nbytes: int) -> None:
    """How far ahead (bytes; 0: not at all) the vector loop asks the core for the weights it is about to read, in
    every later call of the kernel in this process (the results' bits do not depend on it)."""
    for fn in _prefetch_setters():
        fn(nbytes)


def prefetch_distance() -> int:
    """The vector loop's prefetch distance in bytes now (``set_prefetch``; 0: none)."""
    fn = native.function("small_gemm.cpp", "small_gemm_prefetch", (), restype=ctypes.c_int64)
    return int(fn()) if fn is not None else 0


def prefetch_loses(on_seconds: list[float], off_seconds: list[float], min_gain: float = PREFETCH_MIN_GAIN) -> bool:
    """From interleaved timings of the same pass with prefetch on and off (round by round): whether it loses, the
    median of the rounds' off / on ratios at least min_gain below 1."""
    return statistics.median(off / on for on, off in zip(on_seconds, off_seconds, strict=True)) < 1.0 - min_gain


def choose_prefetch(linears: list) -> dict | None:
    """Software prefetch in the vector loop, for linears holding the kernel's layout (``small``): on or off as
    SPECSERVE_SMALL_GEMM_PREFETCH says; for auto (unless SPECSERVE_SMALL_GEMM=on, which times nothing), one-row
    passes over them (``one_row_probe.probed_linears``; after the weights moved onto huge pages, as they run) timed
    with it and without, interleaved, where they hold PREFETCH_PROBE_MIN_BYTES at least (weights that stream from
    memory, where it matters): off where it loses (``prefetch_loses``), else on. The distance is the process's
    (``set_prefetch``), so the first probe's verdict stands for every later model (a second engine in the process
    neither re-times it nor changes it under the first) -> the verdict (server info), None where nothing was timed or
    set."""
    from specserve.platform.cpu.one_row_probe import interleaved_times, probed_linears

    forced = prefetch_mode()
    if forced != "auto":
        set_prefetch(PREFETCH_BYTES if forced == "on" else 0)
        return {"bytes": prefetch_distance(), "source": PREFETCH_ENV}
    if mode() == "on":
        return None
    if _prefetch_probed:
        set_prefetch(_prefetch_probed[0]["bytes"])
        return _prefetch_probed[0]
    chosen = probed_linears(linears, weight=lambda lin: lin.small.packed)
    if sum(lin.small.packed.numel() * lin.small.packed.element_size() for lin in chosen) < PREFETCH_PROBE_MIN_BYTES:
        return None
    gen = torch.Generator().manual_seed(0)
    x = {n: torch.randn(1, n, generator=gen).to(torch.bfloat16) for n in {m.in_features for m in chosen}}

    def one_pass(nbytes: int):
        set_prefetch(nbytes)
        return [small_mm(x[m.in_features], m.small.packed, m.small.bias) for m in chosen]

    with torch.inference_mode():
        times = interleaved_times({"on": lambda: one_pass(PREFETCH_BYTES), "off": lambda: one_pass(0)},
                                  PREFETCH_PROBE_REPS)
    set_prefetch(0 if prefetch_loses(times["on"], times["off"]) else PREFETCH_BYTES)
    verdict = {"bytes": prefetch_distance(), "source": "probe",
               "on_off_ms": (round(statistics.median(times["on"]) * 1e3, 3),
                             round(statistics.median(times["off"]) * 1e3, 3))}
    _prefetch_probed.append(verdict)
    logger.info("small-gemm prefetch: %s", verdict)
    return verdict


def fits(weight: torch.Tensor) -> bool:
    """The kernel's shape rules: a CPU weight [N, K] with N a multiple of COLS and K even."""
    n, k = weight.shape
    return weight.device.type == "cpu" and n % COLS == 0 and k % 2 == 0


def packable(weight: torch.Tensor) -> bool:
    """A bf16 weight the kernel takes as it is (``fits``)."""
    return weight.dtype == torch.bfloat16 and fits(weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's layout [N / 64, K / 2, 64, 2]: per group of 64 output columns, K / 2 steps of their
    (k, k + 1) weight pairs."""
    n, k = weight.shape
    return weight.detach().view(n // COLS, COLS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def small_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, amx_from: int = 0) -> torch.Tensor:
    """x [M, K] bf16 (M <= SMALL_MAX_ROWS, or AMX_MAX_ROWS on the tile unit) @ a packed weight (+ a float32 bias
    [N]) -> [M, N] bf16: through the operator where its C++ implementation is loaded, else in Python. Calls of
    amx_from rows or more run on the tile unit where it runs (0: never)."""
    if native.native_ops():
        return small_gemm(x, packed, bias, amx_from)
    return _small_mm(x, packed, bias, amx_from)


def _small_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, amx_from: int = 0) -> torch.Tensor:
    """small_mm in Python, through ctypes (the operator's implementation without ``ops.cpp``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0] * COLS
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    kernel()(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
             y.data_ptr(), n, torch.get_num_threads(), amx_from)
    return y


# small_mm as an op that compiled graphs call as is
small_gemm = cpu_op("small_gemm(Tensor x, Tensor packed, Tensor? bias, int amx_from) -> Tensor", _small_mm,
                    lambda x, packed, bias, amx_from: x.new_empty(x.shape[0], packed.shape[0] * COLS))


class SmallCopy(nn.Module):
    """A linear's weight in the kernel's layout (``packed``, cast to bf16), its bias in float32, and the row counts
    whose calls take the kernel (``min_rows`` to ``max_rows``: none until ``choose_small_rows`` sets them) and the
    fewest of those that take its tile-unit path (``amx_from``, 0: none). A module, so that the weights move onto huge
    pages with the rest (``hugepages.module_tensors``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = pack(weight.detach().to(torch.bfloat16))  # [out / 64, in / 2, 64, 2]
        self.bias = None if bias is None else bias.detach().float()  # [out]
        self.min_rows, self.max_rows = 1, 0
        self.amx_from = 0

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and self.min_rows <= x.shape[0] <= self.max_rows

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] bf16 -> [T, out] bf16; inside a compiled graph, through the custom op."""
        if torch.compiler.is_compiling():
            return small_gemm(x, self.packed, self.bias, self.amx_from)
        return small_mm(x, self.packed, self.bias, self.amx_from)


def kernel_wins(rows: int, kernel_s: float, other_s: float, whole_layers: bool = False) -> bool:
    """The probe's verdict at one row count: the kernel takes it when MIN_GAIN faster than the other kernel; at one
    row where whole_layers (the model's decoder layers run as one operator call, which needs every linear to take
    the call), unless FUSED_ONE_ROW_SLACK slower."""
    if rows == 1 and whole_layers:
        return kernel_s <= (1.0 + FUSED_ONE_ROW_SLACK) * other_s
    return kernel_s < (1.0 - MIN_GAIN) * other_s


def winning_rows(wins: dict[int, bool]) -> tuple[int, int]:
    """{probed rows: the kernel won there} -> (min_rows, max_rows), the calls that take the kernel: from 1 row where it
    won at one row, else from 2 (one-row calls keep their own kernel), up to the most rows it won at every probed count
    from there; (0, 0) where it won nowhere from the start."""
    counts = sorted(wins)
    lo = 1 if wins[counts[0]] else 2
    best = 0
    for rows in counts:
        if rows < lo:
            continue
        if not wins[rows]:
            break
        best = rows
    return (lo, best) if best else (0, 0)


def amx_start(wins: dict[int, bool]) -> int:
    """{probed rows: the tile unit beat the vector loop there} -> amx_from, the fewest rows whose calls take it: the
    smallest probed count from which it won at every larger one; 0 where it lost at the largest."""
    start = 0
    for rows in sorted(wins, reverse=True):
        if not wins[rows]:
            break
        start = rows
    return start


def _amx_fixed() -> int | None:
    """amx_from without timing: 0 where the tile unit does not run or SPECSERVE_SMALL_GEMM_AMX is off, 1 for all;
    None for auto (the probe times it)."""
    if amx_mode() == "off" or not amx_runs():
        return 0
    return 1 if amx_mode() == "all" else None


def choose_small_rows(linears: list, whole_layers: bool = False) -> dict:
    """For PackedLinears or MixedLinears holding the kernel's layout (``small``): up to how many rows a call takes the
    kernel, and from how many its tile-unit path (whole_layers: the model's decoder layers will run as one operator call
    each where their linears take a call, see ``kernel_wins``). ``on``: 1 to SMALL_MAX_ROWS, the tile unit from
    AMX_UNTIMED_FROM rows (auto) without timing; ``auto``: timed at PROBE_ROWS on the model's first linears
    (``one_row_probe.probed_linears``): the tile unit against the vector loop (``amx_start``), then the kernel so chosen
    against the kernel each count uses otherwise (gemv or packed for one row, packed above), and where the tile unit
    took calls, at AMX_PROBE_ROWS too (the tile unit against the packed kernel); the rows from ``winning_rows``. Sets
    each linear's ``small.min_rows`` / ``max_rows`` / ``amx_from``, drops the layout where the kernel won nowhere, and
    the plain copies where it won at one row (gemv is then not used) -> the verdict (server info)."""
    from specserve.platform.cpu.one_row_probe import interleaved_times, probed_linears
    from specserve.platform.cpu.packing import cpu_gemv

    amx_from = _amx_fixed()
    if mode() == "on":
        amx_from = AMX_UNTIMED_FROM if amx_from is None else amx_from
        verdict = {"min_rows": 1, "max_rows": SMALL_MAX_ROWS, "amx_from": amx_from, "source": ENV}
    else:
        chosen = probed_linears(linears, weight=lambda lin: lin.small.packed)
        gen = torch.Generator().manual_seed(0)
        times_at, amx_wins = {}, {}
        for rows in PROBE_ROWS + (AMX_PROBE_ROWS if amx_from != 0 else ()):
            x = {n: torch.randn(rows, n, generator=gen).to(torch.bfloat16) for n in {m.in_features for m in chosen}}

            def other(rows=rows, x=x):
                return [cpu_gemv(x[m.in_features], m.plain, m.bias) if rows == 1 and getattr(m, "plain", None)
                        is not None else m.packed_call(x[m.in_features]) for m in chosen]

            def small(x=x, amx=0):
                return [small_mm(x[m.in_features], m.small.packed, m.small.bias, amx) for m in chosen]

            passes = {"other": other}
            if rows <= SMALL_MAX_ROWS:
                passes["small"] = small
            if amx_from != 0:
                passes["tile"] = lambda x=x: small(x, 1)
            with torch.inference_mode():
                times = interleaved_times(passes, PROBE_REPS)
            times_at[rows] = {k: statistics.median(v) for k, v in times.items()}
            if amx_from is None and rows <= SMALL_MAX_ROWS:
                amx_wins[rows] = times_at[rows]["tile"] < (1.0 - MIN_GAIN) * times_at[rows]["small"]
        if amx_from is None:
            amx_from = amx_start(amx_wins)
        wins, ms = {}, {}
        for rows, med in times_at.items():
            on_tile = amx_from > 0 and rows >= amx_from
            if rows > SMALL_MAX_ROWS and not on_tile:
                continue
            kernel_s = med["tile"] if on_tile else med["small"]
            wins[rows] = kernel_wins(rows, kernel_s, med["other"], whole_layers)
            ms[rows] = (round(kernel_s * 1e3, 3), round(med["other"] * 1e3, 3))
        lo, hi = winning_rows(wins)
        verdict = {"min_rows": lo, "max_rows": hi, "amx_from": amx_from, "source": "probe", "small_other_ms": ms,
                   "whole_layers": whole_layers}
        if amx_wins:
            verdict["vector_tile_ms"] = {rows: (round(med["small"] * 1e3, 3), round(med["tile"] * 1e3, 3))
                                         for rows, med in times_at.items() if rows in amx_wins}
    for lin in linears:
        lin.small.min_rows, lin.small.max_rows = verdict["min_rows"], verdict["max_rows"]
        lin.small.amx_from = verdict["amx_from"]
        if verdict["max_rows"] == 0:
            lin.small = None
        elif verdict["min_rows"] == 1 and hasattr(lin, "plain"):  # a PackedLinear's one-row calls take the kernel
            lin.plain = None
    logger.info("small-gemm kernel: %s", verdict)
    return verdict

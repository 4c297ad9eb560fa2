"""A bf16 matmul for a few rows on CPUs with AVX512-BF16: specserve's own kernel (``small_gemm.cpp``).

On such a CPU without AMX (a 2-core AMD EPYC), oneDNN's packed bf16 kernel costs about 16-20 us a call whatever the
size and streams a weight at 12-19 GB/s; a verify tree of 8 rows through SmolLM2-135M's linears took 13.3 ms packed
against 7-10 ms for one row through PyTorch's gemv, so every verified node cost a speculative step dearly. This kernel
reads each weight once for up to 4 rows and re-reads it from the core's L2 for more: over SmolLM2's linears on that
machine it took 9.2 ms for 1 row, 8.8 for 4, 10.3 for 8 and 15.2 for 16 (docs/benchmarks.md, "Weight packing").

It is built once per machine (``native``) and called through ctypes (an opaque custom op inside compiled graphs).
Where the CPU lacks AVX512-BF16, no compiler is found or the build fails, nothing changes: the other kernels run.

``SPECSERVE_SMALL_GEMM=auto`` (default) times the kernel against the one each row count would use otherwise, on the
model's own linears at load (``choose_small_rows``); ``on`` uses it up to SMALL_MAX_ROWS rows without timing; ``off``
never builds it.
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
COLS = 64  # output columns per packed group (the kernel's COLS)
SMALL_MAX_ROWS = 16  # the most rows a call may have (4 row tiles)
PROBE_ROWS = (1, 4, 8, 16)  # the row counts the probe times
PROBE_REPS = 5
MIN_GAIN = 0.05  # the kernel takes a row count only when this much faster than the other kernel
ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)


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


def small_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 (M <= SMALL_MAX_ROWS) @ a packed weight (+ a float32 bias [N]) -> [M, N] bf16: through the
    operator where its C++ implementation is loaded, else in Python."""
    if native.native_ops():
        return small_gemm(x, packed, bias)
    return _small_mm(x, packed, bias)


def _small_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """small_mm in Python, through ctypes (the operator's implementation without ``ops.cpp``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0] * COLS
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    kernel()(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
             y.data_ptr(), n, torch.get_num_threads())
    return y


# small_mm as an op that compiled graphs call as is
small_gemm = cpu_op("small_gemm(Tensor x, Tensor packed, Tensor? bias) -> Tensor", _small_mm,
                    lambda x, packed, bias: x.new_empty(x.shape[0], packed.shape[0] * COLS))


class SmallCopy(nn.Module):
    """A linear's weight in the kernel's layout (``packed``, cast to bf16), its bias in float32, and the row counts
    whose calls take the kernel (``min_rows`` to ``max_rows``: none until ``choose_small_rows`` sets them). A module,
    so that the weights move onto huge pages with the rest (``hugepages.module_tensors``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = pack(weight.detach().to(torch.bfloat16))  # [out / 64, in / 2, 64, 2]
        self.bias = None if bias is None else bias.detach().float()  # [out]
        self.min_rows, self.max_rows = 1, 0

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and self.min_rows <= x.shape[0] <= self.max_rows

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] bf16 -> [T, out] bf16; inside a compiled graph, through the custom op."""
        if torch.compiler.is_compiling():
            return small_gemm(x, self.packed, self.bias)
        return small_mm(x, self.packed, self.bias)


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


def choose_small_rows(linears: list) -> dict:
    """For PackedLinears or MixedLinears holding the kernel's layout (``small``): up to how many rows a call takes the
    kernel. ``on``:
    1 to SMALL_MAX_ROWS; ``auto``: timed at PROBE_ROWS on the model's first linears (``one_row_probe.probed_linears``)
    against the kernel each count uses otherwise (gemv or packed for one row, packed above), the rows then from
    ``winning_rows``. Sets each linear's ``small.min_rows`` / ``small.max_rows``, drops the layout where the kernel
    won nowhere, and the plain copies where it won at one row (gemv is then not used) -> the verdict (server info)."""
    from specserve.platform.cpu.one_row_probe import interleaved_times, probed_linears
    from specserve.platform.cpu.packing import cpu_gemv

    if mode() == "on":
        verdict = {"min_rows": 1, "max_rows": SMALL_MAX_ROWS, "source": ENV}
    else:
        chosen = probed_linears(linears, weight=lambda lin: lin.small.packed)
        gen = torch.Generator().manual_seed(0)
        wins, ms = {}, {}
        for rows in PROBE_ROWS:
            x = {n: torch.randn(rows, n, generator=gen).to(torch.bfloat16) for n in {m.in_features for m in chosen}}

            def other(rows=rows, x=x):
                return [cpu_gemv(x[m.in_features], m.plain, m.bias) if rows == 1 and getattr(m, "plain", None)
                        is not None else m.packed_call(x[m.in_features]) for m in chosen]

            passes = {"small": lambda x=x: [m.small.run(x[m.in_features]) for m in chosen], "other": other}
            with torch.inference_mode():
                times = interleaved_times(passes, PROBE_REPS)
            med = {k: statistics.median(v) for k, v in times.items()}
            wins[rows] = med["small"] < (1.0 - MIN_GAIN) * med["other"]
            ms[rows] = (round(med["small"] * 1e3, 3), round(med["other"] * 1e3, 3))
        lo, hi = winning_rows(wins)
        verdict = {"min_rows": lo, "max_rows": hi, "source": "probe", "small_other_ms": ms}
    for lin in linears:
        lin.small.min_rows, lin.small.max_rows = verdict["min_rows"], verdict["max_rows"]
        if verdict["max_rows"] == 0:
            lin.small = None
        elif verdict["min_rows"] == 1 and hasattr(lin, "plain"):  # a PackedLinear's one-row calls take the kernel
            lin.plain = None
    logger.info("small-gemm kernel: %s", verdict)
    return verdict

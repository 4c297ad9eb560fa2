"""Weight-only int8 matmuls for a few bf16 rows: specserve's own kernels, for CPUs with AVX512-BF16 (``int8_gemm.cpp``)
and for those with AVX2 and FMA (``avx2_gemm.cpp``).

``--torchao-config int8wo`` keeps each linear's weight as int8 with one scale per output column
(``models/quantize.py``). PyTorch's kernel for it (``torch._weight_int8pack_mm``) takes up to QUANT_MAX_ROWS rows,
larger calls running on a dense bf16 copy. This one widens the int8 weights in registers and streams them once for up
to 6 rows (4 on AVX2; more rows in passes of as even sizes as can be), and takes up to SMALL_MAX_ROWS rows, so verify
trees and batches of a few requests run on the int8 weights too. On a 2-core AMD EPYC a pass over SmolLM2-135M's
linears took 6.0 ms at one row against 7.0 ms on PyTorch's kernel (``benchmarks/bench_int8.py``, medians).

On a CPU with AMX the AVX512-BF16 kernel has a second path, the tile unit: each 16 steps of a column group's weights
are widened once into two bf16 weight tiles, which one tile instruction multiplies by up to 16 rows, so 2 to 64 rows
cost about what one row does on the vector loop (which widens the weights once per pass of up to 6 rows), and calls
of up to AMX_MAX_ROWS rows take the kernel. ``SPECSERVE_INT8_GEMM_AMX=auto`` (default) sends calls of AMX_AUTO_FROM
rows or more there (a lone row stays faster on the vector loop), ``all`` every call (a row then has the same bits in
any call: the two paths' float32 sums differ in the last bit of a few outputs), ``off`` none.

Built once per machine (``native``) and called through ctypes (inside compiled graphs: an operator, ``ops.py``).
``SPECSERVE_INT8_GEMM=on`` (default) or ``off`` (PyTorch's kernel for up to ``QUANT_MAX_ROWS`` rows, the dense copy
above).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from specserve.models.quantize import QuantLinear
from specserve.platform.cpu import native
from specserve.platform.cpu.ops import cpu_op

ENV = "SPECSERVE_INT8_GEMM"
MODES = ("on", "off")
COLS = 32  # output columns per packed group (the kernel's COLS)
SMALL_MAX_ROWS = 16  # the most rows a call takes the kernel with
AMX_ENV = "SPECSERVE_INT8_GEMM_AMX"
AMX_MODES = ("auto", "all", "off")
AMX_AUTO_FROM = 2  # the fewest rows that take the tile unit under auto: one row is faster on the vector loop
AMX_MAX_ROWS = 64  # the most rows a call takes the kernel with where the tile unit takes them
# x, m, k, ldx, q, n, scale, bias, y, ldy, threads (the AVX2 kernel's arguments; the AVX512-BF16 one adds amx_from)
ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
AMX_ARGTYPES = (*ARGTYPES, ctypes.c_int64)


def available() -> bool:
    """The kernel is wanted (SPECSERVE_INT8_GEMM is not off) and runs here (its operator's C++ implementation
    loaded too, where it can be: ``native.native_ops``)."""
    return native.kernel_ready(ENV, MODES, kernel)


def kernel():
    """The compiled kernel as a ctypes function (built on the first call): the AVX512-BF16 one, else the AVX2 one
    (``avx2_kernel``); None where neither can run here."""
    return native.function("int8_gemm.cpp", "int8_gemm_bf16", AMX_ARGTYPES) or avx2_kernel()


def avx2_kernel():
    """``avx2_gemm.cpp``'s int8 kernel for CPUs with AVX2 and FMA (the same arguments; it returns 0, or -1 where it had
    no memory for its float32 copy of x), or None where it cannot run here."""
    return native.function("avx2_gemm.cpp", "avx2_int8_gemm_bf16", ARGTYPES, isa="avx2", restype=ctypes.c_int)


def amx_runs() -> bool:
    """The AVX512-BF16 kernel's tile-unit path runs here (the CPU has AMX-TILE and AMX-BF16 and Linux granted the
    process its tile state), whatever SPECSERVE_INT8_GEMM_AMX says."""
    ready = native.function("int8_gemm.cpp", "int8_gemm_amx_ready", (ctypes.c_void_p,))
    if ready is None:
        return False
    out = ctypes.c_int(0)
    ready(ctypes.byref(out))
    return out.value == 1


def amx_from() -> int:
    """The fewest rows whose calls take the tile unit (0: none): SPECSERVE_INT8_GEMM_AMX (ValueError naming it for
    a value other than auto, all or off) where the tile unit runs here."""
    mode = native.env_mode(AMX_ENV, AMX_MODES)
    if mode == "off" or not amx_runs():
        return 0
    return 1 if mode == "all" else AMX_AUTO_FROM


def fits(q: torch.Tensor) -> bool:
    """The kernel's shape rules: a CPU int8 weight [N, K] with N a multiple of COLS and K even."""
    return (q.device.type == "cpu" and q.dtype == torch.int8 and q.dim() == 2 and q.shape[0] % COLS == 0
            and q.shape[1] % 2 == 0)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout [N / 32, K / 2, 2, 32]: per group of 32 output columns, K / 2 steps of
    their weights at k = 2j, then at k = 2j + 1."""
    n, k = q.shape
    return q.detach().view(n // COLS, COLS, k // 2, 2).permute(0, 2, 3, 1).contiguous()


def int8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            amx_from: int = 0) -> torch.Tensor:
    """x [M, K] bf16 (M <= SMALL_MAX_ROWS, or AMX_MAX_ROWS on the tile unit) @ a packed int8 weight, times float32
    scales [N] (+ a float32 bias [N]) -> [M, N] bf16: through the operator where its C++ implementation is loaded,
    else in Python. Calls of amx_from rows or more run on the tile unit where it runs (0: never)."""
    if native.native_ops():
        return int8_gemm(x, packed, scales, bias, amx_from)
    return _int8_mm(x, packed, scales, bias, amx_from)


def _int8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
             amx_from: int = 0) -> torch.Tensor:
    """int8_mm in Python, through ctypes (the operator's implementation without ``ops.cpp``)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0] * COLS
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    fn = kernel()
    tile = (amx_from,) if len(fn.argtypes) == len(AMX_ARGTYPES) else ()  # the AVX2 kernel has no tile-unit path
    status = fn(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, scales.data_ptr(),
                None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(), *tile)
    if status:  # the AVX2 kernel's -1 (the AVX512 one returns nothing: None)
        raise MemoryError(f"int8_gemm: no memory for a float32 copy of a {m}x{k} input")
    return y


# int8_mm as an op that compiled graphs call as is
int8_gemm = cpu_op("int8_gemm(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int amx_from=0) -> Tensor",
                   _int8_mm,
                   lambda x, packed, scales, bias, amx_from=0: x.new_empty(x.shape[0], packed.shape[0] * COLS))


class Int8Copy(nn.Module):
    """A quantized linear's int8 weight in the kernel's layout (``packed``), its scales and bias in float32
    (buffers, which move onto huge pages with the rest: ``hugepages.module_tensors``): the linear's calls of 1 to
    ``max_rows`` bf16 rows (``QuantLinear.use_kernel``), those of ``amx_from`` rows or more on the tile unit."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, amx_from: int = 0) -> None:
        super().__init__()
        self.register_buffer("packed", pack(q), persistent=False)  # [out / 32, in / 2, 2, 32] int8
        self.register_buffer("scales", scales.detach().float().contiguous(), persistent=False)  # [out]
        bias = None if bias is None else bias.detach().float().contiguous()  # [out]
        self.register_buffer("bias", bias, persistent=False)
        self.amx_from = amx_from
        # where the tile unit takes calls from up to 16 rows, it takes the larger ones too (the widened weights of a
        # call serve all its blocks of 16 rows)
        self.max_rows = AMX_MAX_ROWS if 0 < amx_from <= SMALL_MAX_ROWS and q.shape[1] % 32 == 0 else SMALL_MAX_ROWS

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == torch.bfloat16 and 1 <= x.shape[0] <= self.max_rows

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] bf16 -> [T, out] bf16; inside a compiled graph, through its operator. (Called directly, not
        through the module's __call__, which would add 2-3 us to each of a decode step's calls.)"""
        if torch.compiler.is_compiling():
            return int8_gemm(x, self.packed, self.scales, self.bias, self.amx_from)
        return int8_mm(x, self.packed, self.scales, self.bias, self.amx_from)


def use_int8_kernel(module: nn.Module) -> int:
    """Every int8 quantized linear of ``module`` (``models/quantize.QuantLinear``) whose weight the kernel fits hands
    its bf16 calls of up to SMALL_MAX_ROWS rows (AMX_MAX_ROWS on the tile unit) to it -> how many. Only bf16 linears
    (in another dtype the calls keep PyTorch's kernel), and only where the kernel is wanted and runs here (built on
    the first int8 linear)."""
    linears = [m for m in module.modules() if isinstance(m, QuantLinear) and m.cfg.bits == 8 and m.q8 is not None
               and fits(m.q8) and m.dense.weight.dtype == torch.bfloat16]
    if not linears or not available():
        return 0
    tile_from = amx_from()
    for m in linears:
        m.use_kernel(Int8Copy(m.q8, m.scales, m.bias, tile_from))
    return len(linears)

"""bf16 linears on CPUs with AVX2 and FMA but no AVX512: specserve's own kernel (``avx2_gemm.cpp``).

On such a CPU (an AMD EPYC of the Zen 3 generation, say) oneDNN packs no bf16 weight and PyTorch's bf16 matmul reads
the weight once for every row of the call: on a 2-core EPYC a 1536x576 SmolLM2 MLP linear took 187 us for one row,
731 us for 4 and 2247 us for 12, so a verify tree or a batch's decode step cost nearly as many weight reads as it has
rows. The kernel widens the bf16 weights to float32 in registers and multiplies up to 4 rows per read of them (from
memory for the first rows, from the core's caches for more): 86 / 144 / 378 us for the same calls, and about the
speed of a float32 copy of the weight (MKL's sgemm) at 512 rows, without that copy's memory (docs/benchmarks.md,
"CPUs without AVX512").

A row's result does not depend on the call it is in: every output sums its products in the same order whatever the
row count, so a verify tree's row, a one-row decode step's and a prefill's have the same bits.

Each bf16 linear becomes an ``Avx2Linear`` where oneDNN packed none of the model's linears and the kernel builds
(``CpuPolicy.pack_weights``). ``SPECSERVE_CPU_AVX2_GEMM=off`` keeps PyTorch's kernel.
"""

from __future__ import annotations

import ctypes

import torch

from specserve.models.direct_call import DirectCall
from specserve.platform.cpu import native
from specserve.platform.cpu.ops import cpu_op
from specserve.platform.cpu.small_gemm import COLS, pack

ENV = "SPECSERVE_CPU_AVX2_GEMM"
MODES = ("auto", "off")
# x, m, k, ldx, packed, n, bias, y, ldy, threads
ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)


def mode() -> str:
    """SPECSERVE_CPU_AVX2_GEMM's value (auto or off); ValueError naming it for anything else."""
    return native.env_mode(ENV, MODES)


def kernel():
    """The compiled kernel as a ctypes function returning 0 (or -1: no memory for its float32 copy of x), built on the
    first call, or None where it cannot run here (no AVX2 and FMA, no compiler)."""
    return native.function("avx2_gemm.cpp", "avx2_gemm_bf16", ARGTYPES, isa="avx2", restype=ctypes.c_int)


def available() -> bool:
    """The kernel is wanted (SPECSERVE_CPU_AVX2_GEMM is not off) and runs here."""
    return mode() != "off" and kernel() is not None


def _avx2_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 @ a weight in small_gemm's layout (+ a float32 bias [N]) -> [M, N] bf16."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0] * COLS
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    status = kernel()(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"avx2_gemm: no memory for a float32 copy of a {m}x{k} input")
    return y


# _avx2_mm as an op that compiled graphs call as is
avx2_gemm = cpu_op("avx2_gemm(Tensor x, Tensor packed, Tensor? bias) -> Tensor", _avx2_mm,
                   lambda x, packed, bias: x.new_empty(x.shape[0], packed.shape[0] * COLS))


class Avx2Linear(DirectCall):
    """A bf16 Linear whose weight lives in the kernel's layout (``packed``, [out / 64, in / 2, 64, 2]; the plain
    weight is not kept) and whose bias is kept in float32; every call runs on the kernel."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight.detach())  # [out / 64, in / 2, 64, 2] bf16
        self.bias = None if linear.bias is None else linear.bias.detach().float()  # [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], x's dtype (bf16 inside)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        # the operator where its C++ implementation is loaded (``native.native_ops``) or inside a compiled graph
        mm = avx2_gemm if torch.compiler.is_compiling() or native.native_ops() else _avx2_mm
        return mm(rows, self.packed, self.bias).view(*x.shape[:-1], self.out_features).to(x.dtype)

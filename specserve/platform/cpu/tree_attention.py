"""Attention of a few queries per request (decode rows, verify trees, draft levels) on CPUs with AVX512-BF16 or with
AVX2 and FMA: specserve's own kernel (``tree_attention.cpp``, ``tree_attention_avx2.cpp``; the work items they share
in ``tree_attention_items.h``).

The eager SDPA path gathers each request's keys and values from the pool into copies, then runs PyTorch's SDPA,
at a cost that hardly depends on the work at these sizes; it took several times the kernel's time a layer's call
(``benchmarks/bench_attention.py``, docs/benchmarks.md). The kernel reads each key and
value straight from its pool slot, once for a KV head's G query heads, and works in float32 throughout. A row's result
depends only on the keys it may see, taken in column order, so a verify tree's node gets bit for bit what a one-row
decode of the same token gets (``tree_attention.cpp``).

It takes bf16 queries and pools, head dimensions of 32, 64, 128 or 256 and up to MAX_QUERIES queries per request
(longer ones, prefill chunks, stay on SDPA's flash kernel, which is built for them). ``SPECSERVE_CPU_ATTENTION=off``
keeps SDPA everywhere; where the kernel cannot be built (neither instruction set, no compiler) SDPA runs as before.
"""

from __future__ import annotations

import ctypes

import torch

from specserve.platform.cpu import native
from specserve.platform.cpu.ops import cpu_op

ENV = "SPECSERVE_CPU_ATTENTION"
MODES = ("on", "off")
MAX_QUERIES = 16  # the most queries per request a call takes
HEAD_DIMS = (32, 64, 128, 256)  # the head dimensions the kernel is built for
MAX_GROUP = 64  # query heads per KV head
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = (_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
            ctypes.c_float, _PTR, ctypes.c_int)


def mode() -> str:
    """SPECSERVE_CPU_ATTENTION's value (on or off); ValueError naming it for anything else."""
    return native.env_mode(ENV, MODES)


def kernel():
    """The compiled kernel as a ctypes function (built on the first call): the AVX512-BF16 one, else the AVX2 one
    (``avx2_kernel``); None where neither can run here."""
    return native.function("tree_attention.cpp", "tree_attention_bf16", ARGTYPES) or avx2_kernel()


def avx2_kernel():
    """``tree_attention_avx2.cpp``: the same kernel for CPUs with AVX2 and FMA (the same arguments and rules, 8-lane
    arithmetic), or None where it cannot run here."""
    return native.function("tree_attention_avx2.cpp", "avx2_tree_attention_bf16", ARGTYPES, isa="avx2")


def available() -> bool:
    """The kernel is wanted (SPECSERVE_CPU_ATTENTION is not off) and runs here (its operator's C++ implementation
    loaded too, where it can be: ``native.native_ops``)."""
    return native.kernel_ready(ENV, MODES, kernel)


def takes(qb: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """Padded queries qb [B, Qmax, H, D] over pools k_buf / v_buf [S, Hkv, D] fit the kernel's rules: the kernel
    reads both pools with one layout, so they must be contiguous and alike."""
    _, max_q, n_heads, head_dim = qb.shape
    return qb.device.type == "cpu" and qb.dtype == torch.bfloat16 and fits(max_q, n_heads, head_dim, k_buf, v_buf)


def fits(max_q: int, n_heads: int, head_dim: int, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """``takes``' rules but the queries' device and dtype: max_q queries per request of n_heads heads of head_dim
    over bf16 CPU pools k_buf / v_buf [S, Hkv, D]."""
    return (k_buf.device.type == "cpu" and k_buf.dtype == torch.bfloat16 and max_q <= MAX_QUERIES
            and head_dim in HEAD_DIMS and n_heads % k_buf.shape[1] == 0 and n_heads // k_buf.shape[1] <= MAX_GROUP
            and k_buf.shape[2] == head_dim and v_buf.shape == k_buf.shape and v_buf.dtype == k_buf.dtype
            and k_buf.is_contiguous() and v_buf.is_contiguous())


def tree_attention(qb: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_slots: torch.Tensor,
                   mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """qb [B, Qmax, H, D] bf16; k_buf/v_buf [S, Hkv, D] the layer's pool; kv_slots [B, Kmax] int64 the slot of each
    key column; mask [B, 1, Qmax, Kmax] bool (or broadcastable to it: [B, 1, 1, Kmax]), True = may attend, None =
    every column visible -> [B * Qmax, H * D] bf16. Rows that see no key (padding) come out zero. The pools must be
    contiguous and alike (``takes``). Through the operator where its C++ implementation is loaded, else in Python."""
    if native.native_ops():
        return tree_attention_op(qb, k_buf, v_buf, kv_slots, mask, scale)
    return _tree_attention(qb, k_buf, v_buf, kv_slots, mask, scale)


def _tree_attention(qb: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_slots: torch.Tensor,
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """tree_attention in Python, through ctypes (the operator's implementation without ``ops.cpp``)."""
    bsz, max_q, n_heads, head_dim = qb.shape
    if qb.stride(-1) != 1:
        qb = qb.contiguous()
    if kv_slots.dtype != torch.int64 or not kv_slots.is_contiguous():
        kv_slots = kv_slots.to(torch.int64).contiguous()
    out = torch.empty(bsz * max_q, n_heads * head_dim, dtype=torch.bfloat16)
    mask_ptr, stride_b, stride_q = None, 0, 0
    if mask is not None:
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask_ptr = mask.data_ptr()  # bool: one byte each
        stride_b = mask.stride(0) if mask.shape[0] > 1 else 0
        stride_q = mask.stride(2) if mask.shape[2] > 1 else 0
    q_sb, q_sq, q_sh, _ = qb.stride()
    kernel()(qb.data_ptr(), q_sb, q_sq, q_sh, k_buf.data_ptr(), v_buf.data_ptr(), kv_slots.data_ptr(), mask_ptr,
             stride_b, stride_q, bsz, max_q, n_heads, k_buf.shape[1], head_dim, kv_slots.shape[1], scale,
             out.data_ptr(), torch.get_num_threads())
    return out


def _tree_attention_fake(qb, k_buf, v_buf, kv_slots, mask, scale):
    return qb.new_empty(qb.shape[0] * qb.shape[1], qb.shape[2] * qb.shape[3])


# tree_attention as an op that compiled graphs call as is
tree_attention_op = cpu_op("tree_attention(Tensor qb, Tensor k_buf, Tensor v_buf, Tensor kv_slots, Tensor? mask, "
                           "float scale) -> Tensor", _tree_attention, _tree_attention_fake)

"""The C++ implementations of specserve's CPU operators (platform/cpu/ops.cpp, loaded by native.native_ops, built
for AVX512-BF16 or, without it, for AVX2): they take the operators' CPU calls and give the same bits as the Python
implementations (ctypes), which stay the fallback (SPECSERVE_CPU_OPS=python)."""

from __future__ import annotations

import pytest
import torch

from specserve.models.quantize import quantize_int8
from specserve.platform.cpu import avx2_gemm, int8_gemm, native, small_gemm, tree_attention

needs_native = pytest.mark.skipif(not (small_gemm.kernel() is not None and native.native_ops()),
                                  reason="no AVX512-BF16, no C++ compiler or no PyTorch headers here")


@needs_native
def test_the_operators_have_cpu_kernels_of_their_own():
    for name in ("small_gemm", "int8_gemm", "tree_attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specserve::{name}", "CPU")


def gemm_inputs(rows: int):
    """(x [rows, 128] bf16 with a row stride of 160, a bias [128], a 128x128 weight packed in bf16, its int8 scales,
    the int8 weight packed) for comparing the gemms' two implementations."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160, generator=gen).to(torch.bfloat16)[:, 16:144]
    w = torch.randn(128, 128, generator=gen)
    bias = torch.randn(128, generator=gen)
    q, scales = quantize_int8(w)
    return x, bias, small_gemm.pack(w.to(torch.bfloat16)), scales, int8_gemm.pack(q)


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gemms_give_the_python_implementations_bits(rows):
    x, bias, packed, scales, packed8 = gemm_inputs(rows)
    for b in (None, bias):
        for amx in (0, 1):  # the vector loop; the tile unit where it runs
            assert torch.equal(small_gemm.small_gemm(x, packed, b, amx), small_gemm._small_mm(x, packed, b, amx))
            assert torch.equal(small_gemm.small_mm(x, packed, b, amx), small_gemm._small_mm(x, packed, b, amx))
        assert torch.equal(int8_gemm.int8_gemm(x, packed8, scales, b), int8_gemm._int8_mm(x, packed8, scales, b))


needs_avx2_native = pytest.mark.skipif(not (small_gemm.kernel() is None and avx2_gemm.kernel() is not None
                                             and native.native_ops()),
                                       reason="not the AVX2 build: AVX512-BF16 here, or no AVX2, compiler or headers")


@needs_avx2_native
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_avx2_build_takes_its_kernels_calls_with_the_same_bits(rows):
    """On a CPU with AVX2 but no AVX512-BF16 the library registers the AVX2 kernels' operators (avx2_gemm, int8_gemm,
    tree_attention) and leaves small_gemm, whose kernel does not run there, to Python; both gemms give the ctypes
    calls' bits."""
    for name in ("avx2_gemm", "int8_gemm", "tree_attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specserve::{name}", "CPU")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("specserve::small_gemm", "CPU")
    x, bias, packed, scales, packed8 = gemm_inputs(rows)
    for b in (None, bias):
        assert torch.equal(avx2_gemm.avx2_gemm(x, packed, b), avx2_gemm._avx2_mm(x, packed, b))
        assert torch.equal(int8_gemm.int8_gemm(x, packed8, scales, b), int8_gemm._int8_mm(x, packed8, scales, b))


@pytest.mark.skipif(not (tree_attention.kernel() is not None and native.native_ops()),
                    reason="no AVX512-BF16 or AVX2, no C++ compiler or no PyTorch headers here")
def test_tree_attention_gives_the_python_implementations_bits():
    """Two requests of 3 queries over a pool of 12 slots, 4 query heads on 2 KV heads: no mask, a mask per query
    and a mask broadcast over the queries; int32 slots and a strided query tensor, which both convert."""
    gen = torch.Generator().manual_seed(0)
    k_buf, v_buf = (torch.randn(12, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    qb = torch.randn(2, 3, 4, 128, generator=gen).to(torch.bfloat16)[..., ::2]  # [2, 3, 4, 64], strided
    slots = torch.tensor([[0, 3, 5, 7, 8], [1, 2, 4, 6, 11]], dtype=torch.int32)
    full = torch.rand(2, 1, 3, 5, generator=gen) > 0.3
    full[..., 0] = True
    for mask in (None, full, full[:, :, :1]):
        want = tree_attention._tree_attention(qb, k_buf, v_buf, slots, mask, 0.125)
        assert torch.equal(tree_attention.tree_attention_op(qb, k_buf, v_buf, slots, mask, 0.125), want)


def test_python_operators_where_asked(monkeypatch):
    """SPECSERVE_CPU_OPS=python leaves the operators to their Python implementations; a wrong value names the
    variable."""
    monkeypatch.setattr(native, "native_ops", native.native_ops.__wrapped__)  # uncached for this test
    monkeypatch.setenv(native.OPS_ENV, "python")
    assert native.native_ops() is False
    monkeypatch.setenv(native.OPS_ENV, "fast")
    with pytest.raises(ValueError, match=native.OPS_ENV):
        native.native_ops()

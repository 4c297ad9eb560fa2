"""A whole decoder layer of an eager bf16 forward in one operator call (``decoder_layer`` in ``ops.cpp``).

An eager forward of a layer calls about twenty operators from Python (two norms, four linears, RoPE, the K and V
write, attention, SiLU-and-multiply, two adds, and the views and splits between them), each a few microseconds of
Python and dispatch before its kernel runs. On SmolLM2-135M (30 layers) that was a quarter of a bf16 decode step on
a 2-core AVX2 EPYC, beside 12 ms of matrix products (docs/benchmarks.md, "A decoder layer in one call"). The operator
runs the same kernels in the same order from C++, so its output has the bits of the modules' own path: a row's
result still does not depend on the call it is in.

A layer takes it (``use_fused_layers``) where every piece has a kernel here: a ``DecoderLayer`` or an EAGLE-3 head's
layer (whose attention reads its normed embeddings beside its normed hidden) of exactly the base classes (RMSNorm,
attention without q/k norms, a SiLU gated MLP), no tensor parallelism, and linears on specserve's bf16 few-row
kernel (on AVX2 ``avx2_gemm.py``; on AVX512-BF16 ``small_gemm.py``, the copy its probe kept) or its int8 one
(``int8_gemm.py``). A forward takes it (``FusedLayer.__call__``) when its attention runs on the few-query kernel
(``tree_attention.py``) and its row count is one the layer's linears give their kernel (on AVX512-BF16, the probe's
``min_rows`` to ``max_rows``; larger calls run on oneDNN, which the operator does not call): decode rows, verify
trees and draft levels with as many new tokens for every request, over a bf16 pool; prefill chunks, padded trees and
mixed batches keep the modules. ``SPECSERVE_CPU_FUSED_LAYER=off`` keeps the modules everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.batch import ForwardBatch
from specserve.attention.sdpa import AttnMetadata
from specserve.models.layers import Attention, GatedMLP, RMSNorm
from specserve.models.quantize import QuantLinear
from specserve.platform.cpu import elementwise, native, tree_attention
from specserve.platform.cpu.avx2_gemm import Avx2Linear, avx2_gemm
from specserve.platform.cpu.int8_gemm import Int8Copy, int8_gemm
from specserve.platform.cpu.ops import cpu_op, registered
from specserve.platform.cpu.packing import PackedLinear
from specserve.platform.cpu.small_gemm import available as small_gemm_available
from specserve.platform.cpu.small_gemm import small_gemm

ENV = "SPECSERVE_CPU_FUSED_LAYER"
MODES = ("on", "off")


def decoder_layer_reference(x, linears, norm1, norm2, eps, cos, sin, k_buf, v_buf, out_slots, kv_slots, mask, heads,
                            scale, embeds=None, embed_norm=None, amx_from=0):
    """The operator's steps as calls of the single operators (what the C++ implementation runs)."""

    def linear(rows: torch.Tensor, i: int) -> torch.Tensor:
        return kernel_linear(rows, *linears[3 * i : 3 * i + 3], amx_from)

    tokens, kv_heads, dim = x.shape[0], k_buf.shape[1], k_buf.shape[2]
    a = elementwise.rms_norm(x, norm1, eps)
    if embeds is not None:  # an EAGLE-3 head's layer: q/k/v read [norm(embeds) | norm(hidden)]
        a = torch.cat([elementwise.rms_norm(embeds, embed_norm, eps), a], dim=-1)
    qkv = linear(a, 0)  # [T, (H + 2 Hkv) D]
    qk = elementwise.rope(qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim), cos, sin)
    elementwise.kv_store(k_buf, v_buf, out_slots, qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(
        tokens, kv_heads, dim))
    q = qk[:, :heads].view(kv_slots.shape[0], -1, heads, dim)  # [B, Qmax, H, D]
    h = x + linear(tree_attention.tree_attention_op(q, k_buf, v_buf, kv_slots, mask, scale), 1)
    return h + linear(elementwise.silu_mul(linear(elementwise.rms_norm(h, norm2, eps), 2)), 3)


def kernel_linear(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None,
                  amx_from: int = 0) -> torch.Tensor:
    """rows [M, K] bf16 through a linear's kernel copy (``_kernel_copy``'s entries) -> [M, N] bf16: the int8 kernel
    with scales, else this build's bf16 few-row kernel."""
    if scales is not None:
        return int8_gemm(rows, packed, scales, bias, amx_from)
    return avx2_gemm(rows, packed, bias) if registered("avx2_gemm") else small_gemm(rows, packed, bias, amx_from)


# x [T, h] bf16 -> the layer's output [T, h]; linears: (packed, int8 scales or None, bias or None) of qkv, o, gate_up
# and down; k_buf / v_buf written at out_slots; embeds [T, h] and their norm: an EAGLE-3 head's layer; amx_from: the
# linears' (small_gemm's or int8_gemm's, on AVX512-BF16)
decoder_layer = cpu_op("decoder_layer(Tensor x, Tensor?[] linears, Tensor norm1, Tensor norm2, float eps, Tensor cos, "
                       "Tensor sin, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor out_slots, Tensor kv_slots, "
                       "Tensor? mask, int heads, float scale, Tensor? embeds=None, Tensor? embed_norm=None, "
                       "int amx_from=0) -> Tensor",
                       decoder_layer_reference, lambda x, *rest, **kw: torch.empty_like(x))


def available() -> bool:
    """SPECSERVE_CPU_FUSED_LAYER is not off and ``ops.cpp`` registered the operator's C++ implementation here."""
    return native.env_mode(ENV, MODES) == "on" and native.native_ops() and registered("decoder_layer")


def runs_here() -> bool:
    """The operator is available and this build's bf16 few-row kernel is one the engine's bf16 linears run on: the
    AVX2 kernel, or on AVX512-BF16 the few-row kernel unless SPECSERVE_SMALL_GEMM is off (its probe at load may still
    keep a model's one-row calls off it, where another kernel times faster)."""
    return available() and (registered("avx2_gemm") or small_gemm_available())


def _kernel_copy(linear) -> tuple | None:
    """(packed, scales, bias) of a linear on the kernel that the operator calls for it in this build of ``ops.cpp``:
    the AVX2 bf16 kernel, the AVX512-BF16 few-row one (a PackedLinear's ``small`` copy), the int8 one; else None."""
    if type(linear) is Avx2Linear and registered("avx2_gemm"):
        return linear.packed, None, linear.bias
    if type(linear) is PackedLinear and linear.small is not None and registered("small_gemm"):
        return linear.small.packed, None, linear.small.bias
    if isinstance(linear, QuantLinear) and isinstance(linear.few_rows, Int8Copy):
        return linear.few_rows.packed, linear.few_rows.scales, linear.few_rows.bias
    return None


def _linears(layer: torch.nn.Module) -> list:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _norms(layer: torch.nn.Module) -> list:
    """The layer's norms: of the attention's input, of the embeddings beside it (or None), of the MLP's input. A layer
    class declares the first two in its own ``fused_norms`` (a subclass that computes otherwise does not inherit it)."""
    first, embeds = type(layer).__dict__["fused_norms"]
    return [getattr(layer, first), None if embeds is None else getattr(layer, embeds), layer.post_attention_layernorm]


def fusable(layer: torch.nn.Module) -> bool:
    """A layer whose every step the operator runs (see the module's docstring): a class declaring ``fused_norms``
    (``DecoderLayer``, the EAGLE-3 head's layer), exactly RMSNorms, attention without q/k norms, a SiLU gated MLP, no
    tensor parallelism, linears on a few-row kernel (``_kernel_copy``)."""
    if "fused_norms" not in type(layer).__dict__:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return (all(norm is None or type(norm) is RMSNorm for norm in _norms(layer))
            and type(attn) is Attention and attn.q_norm is None and attn.tp is None
            and attn.head_dim in tree_attention.HEAD_DIMS
            and type(mlp) is GatedMLP and mlp.act is F.silu and mlp.tp is None
            and all(_kernel_copy(m) is not None for m in _linears(layer)))


class FusedLayer:
    """A layer's ``fused`` hook: its forward through the operator, or None where the forward does not fit it (the layer
    then runs its modules)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        attn = layer.self_attn
        self.layer_id, self.heads, self.scale, self.rotary = attn.layer_id, attn.num_heads, attn.scale, attn.rotary
        self.head_dim = attn.head_dim
        self.norm1, self.embed_norm, self.norm2 = _norms(layer)
        self.eps = self.norm1.eps
        # AVX512-BF16: the bf16 linears' few-row copies, whose probe verdict (one per model) says which row counts
        # their calls give the kernel and from how many rows its tile unit; the int8 linears' copies, which say it
        # alike (one setting per process)
        self.smalls = [m.small for m in _linears(layer) if type(m) is PackedLinear]
        self.int8s = [m.few_rows for m in _linears(layer) if isinstance(m, QuantLinear)]
        self.int8 = bool(self.int8s)
        copies = self.smalls or self.int8s
        self.amx_from = copies[0].amx_from if copies else 0
        # this forward's arguments, shared by the layers alike (kept in fb.rope_rows)
        self.key = (id(self.rotary), "fused layer", self.int8)
        self._linears: list | None = None
        self._norm_weights: tuple | None = None

    def max_rows(self) -> int:
        """The most rows a call of this layer runs through the operator (its linears' few-row kernels take them)."""
        return min(c.max_rows for c in self.smalls + self.int8s)

    def weights(self) -> list:
        """The 12 linear entries, read on the first call: the policy moves weights onto huge pages after it installs
        this."""
        if self._linears is None:
            self._linears = [t for m in _linears(self.layer) for t in _kernel_copy(m)]
        return self._linears

    def norm_weights(self) -> tuple:
        """The norms' weights (norm1, norm2, embed_norm or None), read on the first call as ``weights``: a module's
        parameter read costs a microsecond or so, a few per layer call."""
        if self._norm_weights is None:
            self._norm_weights = (self.norm1.weight, self.norm2.weight,
                                  None if self.embed_norm is None else self.embed_norm.weight)
        return self._norm_weights

    def forward_args(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> tuple | None:
        """(cos, sin, out_slots, kv_slots, mask) of this forward, or None where it does not fit the operator."""
        md, pool = fb.attn, fb.kv_pool
        if (not elementwise.takes(x) or x.dim() != 2 or positions is not fb.positions or pool is None
                or fb.out_rows is not None
                or type(md) is not AttnMetadata or md.groups is not None or md.q_index is not None
                or md.out_index is not None or md.is_causal or md.kv_slots is None or md.platform is None
                or not all(c.takes(x) for c in self.int8s) or not all(c.takes(x) for c in self.smalls)):
            return None
        k_buf, v_buf = pool.layer(self.layer_id)
        tokens, bsz = x.shape[0], md.kv_slots.shape[0]
        if tokens % bsz or not tree_attention.fits(tokens // bsz, self.heads, self.head_dim, k_buf, v_buf):
            return None
        cos, sin = self.rotary.cos_sin(positions, x, fb)
        return cos, sin, fb.out_cache_loc, md.kv_slots, md.mask

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                 embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [T, h] the residual stream (an EAGLE-3 layer's incoming hidden, with its embeds [T, h])."""
        if torch.compiler.is_compiling():  # a compiled graph fuses the layer's steps itself
            return None
        if self.key in fb.rope_rows:
            args = fb.rope_rows[self.key]
        else:
            args = fb.rope_rows[self.key] = self.forward_args(x, positions, fb)
        if args is None or (embeds is not None and embeds.dtype != x.dtype):
            return None
        cos, sin, out_slots, kv_slots, mask = args
        k_buf, v_buf = fb.kv_pool.layer(self.layer_id)
        norm1, norm2, embed_norm = self.norm_weights()
        if embeds is None:
            embed_norm = None
        return decoder_layer(x, self.weights(), norm1, norm2, self.eps, cos, sin, k_buf, v_buf, out_slots, kv_slots,
                             mask, self.heads, self.scale, embeds, embed_norm, self.amx_from)


def use_fused_layers(module: torch.nn.Module) -> int:
    """Give module's fusable decoder layers the operator for their eager bf16 forwards -> how many (0 where it is not
    available here)."""
    layers = [m for m in module.modules() if fusable(m)]
    if not layers or not available():
        return 0
    for layer in layers:
        layer.fused = FusedLayer(layer)
    return len(layers)

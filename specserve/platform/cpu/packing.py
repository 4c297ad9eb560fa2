"""Faster low-precision linears on CPU: oneDNN pre-packed weights.

At batch sizes 1-16, ``F.linear`` with bf16 weights streams them from memory at about 11-14 GB/s on this
project's reference CPU (2 cores, AMX); the same matmul on a weight pre-packed by oneDNN streams at about
20-21 GB/s. Decode is memory-bound, so this is close to a 1.5x decode speed-up for bf16 models. fp32 gains
nothing (and pays more per call on tiny weights), so only bf16/fp16 weights are packed.

The packed kernel is ``torch.ops.mkldnn._linear_pointwise`` (what torch.compile's CPU backend uses). It
is checked against ``F.linear`` on a random input when packing; any failure keeps the plain linear.

Under ``--enable-torch-compile`` the call goes through the custom op ``specserve::packed_linear``: inductor's own
lowering of ``_linear_pointwise`` only accepts weights it packed itself (frozen graph constants) and fails on
ours, while a custom op is an opaque call inside the compiled graph (no graph break, same kernel).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.direct_call import DirectCall

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)

#: The row count oneDNN is told to expect when it packs a weight; it picks the layout from it. On the reference CPU a
#: hint of 1 gives 64-column blocks and any hint from 8 up gives 32-column blocks, with which a 1113-row prefill
#: matmul takes ~0.75x the time (the large bench model's linears: 246 vs 325 ms) and 1-16-row calls take the same
#: (docs/benchmarks.md).
PACK_BATCH_HINT = 64


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ a oneDNN-packed weight (+ bias) -> [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("specserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """_packed_matmul as an op that compiled graphs call as is."""
    return _packed_matmul(x, packed, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


class PackedLinear(DirectCall):
    """A Linear whose weight lives in oneDNN's packed layout (the plain weight is not kept)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed, self.bias)
        return _packed_matmul(x, self.packed, self.bias)


#: MixedLinear's float32 / packed-bf16 crossover in rows per call. A batch-1 EAGLE tree level (topk rows) and
#: draft extend (accepted tokens) stay in float32, where the whole float32 draft measured faster end to end; at 16
#: rows float32 matmuls of the demo drafts' shapes take 2-4x the packed bf16 time (docs/benchmarks.md).
FP32_MAX_ROWS = 8


class MixedLinear(DirectCall):
    """A float32 Linear with a oneDNN-packed bf16 copy of its weight: a call of at most FP32_MAX_ROWS rows runs in
    float32, whose per-call cost is lower; a larger one casts its input to bf16, runs the packed matmul (AMX /
    AVX512-BF16, far more multiply-adds per second) and casts the result back to float32."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias, self.packed = linear.weight, linear.bias, packed
        self.bias_bf16 = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] float32 -> [T, out] float32
        if x.shape[0] <= FP32_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        low = x.to(torch.bfloat16)
        if torch.compiler.is_compiling():
            return packed_linear(low, self.packed, self.bias_bf16).to(x.dtype)
        return _packed_matmul(low, self.packed, self.bias_bf16).to(x.dtype)


def _pack(linear: nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """linear's weight in oneDNN's packed layout (in ``dtype``, default its own), checked against F.linear on a
    random input; None where oneDNN cannot pack it."""
    w = linear.weight.detach().to(dtype or linear.weight.dtype)
    bias = None if linear.bias is None else linear.bias.detach().to(w.dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        probe = torch.randn(3, linear.in_features, dtype=w.dtype)
        got = _packed_matmul(probe, packed, bias)
        want = F.linear(probe, w, bias)
        if not torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2):
            return None
    except (RuntimeError, AttributeError):
        return None
    return packed


def _replace_linears(model: nn.Module, dtypes: tuple[torch.dtype, ...], make) -> int:
    """Replace every CPU nn.Linear of model whose weight has one of ``dtypes`` by make(linear) (unless None)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and child.weight.dtype in dtypes:
                new = make(child)
                if new is not None:
                    setattr(parent, name, new)
                    count += 1
    return count


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Replace every bf16/fp16 nn.Linear of a CPU model by a PackedLinear; returns how many were packed."""
    def make(linear):
        packed = _pack(linear)
        return None if packed is None else PackedLinear(linear, packed)

    count = _replace_linears(model, PACKABLE_DTYPES, make)
    if count:
        logger.info("packed %d linear layers for oneDNN", count)
    return count


def mix_linears_for_cpu(model: nn.Module) -> int:
    """Replace every float32 nn.Linear of a small CPU model by a MixedLinear (float32 for small calls, packed
    bf16 for large ones); returns how many. Only worth it where bf16 matmuls are native (AVX512-BF16 / AMX)."""
    def make(linear):
        packed = _pack(linear, torch.bfloat16)
        return None if packed is None else MixedLinear(linear, packed)

    count = _replace_linears(model, (torch.float32,), make)
    if count:
        logger.info("%d float32 linear layers get a packed bf16 copy for large calls", count)
    return count

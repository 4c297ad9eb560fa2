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

One row can be the exception. oneDNN's kernels, packed or not, stream a bf16 weight for a single row at 12-19 GB/s,
and on some CPUs PyTorch's own matrix-vector kernel (``cpublas`` gemv, reached by ``F.linear`` with oneDNN switched
off) is twice as fast: on a 2-core AMD EPYC SmolLM2-135M's 30 layers of linears take 13.7 ms packed and 7.2 ms that
way. On a 2-core Xeon with AMX the packed kernel wins for SmolLM2 (12 against 17.5 ms) while gemv still wins for
the 12M-parameter demo, whose weights stay in the caches. From two rows up the packed kernel is as fast or faster.
So a PackedLinear may also keep its plain weight (``keep_plain``) and run one-row calls on it (``cpu_gemv``):
batch-1 decode, a draft's first step. ``CpuPolicy`` keeps the copy for models whose linears are small next to the
machine's memory (a tied LM head's plain weight is the embedding's: free), and ``one_row_probe.py`` drops it again
where the packed kernel is the faster one for that model on this machine.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.direct_call import DirectCall
from specserve.models.one_row import GEMV_MAX_ROWS, onednn_off
from specserve.platform.cpu import small_gemm
from specserve.platform.cpu.avx2_gemm import Avx2Linear
from specserve.platform.cpu.ops import cpu_op

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)

#: The row count oneDNN is told to expect when it packs a weight; it picks the layout from it. On the reference CPU a
#: hint of 1 gives 64-column blocks and any hint from 8 up gives 32-column blocks, with which a 1113-row prefill
#: matmul takes ~0.75x the time (the large bench model's linears: 246 vs 325 ms) and 1-16-row calls take the same
#: (docs/benchmarks.md).
PACK_BATCH_HINT = 64


#: oneDNN builds a matmul primitive (JIT-compiled code) for each row count it meets, and caches it: on the reference
#: Xeon a [200, 768] @ [768, 256] bf16 call took 90 us once built and 1.7-2.0 ms with a row count not met before, so
#: every prompt of a new length paid that in its prefill, once for each weight shape (the demo's 250-token prefill
#: 23 ms against 18 ms at a length seen before). Calls of more than PAD_FROM rows run padded with zero rows
#: (``padded_rows``): a few dozen row counts serve prompts of every length.
PAD_FROM = 16


def padded_rows(m: int) -> int:
    """The row count a packed call of m rows runs with: m up to PAD_FROM; beyond, m rounded up to a multiple of 16
    up to 256 rows, of 32 up to 1024 and of 128 past that (at most 15, 31 and 127 rows more: past 256 rows, less than
    an eighth of the call's work)."""
    if m <= PAD_FROM:
        return m
    step = 16 if m <= 256 else 32 if m <= 1024 else 128
    return -(-m // step) * step


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ a oneDNN-packed weight (+ bias) -> [T, out], through ``padded_rows(T)`` rows."""
    rows = x.shape[0] if x.dim() == 2 else None
    extra = 0 if rows is None else padded_rows(rows) - rows
    if extra == 0:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    padded = F.pad(x, (0, 0, 0, extra))  # [T', in]: zero rows after x's
    return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:rows]


# _packed_matmul as an op that compiled graphs call as is
packed_linear = cpu_op("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", _packed_matmul,
                       lambda x, packed, bias: x.new_empty(*x.shape[:-1], packed.shape[0]))


def cpu_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with oneDNN off for the call: for one half-precision row, up to twice the packed kernel's speed
    (``one_row_probe.py`` checks per model and machine)."""
    with onednn_off():
        return F.linear(x, weight, bias)


class PackedLinear(DirectCall):
    """A Linear whose weight lives in oneDNN's packed layout; with keep_plain its plain weight is kept too
    (``plain``) for calls of at most GEMV_MAX_ROWS rows (``cpu_gemv``), else it is not kept. With keep_small, a copy in
    the layout of specserve's few-row kernel is kept too (``small``, a ``small_gemm.SmallCopy``), for the calls whose
    row count it takes (set by ``small_gemm.choose_small_rows``; none until then)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, keep_plain: bool = False,
                 keep_small: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed
        self.bias = linear.bias
        self.plain = linear.weight.detach() if keep_plain else None  # [out, in]
        self.small = small_gemm.SmallCopy(linear.weight, linear.bias) if keep_small else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.small is not None and self.small.takes(x):
            return self.small.run(x)
        gemv = self.plain is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS
        if torch.compiler.is_compiling():  # a one-row forward's graph runs under onednn_off (one_row_forward)
            return F.linear(x, self.plain, self.bias) if gemv else packed_linear(x, self.packed, self.bias)
        return cpu_gemv(x, self.plain, self.bias) if gemv else _packed_matmul(x, self.packed, self.bias)

    def packed_call(self, x: torch.Tensor) -> torch.Tensor:
        """The oneDNN packed kernel, whatever the row count (the few-row kernel's probe times it)."""
        return _packed_matmul(x, self.packed, self.bias)


#: MixedLinear's float32 / packed-bf16 crossover in rows per call where none was measured, and the most rows the
#: probe (``mixed_probe.py``) tries. On a Xeon with AMX a batch-1 EAGLE tree level (topk rows) and draft extend
#: (accepted tokens) ran faster in float32, the whole float32 draft measured faster end to end, while at 16 rows
#: float32 matmuls of the demo drafts' shapes took 2-4x the packed bf16 time (docs/benchmarks.md).
FP32_MAX_ROWS = 8


class MixedLinear(DirectCall):
    """A float32 Linear with a oneDNN-packed bf16 copy of its weight: a call of at most ``fp32_max_rows`` rows runs
    in float32, where its per-call cost is lower; a larger one casts its input to bf16, runs the packed matmul (AMX
    / AVX512-BF16, far more multiply-adds per second) and casts the result back to float32. ``fp32_max_rows`` is
    FP32_MAX_ROWS until the policy sets the crossover measured on this machine (``mixed_probe.py``). An input already
    in bf16 (a forward that runs in half precision as a whole, whose later calls may have fewer rows: a catch-up's
    last rows, ``ForwardBatch.out_rows``) takes the bf16 path whatever its rows, and gets bf16 back."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, keep_small: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias, self.packed = linear.weight, linear.bias, packed
        self.bias_bf16 = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.fp32_max_rows = FP32_MAX_ROWS
        # the bf16 path's few-row calls on specserve's kernel, as PackedLinear's
        self.small = small_gemm.SmallCopy(linear.weight, linear.bias) if keep_small else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] float32 (or bf16) -> [T, out] in x's dtype
        return self.fp32(x) if x.shape[0] <= self.fp32_max_rows and x.dtype == self.weight.dtype else self.bf16(x)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 path, whatever the row count (the crossover probe times it)."""
        return F.linear(x, self.weight, self.bias)

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The bf16 path with its casts, whatever the row count (the crossover probe times it): specserve's few-row
        kernel for the row counts it takes, the packed one otherwise."""
        low = x.to(torch.bfloat16)
        if self.small is not None and self.small.takes(low):
            out = self.small.run(low)
        elif torch.compiler.is_compiling():
            out = packed_linear(low, self.packed, self.bias_bf16)
        else:
            out = _packed_matmul(low, self.packed, self.bias_bf16)
        return out.to(x.dtype)

    def packed_call(self, x: torch.Tensor) -> torch.Tensor:
        """The oneDNN packed kernel on a bf16 input, whatever the row count (the few-row kernel's probe times it)."""
        return _packed_matmul(x, self.packed, self.bias_bf16)


#: the fewest rows whose calls an UpcastLinear runs on its float32 copy
UPCAST_MIN_ROWS = 2


class UpcastLinear(DirectCall):
    """A half-precision Linear on a CPU where oneDNN cannot pack half-precision weights, when asked for
    (``SPECSERVE_CPU_UPCAST``, ``upcast_probe.py``; no AVX512: e.g. an AMD EPYC
    of the Zen 3 generation, AVX2 only). PyTorch's bf16 matmul there re-reads the weight for every row, so a call's
    cost grows with its rows: a 12-row verify through a 1536x576 linear took 1.4 ms against 0.12 ms for one row, while
    float32 (MKL's sgemm) multiplies many rows for one read of the weight. Calls of ``min_rows`` rows or more run in
    float32 on a float32 copy of the weight (``wide``) and round their result to the weight's dtype; smaller calls
    (a batch-1 decode step's) read the half-precision weight, half the bytes. ``min_rows`` 0: every call does
    (``upcast_probe.py`` found the copy no faster here and dropped it)."""

    def __init__(self, linear: nn.Linear, min_rows: int = UPCAST_MIN_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("wide", linear.weight.detach().float(), persistent=False)  # [out, in] float32
        self.register_buffer("wide_bias", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)  # [out] float32
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], x's dtype
        if self.min_rows and x.numel() >= self.min_rows * self.in_features:
            return self.upcast(x)
        return F.linear(x, self.weight, self.bias)

    def upcast(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 path, whatever the row count (the probe times it)."""
        return F.linear(x.float(), self.wide, self.wide_bias).to(x.dtype)


def upcast_linears_for_cpu(model: nn.Module) -> int:
    """Replace every half-precision CPU nn.Linear of model (those oneDNN did not pack) by an UpcastLinear; returns
    how many."""
    count = _replace_linears(model, PACKABLE_DTYPES, UpcastLinear, need_onednn=False)
    if count:
        logger.info("%d half-precision linear layers get a float32 copy for calls of %d rows or more", count,
                    UPCAST_MIN_ROWS)
    return count


def avx2_linears_for_cpu(model: nn.Module) -> int:
    """Replace every bf16 CPU nn.Linear of model of the shapes specserve's AVX2 kernel takes (its layout's, the
    few-row kernel's: ``small_gemm.packable``) by an ``Avx2Linear``; returns how many."""
    count = _replace_linears(model, (torch.bfloat16,),
                             lambda lin: Avx2Linear(lin) if small_gemm.packable(lin.weight) else None,
                             need_onednn=False)
    if count:
        logger.info("%d bf16 linear layers run on specserve's AVX2 kernel", count)
    return count


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


def packable_bytes(model: nn.Module) -> int:
    """Bytes of the bf16/fp16 CPU linear weights pack_linears_for_cpu would pack, less those shared with another
    parameter (a tied LM head's is the embedding's, kept anyway): what keep_plain keeps in addition."""
    others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not isinstance(m, nn.Linear) or w is None or w.device.type != "cpu" or w.dtype not in PACKABLE_DTYPES:
            continue
        if id(w) not in others and id(w) not in seen:
            seen.add(id(w))
            total += w.numel() * w.element_size()
    return total


def _replace_linears(model: nn.Module, dtypes: tuple[torch.dtype, ...], make, need_onednn: bool = True) -> int:
    """Replace every CPU nn.Linear of model whose weight has one of ``dtypes`` by make(linear) (unless None)."""
    if need_onednn and not torch.backends.mkldnn.is_available():
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


def pack_linears_for_cpu(model: nn.Module, keep_plain: bool = False, keep_small: bool = False) -> int:
    """Replace every bf16/fp16 nn.Linear of a CPU model by a PackedLinear (keeping each plain weight for one-row
    calls when keep_plain, and a copy for the few-row kernel where keep_small and its shape rules allow); returns how
    many were packed."""
    def make(linear):
        packed = _pack(linear)
        # a linear whose few-row calls go elsewhere (a quantized linear's dense copy) keeps no copy for them
        few_rows = getattr(linear, "one_row_calls", True)
        small = keep_small and few_rows and small_gemm.packable(linear.weight)
        return None if packed is None else PackedLinear(linear, packed, keep_plain and few_rows, small)

    count = _replace_linears(model, PACKABLE_DTYPES, make)
    if count:
        logger.info("packed %d linear layers for oneDNN", count)
    return count


def mix_linears_for_cpu(model: nn.Module, keep_small: bool = False) -> int:
    """Replace every float32 nn.Linear of a small CPU model by a MixedLinear (float32 for small calls, packed
    bf16 for large ones; with keep_small a copy for the few-row kernel where its shape rules allow); returns how
    many. Only worth it where bf16 matmuls are native (AVX512-BF16 / AMX)."""
    def make(linear):
        packed = _pack(linear, torch.bfloat16)
        small = keep_small and small_gemm.fits(linear.weight)  # cast to bf16 by the copy
        return None if packed is None else MixedLinear(linear, packed, small)

    count = _replace_linears(model, (torch.float32,), make)
    if count:
        logger.info("%d float32 linear layers get a packed bf16 copy for large calls", count)
    return count

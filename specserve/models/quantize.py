"""Weight-only int8 / int4 linears on CPU: ``--torchao-config int8wo`` and ``--torchao-config int4wo-<group>``
(SGLang's flag and names for torchao's online weight-only quantization).

The kernels are PyTorch's own weight-packed matmuls, the ones torchao calls on CPU: ``_weight_int8pack_mm``
(int8 weights, one float scale per output channel) and ``_weight_int4pack_mm_for_cpu`` (4-bit weights, a scale and a
zero point per group of ``group`` input columns). A decode step of a memory-bound model reads every weight once,
so reading a half or a quarter of the bytes is what they buy; they are fast for a few rows only (at 8 rows the int4
kernel takes 1.4x the packed bf16 matmul's time, at 64 rows int8 takes 10x), so calls of more than
``QUANT_MAX_ROWS`` rows (prefill, verify trees, large batches) run on a dense copy of the dequantized weight in the
run dtype, oneDNN-packed where the platform packs. The copy costs memory (int4: 1.25x the bf16 model; int8: 1.5x):
this is a decode-speed option, not a memory saving. A platform may hand an int8 linear's calls to a kernel of its own
(``use_kernel``): on a CPU with AVX512-BF16, bf16 calls of up to 16 rows run specserve's int8 kernel
(``platform/cpu/int8_gemm.py``), verify trees included.

Both paths compute with the same quantized weights; in float32 they agree to rounding, in bf16 the dense copy holds
the weights rounded to bf16, so a large call rounds differently from a one-row call, as a verify forward already
does in bf16. The embedding table stays unquantized; a tied LM head is quantized on its own copy, to int8 under an
int4 config (``INT8_UNDER_INT4``).

Quantization, pure functions on a [N, K] weight:
  int8: symmetric per output channel: s = max|w| / 127, q = round(w / s) in [-127, 127], w ~ q * s.
  int4: asymmetric per group of G input columns: s = (max - min) / 15, q = round((w - min) / s) in [0, 15],
        w ~ q * s + min, stored as torch's format w = (q - 8) * s + z with z = min + 8 * s.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from specserve.models.direct_call import DirectCall, Linear

logger = logging.getLogger(__name__)

#: Calls of at most this many rows run the integer kernel, larger ones the dense copy. On the reference CPU (2 cores,
#: AMX) an MLP-sized matmul at 1 / 2 / 4 / 8 rows: int4 71 / - / - / 238 us, int8 149 / 163 / 197 / 381 us, packed
#: bf16 171 / 180 / 179 / 180 us.
QUANT_MAX_ROWS = 4
INT4_GROUPS = (32, 64, 128, 256)  # what the int4 kernel takes
CONFIG_NAMES = ("int8wo", *(f"int4wo-{g}" for g in INT4_GROUPS))


@dataclass(frozen=True)
class QuantConfig:
    bits: int  # 8 or 4
    group: int = 0  # int4: input columns per scale / zero point

    @property
    def name(self) -> str:
        return "int8wo" if self.bits == 8 else f"int4wo-{self.group}"


def parse_torchao_config(text: str) -> QuantConfig | None:
    """--torchao-config's value -> QuantConfig, None for "" (no quantization); ValueError naming the flag."""
    text = (text or "").strip().lower()
    if not text:
        return None
    if text == "int8wo":
        return QuantConfig(8)
    m = re.fullmatch(r"int4wo-(\d+)", text)
    if m and int(m.group(1)) in INT4_GROUPS:
        return QuantConfig(4, int(m.group(1)))
    raise ValueError(f"--torchao-config: {text!r} is not supported; choose from {', '.join(CONFIG_NAMES)} "
                     f"(weight-only int8 / int4 on CPU)")


# ---------------------------------------------------------------------------------------------- pure functions
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scales float32 [N]); a zero row gets scale 1."""
    w = w.detach().float()
    scales = w.abs().amax(dim=1) / 127  # [N]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q int8 [N, K], scales [N]) -> float32 [N, K]."""
    return q.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of group) -> (q int32 [N, K] in 0..15, scales float32 [N, K/G], zeros float32 [N, K/G])
    in torch's format: w ~ (q - 8) * scale + zero. A constant group gets scale 1 (its q are all 0)."""
    n, k = w.shape
    wg = w.detach().float().view(n, k // group, group)  # [N, K/G, G]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, K/G]
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return q, scales, lo + 8 * scales


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """(q [N, K] in 0..15, scales [N, K/G], zeros [N, K/G]) -> float32 [N, K] = (q - 8) * scale + zero."""
    n, k = q.shape
    wg = (q.float() - 8).view(n, k // group, group) * scales.float()[..., None] + zeros.float()[..., None]
    return wg.view(n, k)


def quantizable(linear: nn.Linear, cfg: QuantConfig) -> bool:
    """The kernels' shape rules: int4 needs N a multiple of 16 and K of the group."""
    n, k = linear.weight.shape
    return cfg.bits == 8 or (n % 16 == 0 and k % cfg.group == 0)


# ---------------------------------------------------------------------------------------------- the module
class DenseCopy(Linear):
    """A QuantLinear's dequantized weight for its large calls: packed like any Linear, but never given a plain copy
    for one-row calls (``platform/cpu/packing.py``), which the integer kernel serves."""

    one_row_calls = False


class QuantLinear(DirectCall):
    """A Linear with int8 / int4 weights for calls of at most QUANT_MAX_ROWS rows and a dense copy of the same
    (dequantized) weights for larger calls (``dense``: a Linear, packed by the platform like any other).

    grid: int4 only, the weights already on a 4-bit grid, as ``quantize_int4`` returns them (q [N, K], scales and
    zeros [N, K/G]): a GGUF file's own blocks (``models/gguf_quant.py``); None: quantize linear's weight."""

    def __init__(self, linear: nn.Linear, cfg: QuantConfig,
                 grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.cfg = linear.in_features, linear.out_features, cfg
        dtype = linear.weight.dtype
        self.bias = linear.bias
        if cfg.bits == 8:
            q, scales = quantize_int8(linear.weight)
            self.q8, self.scales = q, scales.to(dtype)  # [N, K] int8, [N] in the run dtype (the kernel's rule)
            dense = dequantize_int8(q, self.scales)
        else:
            q, scales, zeros = grid if grid is not None else quantize_int4(linear.weight, cfg.group)
            sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K/G, N, 2]
            self.q4 = torch._convert_weight_to_int4pack_for_cpu(q, 1)  # [N, K/2] uint8, packed for this CPU
            self.scales_zeros = sz
            dense = dequantize_int4(q, sz[..., 0].T, sz[..., 1].T, cfg.group)
        self.dense = DenseCopy(self.in_features, self.out_features, bias=False, device="meta")
        self.dense.weight = nn.Parameter(dense.to(dtype), requires_grad=False)  # [N, K]
        self.few_rows: nn.Module | None = None  # a platform's own kernel for the calls it takes (``use_kernel``)

    def use_kernel(self, kernel: nn.Module) -> None:
        """Hand the calls ``kernel.takes(x)`` accepts to a platform's own kernel (a module whose ``run(x)``
        computes this linear, bias included, from its own copy of the int8 weights: ``platform/cpu/int8_gemm.py``).
        It takes every call PyTorch's int8 kernel would get in this linear's run dtype, so the int8 weights are
        dropped here: calls it does not take run on the dense copy."""
        self.few_rows = kernel
        if self.cfg.bits == 8:
            self.q8 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.few_rows is not None and self.few_rows.takes(x):
            return self.few_rows.run(x)
        if x.dim() != 2 or x.shape[0] > QUANT_MAX_ROWS or (self.cfg.bits == 8 and self.q8 is None):
            out = self.dense(x)
        elif self.cfg.bits == 8:
            out = torch._weight_int8pack_mm(x, self.q8, self.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(x, self.q4, self.cfg.group, self.scales_zeros)
        return out if self.bias is None else out + self.bias

    def integer_bytes(self) -> int:
        """Bytes of the integer weights and their scales (the dense copy is a parameter and counted as one)."""
        tensors = (self.q8, self.scales) if self.cfg.bits == 8 else (self.q4, self.scales_zeros)
        if self.few_rows is not None:
            tensors = (*tensors, *self.few_rows.buffers())
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.cfg.name}"


#: Modules quantized to int8 under an int4 config: the LM head, the layer whose errors reach the logits directly
#: (llama.cpp's 4-bit files keep it at 6 or 8 bits too: SmolLM2's Q4_1 file holds its tied output table in Q8_0).
INT8_UNDER_INT4 = ("lm_head",)


def quantize_linears(model: nn.Module, cfg: QuantConfig) -> tuple[int, int]:
    """Replace every CPU nn.Linear of model that the kernels take by a QuantLinear -> (quantized, left as they
    were). A tied LM head gets its own quantized copy; the embedding keeps the original table."""
    done = kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or isinstance(child, DenseCopy):  # a dense copy is quantized already
                continue
            own = QuantConfig(8) if cfg.bits == 4 and name in INT8_UNDER_INT4 else cfg
            if child.weight.device.type != "cpu" or not quantizable(child, own):
                kept += 1
                continue
            setattr(parent, name, QuantLinear(child, own))
            done += 1
    logger.info("--torchao-config %s: %d linear layers quantized, %d left as they were", cfg.name, done, kept)
    return done, kept


__all__ = ["CONFIG_NAMES", "QUANT_MAX_ROWS", "QuantConfig", "QuantLinear", "dequantize_int4", "dequantize_int8",
           "parse_torchao_config", "quantize_int4", "quantize_int8", "quantize_linears"]

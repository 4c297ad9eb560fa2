"""``--quantization gguf``: a GGUF file's 4-bit linears run as they are in the file, on the CPU int4 kernel.

A GGUF checkpoint is loaded through its converted HF folder (``models/gguf.py``: every tensor dequantized). With
``--quantization gguf`` the target's linears are then rebuilt from the file's own blocks where the CPU has a kernel
for them, instead of running the dequantized copy:

- **4-bit blocks** (Q4_0, Q4_1, Q4_K): every block of 32 input columns is ``w = q * scale + low`` with q in 0..15 and
  one scale and one low value per block; that is exactly the grid of PyTorch's int4 kernel at group 32
  (``models/quantize.py``: ``w = (q - 8) * s + z``, so ``s = scale`` and ``z = low + 8 * scale``). The kernel gets
  the file's q values, not a re-quantization of the dequantized weights. Its scales are stored in the run dtype: in
  float32 they are the file's, in bf16 they round to bf16 (as every bf16 run rounds the file's weights).
- **Every other linear** (Q8_0, Q5_*, Q6_K, F16, ...; SmolLM2's tied LM head is Q8_0) runs the loaded weights, the
  file's values in the run dtype: PyTorch's int8 kernel has one scale per output row, not one per block of 32, so
  it could only run a re-quantization of them (``--torchao-config int8wo`` is that, for every linear). A fused
  projection (q/k/v, gate/up) runs on the int4 kernel only when all its tensors are 4-bit: in a Q4_K_M file, whose
  attn_v of some layers is Q6_K, those layers' q/k/v stay dense.

Each rebuilt linear is checked against the weight the engine loaded from the converted folder: the file's blocks,
dequantized and cast to the run dtype, must equal it exactly (they are the same numbers). A linear whose blocks do
not (an unknown tensor layout) stays dense, with a warning.

llama.cpp's converter stores the rows of a Llama q / k projection in another order (its rotary layout);
``hf_rows`` puts them back as transformers' GGUF loader does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from specserve.models.loader import dtype_name
from specserve.models.quantize import QuantConfig, QuantLinear

logger = logging.getLogger(__name__)

GROUP = 32  # input columns per scale in every 4-bit GGUF block type handled here (Q4_K: per sub-block)
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # the GGUF types int4_blocks reads
#: GGUF architectures whose q / k rows llama.cpp's converter permutes (transformers undoes it when loading)
PERMUTED_QK = ("llama",)


# ---------------------------------------------------------------------------------------------- pure functions
def int4_blocks(raw: np.ndarray, qtype_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit GGUF tensor's bytes [N, bytes per row] -> (q int32 [N, K] in 0..15, scale float32 [N, K/32],
    low float32 [N, K/32]) with the file's weights w[n, k] = q[n, k] * scale[n, k // 32] + low[n, k // 32].

    Q4_0: 18-byte blocks of 32 (f16 d, 16 bytes of nibbles), w = d * (q - 8).
    Q4_1: 20-byte blocks of 32 (f16 d, f16 m, nibbles), w = d * q + m.
    Q4_K: 144-byte super-blocks of 256 (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
          nibbles), sub-block j of 32: w = d * sc_j * q - dmin * m_j.
    Within 32 values (Q4_0 / Q4_1: a block; Q4_K: two sub-blocks share 32 bytes) value i < 16 / i >= 16 (Q4_K:
    sub-block 2i / 2i + 1) is the low / high nibble of byte i (i - 16)."""
    from gguf.quants import Q4_K

    n = raw.shape[0]
    if qtype_name in ("Q4_0", "Q4_1"):
        size = 18 if qtype_name == "Q4_0" else 20
        blocks = raw.reshape(n, -1, size)  # [N, K/32, size]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
        if qtype_name == "Q4_0":
            low, qs = -8 * d, blocks[..., 2:]
        else:
            low, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, K/32, 32]
        scale = d
    elif qtype_name == "Q4_K":
        blocks = raw.reshape(n * (raw.shape[1] // 144), 144)  # [N * K/256, 144]
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [S, 1]
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [S, 1]
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # [S, 8] each
        scale, low = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))  # [S, 8]
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 8, 32)  # [S, 8, 32]: sub-block j
        scale, low = scale.reshape(n, -1), low.reshape(n, -1)
    else:
        raise ValueError(f"{qtype_name} is not one of {', '.join(FOUR_BIT)}")
    q = torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1)).astype(np.int32))
    return q, torch.from_numpy(np.ascontiguousarray(scale)), torch.from_numpy(np.ascontiguousarray(low))


def hf_rows(a: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a Llama q / k projection in llama.cpp's order (per head: the rows of its two rotary halves
    interleaved, row i of the first half then row i of the second) -> in the HF checkpoint's order (per head: the
    first half, then the second). a [n_heads * D, ...]."""
    half = a.shape[0] // n_heads // 2
    return a.reshape(n_heads, half, 2, *a.shape[1:]).transpose(1, 2).reshape(a.shape)


# ---------------------------------------------------------------------------------------------- the file's linears
@dataclass
class Piece:
    """One GGUF tensor that fills a block of rows of an engine linear."""

    name: str  # the GGUF tensor, e.g. blk.3.attn_q.weight
    permute_heads: int = 0  # > 0: llama.cpp's q / k row order over this many heads (``hf_rows``)


@dataclass
class GGUFLinears:
    """What ``--quantization gguf`` did to a model: linears per kind (reported at start-up and in server info)."""

    int4: int = 0  # from the file's 4-bit blocks
    dense: int = 0  # another type in the file (or blocks that did not match): the loaded weights as they are
    mismatched: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"int4_from_file": self.int4, "dense": self.dense}


def engine_linears(model: nn.Module, spec, arch: str) -> dict[str, tuple[nn.Module, str, list[Piece]]]:
    """The target's linears and the GGUF tensors that fill them, in row order:
    {module path: (parent module, attribute, pieces)}."""
    heads = (spec.num_heads, spec.num_kv_heads) if arch in PERMUTED_QK else (0, 0)
    out: dict[str, tuple[nn.Module, str, list[Piece]]] = {}
    for i, layer in enumerate(model.model.layers):
        b = f"blk.{i}."
        out[f"model.layers.{i}.self_attn.qkv_proj"] = (layer.self_attn, "qkv_proj", [
            Piece(b + "attn_q.weight", heads[0]), Piece(b + "attn_k.weight", heads[1]), Piece(b + "attn_v.weight")])
        out[f"model.layers.{i}.self_attn.o_proj"] = (layer.self_attn, "o_proj", [Piece(b + "attn_output.weight")])
        out[f"model.layers.{i}.mlp.gate_up_proj"] = (layer.mlp, "gate_up_proj", [
            Piece(b + "ffn_gate.weight"), Piece(b + "ffn_up.weight")])
        out[f"model.layers.{i}.mlp.down_proj"] = (layer.mlp, "down_proj", [Piece(b + "ffn_down.weight")])
    head = "token_embd.weight" if spec.tie_word_embeddings else "output.weight"
    out["lm_head"] = (model, "lm_head", [Piece(head)])
    return out


def apply_gguf_quantization(model: nn.Module, spec, gguf_file: str) -> GGUFLinears:
    """Rebuild the target's 4-bit linears from the GGUF file's blocks (see the module docstring) -> what was done."""
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    arch = str(reader.fields["general.architecture"].contents())
    tensors = {t.name: t for t in reader.tensors}
    done = GGUFLinears()
    for path, (parent, attr, pieces) in engine_linears(model, spec, arch).items():
        linear = getattr(parent, attr)
        found = [tensors.get(p.name) for p in pieces]
        if not isinstance(linear, nn.Linear) or any(t is None for t in found):
            done.dense += 1
            done.mismatched.append(path)
            continue
        kinds = {t.tensor_type.name for t in found}
        if kinds <= set(FOUR_BIT) and _fits_int4(linear):
            grid = _file_grid(found, pieces)
            if _same_weights(grid, linear):
                setattr(parent, attr, QuantLinear(linear, QuantConfig(4, GROUP), grid=_kernel_grid(*grid)))
                done.int4 += 1
                continue
            done.mismatched.append(path)
        done.dense += 1
    if done.mismatched:
        logger.warning("--quantization gguf: %d linears kept dense, their GGUF blocks not found or not matching the "
                       "loaded weights: %s", len(done.mismatched), ", ".join(done.mismatched[:4]))
    logger.info("--quantization gguf: %d linears on the int4 kernel with the file's 4-bit blocks, %d dense (%s)",
                done.int4, done.dense, dtype_name(next(model.parameters()).dtype))
    return done


def _fits_int4(linear: nn.Linear) -> bool:
    n, k = linear.weight.shape
    return n % 16 == 0 and k % GROUP == 0


def _file_grid(found, pieces: list[Piece]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces' blocks stacked in the engine's row order -> (q [N, K], scale [N, K/32], low [N, K/32])."""
    parts = []
    for t, piece in zip(found, pieces, strict=True):
        q, scale, low = int4_blocks(np.asarray(t.data), t.tensor_type.name)
        if piece.permute_heads:
            q, scale, low = (hf_rows(a, piece.permute_heads) for a in (q, scale, low))
        parts.append((q, scale, low))
    return tuple(torch.cat(a, dim=0) for a in zip(*parts, strict=True))


def _same_weights(grid, linear: nn.Linear) -> bool:
    """The file's blocks, dequantized as the GGUF reader does and cast to the run dtype, equal the loaded weight."""
    q, scale, low = grid
    n, k = q.shape
    if linear.weight.shape != (n, k):
        return False
    w = (q.float().view(n, k // GROUP, GROUP) * scale[..., None] + low[..., None]).view(n, k)
    return torch.equal(w.to(linear.weight.dtype), linear.weight.detach())


def _kernel_grid(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor):
    """(q, scale, low) -> the int4 kernel's (q, scales, zeros): w = (q - 8) * scale + (low + 8 * scale)."""
    return q, scale, low + 8 * scale


__all__ = ["GGUFLinears", "apply_gguf_quantization", "engine_linears", "hf_rows", "int4_blocks"]

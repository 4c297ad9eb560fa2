"""Building blocks shared by the decoder-only models: RMSNorm, rotary embedding, attention, gated MLP.

Tokens are flattened: activations are ``[T, hidden]`` for the T tokens of all requests in a forward.
q/k/v and gate/up projections are fused into one matmul each (the loader fills the fused weights from
the checkpoint's separate tensors).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import ForwardBatch, attention, output_rows
from specserve.models.direct_call import DirectCall, Embedding, Linear
from specserve.models.spec import ModelSpec, UnsupportedModelError
from specserve.models.tensor_parallel import FIRST_RANK_ONLY, building_group, kv_heads_of, rank_share, vocab_share


def fused_call(x: torch.Tensor) -> bool:
    """A module's ``fused`` operator (one call for its element-wise work, set by the platform policy where it runs:
    ``platform/cpu/elementwise.py``) takes x: an eager bf16 forward without autograd. Compiled graphs fuse these steps
    themselves."""
    return x.dtype == torch.bfloat16 and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class RMSNorm(DirectCall):
    #: (x, weight, eps) -> this norm of x in one operator call, where the platform has one (``fused_call``)
    fused = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.shape = eps, (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self.fused is not None and fused_call(x):
            return self.fused(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # low precision: normalise in float32, cast, then scale (the reference implementations' order); a float32
        # weight (a float32 draft's large calls in bf16, ``EagleProposer.compute_dtype``) scales in x's dtype too
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale, honouring rope_scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if scaling is None:
        return inv_freq.float(), 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float(), 1.0
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short kept, a smooth ramp between."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, ramp, scaled)


class RotaryEmbedding(DirectCall):
    """Neox-style RoPE (rotate halves) with a cos/sin table over positions, built lazily on the device.

    The table holds, per position, ``cos | cos`` and ``-sin | sin`` (each [D]), so a rotation is
    ``x * cos + cat(x2, x1) * sin`` (the reference ``x * cos + rotate_half(x) * sin``, same rounding). The rows
    for a forward's positions are gathered once and reused by every layer sharing this module.
    """

    #: (x, cos, sin) -> the rotated x in one operator call, where the platform has one (``fused_call``)
    fused = None

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.inv_freq, self.scale = rope_inv_freq(head_dim, theta, scaling)
        # per dtype: [P, 2, D] = (cos | cos, -sin | sin), built on first use (a float32 draft runs its large calls in
        # bf16, so it keeps a table of each)
        self._tables: dict[torch.dtype, torch.Tensor] = {}

    def cover(self, n: int) -> None:
        """Make the table reach positions up to n (rebuilt lazily on next use)."""
        if n > self.max_positions:
            self.max_positions, self._tables = n, {}

    def _table(self, device, dtype) -> torch.Tensor:
        table = self._tables.get(dtype)
        if table is None or table.device != device:
            t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))  # [P, D/2] float32
            cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
            table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1).to(dtype)  # [P, 2, D]
            self._tables[dtype] = table
        return table

    def cos_sin(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch | None = None):
        """positions [T] -> (cos, sin) [T, 1, D] each in x's dtype. With a ForwardBatch the rows are gathered once
        per forward and kept on it for the other layers sharing this module."""
        key = (id(self), x.dtype)
        if fb is not None and key in fb.rope_rows:
            return fb.rope_rows[key]
        cos, sin = self._table(x.device, x.dtype)[positions].unsqueeze(1).unbind(2)  # [T, 1, D] each
        if fb is not None and not torch.compiler.is_compiling():
            fb.rope_rows[key] = (cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch | None = None) -> torch.Tensor:
        """positions [T] (fb.positions when fb is given); x [T, heads, D] (q and k heads together) -> rotated x."""
        cos, sin = self.cos_sin(positions, x, fb)
        if self.fused is not None and fused_call(x):
            return self.fused(x, cos, sin)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * sin


class Attention(DirectCall):
    """Self-attention over fused q/k/v. Under tensor parallelism (``tensor_parallel.py``) this rank's heads only, and
    o_proj's output summed over the ranks."""

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id, self.rotary = layer_id, rotary
        self.tp = tp = building_group()
        self.head_dim = spec.head_dim
        heads = rank_share(spec.num_heads, tp)
        kv_heads = (0, spec.num_kv_heads) if tp is None else kv_heads_of(spec.num_heads, spec.num_kv_heads, tp.rank,
                                                                           tp.size)
        # this rank's rows of the checkpoint's q and of its k / v ([lo, hi) each)
        self.q_rows = (heads[0] * spec.head_dim, heads[1] * spec.head_dim)
        self.kv_rows = (kv_heads[0] * spec.head_dim, kv_heads[1] * spec.head_dim)
        self.num_heads, self.num_kv_heads = heads[1] - heads[0], kv_heads[1] - kv_heads[0]
        self.q_size, self.kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)  # [T, H + Hkv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = self.rotary(positions, qk, fb if positions is fb.positions else None)  # q and k heads in one go
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        out = self.o_proj(attention(q, k, v, self.layer_id, fb, self.scale))  # [T, hidden]
        return out if self.tp is None else self.tp.all_reduce(out)

    def tp_rules(self) -> dict:
        """Checkpoint slices of this rank's parameters (``specserve.models.tensor_parallel.shard_rules``)."""
        return {("qkv_proj.weight", 0): (0, *self.q_rows), ("qkv_proj.weight", 1): (0, *self.kv_rows),
                ("qkv_proj.weight", 2): (0, *self.kv_rows), ("qkv_proj.bias", 0): (0, *self.q_rows),
                ("qkv_proj.bias", 1): (0, *self.kv_rows), ("qkv_proj.bias", 2): (0, *self.kv_rows),
                ("o_proj.weight", -1): (1, *self.q_rows), ("o_proj.bias", -1): FIRST_RANK_ONLY}


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# ModelSpec.hidden_act -> the gate activation of GatedMLP (names as in HF configs)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class GatedMLP(DirectCall):
    """down(act(gate(x)) * up(x)); under tensor parallelism this rank's columns of the intermediate only, and down's
    output summed over the ranks."""

    #: gate_up [T, 2I] -> silu(gate) * up in one operator call, where the platform has one (``fused_call``); only
    #: for the SiLU activation
    fused = None

    def __init__(self, hidden: int, intermediate: int, bias: bool, act=F.silu) -> None:
        super().__init__()
        self.tp = tp = building_group()
        self.rows = rank_share(intermediate, tp)
        self.intermediate, self.act = self.rows[1] - self.rows[0], act
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.fused is not None and fused_call(gate_up):
            out = self.down_proj(self.fused(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            out = self.down_proj(self.act(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)

    def tp_rules(self) -> dict:
        return {("gate_up_proj.weight", 0): (0, *self.rows), ("gate_up_proj.weight", 1): (0, *self.rows),
                ("gate_up_proj.bias", 0): (0, *self.rows), ("gate_up_proj.bias", 1): (0, *self.rows),
                ("down_proj.weight", -1): (1, *self.rows), ("down_proj.bias", -1): FIRST_RANK_ONLY}


class VocabParallelEmbedding(DirectCall):
    """The embedding table's rows [lo, hi) of a vocabulary padded to a multiple of the group (``padded_vocab``): a
    token whose row lives elsewhere looks up zeros here, and the sum over the ranks is the embedding."""

    def __init__(self, vocab: int, hidden: int, tp) -> None:
        super().__init__()
        self.tp = tp
        self.rows = vocab_share(vocab, tp)
        self.weight = nn.Parameter(torch.empty(self.rows[1] - self.rows[0], hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.rows[0]
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)

    def tp_rules(self) -> dict:
        return {("weight", -1): (0, *self.rows)}


def vocab_embedding(vocab: int, hidden: int) -> nn.Module:
    """The token embedding: whole, or this rank's vocabulary rows under tensor parallelism."""
    tp = building_group()
    return Embedding(vocab, hidden) if tp is None else VocabParallelEmbedding(vocab, hidden, tp)


class DecoderLayer(DirectCall):
    """Pre-norm attention + gated MLP. ``norm``: the class of both norms; the MLP activation is spec.hidden_act."""

    #: (x, positions, fb) -> the layer's output in one operator call, or None where the forward does not fit it; set
    #: by the platform policy where it runs (``platform/cpu/fused_layer.py``)
    fused = None
    #: the norms that operator reads: of the attention's input, and of embeddings concatenated before it (none here)
    fused_norms = ("input_layernorm", None)

    def __init__(self, spec: ModelSpec, layer_id: int, rotary: RotaryEmbedding, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.input_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_id, rotary)
        self.post_attention_layernorm = norm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, ACTIVATIONS[spec.hidden_act])

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if self.fused is not None and (out := self.fused(x, positions, fb)) is not None:
            return out
        x = output_rows(x, fb) + self.self_attn(self.input_layernorm(x), positions, fb)
        return x + self.mlp(self.post_attention_layernorm(x))


# Checkpoint tensors that land in a fused parameter: (checkpoint piece, fused name, shard index).
FUSED_PIECES = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", 0),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", 1),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", 2),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)


def fused_shard_range(module: nn.Module, fused_name: str, shard: int) -> tuple[int, int]:
    """Row range of shard `shard` inside a fused projection's output dimension."""
    if fused_name.endswith("qkv_proj."):
        sizes = [module.q_size, module.kv_size, module.kv_size]
    else:
        sizes = [module.intermediate, module.intermediate]
    start = sum(sizes[:shard])
    return start, start + sizes[shard]

"""EAGLE-3 draft head (checkpoint architecture ``LlamaForCausalLMEagle3``).

Network, per token (h = the head's hidden size, usually the target's):
    hidden = fc(cat(aux_0, aux_1, aux_2))          only when the incoming hidden is the target's 3 captured layers
    x      = cat(input_layernorm(embed(token)), hidden_norm(hidden))        [2h]: q/k/v take 2h inputs
    r      = hidden + self_attn(x)
    out    = r + mlp(post_attention_layernorm(r))  the next draft step's hidden (pre-norm)
    logits = lm_head(norm(out))                    over the DRAFT vocabulary; target id = draft id + d2t[draft id]
Without ``draft_vocab_size`` in the config the LM head is the target's. Embedding = the target's.

Checkpoint names (a ``model.`` prefix is stripped): ``fc.weight`` [h, 3*h_target],
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight``
[draft_vocab, h], ``d2t`` [draft_vocab] int64 (``t2d`` is ignored).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specserve.attention import ForwardBatch, output_rows
from specserve.models.direct_call import DirectCall, Linear
from specserve.models.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from specserve.models.spec import ModelSpec
from specserve.models.weights import CheckpointLoadable, copy_checked


class Eagle3MidLayer(DirectCall):
    #: (hidden, positions, fb, embeds) -> the layer's output in one operator call, or None where the forward does not
    #: fit it; set by the platform policy where it runs (``platform/cpu/fused_layer.py``)
    fused = None
    #: the norms that operator reads: of the hidden (the residual stream), and of the embeddings before it
    fused_norms = ("hidden_norm", "input_layernorm")

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h = spec.hidden_size
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.self_attn = Attention(spec, 0, rotary)
        attn = self.self_attn  # q/k/v read [embed | hidden], 2h wide
        attn.qkv_proj = Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=spec.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = GatedMLP(h, spec.intermediate_size, spec.mlp_bias)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if self.fused is not None and (out := self.fused(hidden, fb.positions, fb, embeds)) is not None:
            return out
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [T, 2h]
        r = output_rows(hidden, fb) + self.self_attn(x, fb.positions, fb)  # [T or R, h] (``ForwardBatch.out_rows``)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(CheckpointLoadable):
    @classmethod
    def spec_from_config(cls, cfg: dict) -> ModelSpec:
        return ModelSpec.from_config(cfg)

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        cfg = spec.raw
        h = spec.hidden_size
        self.target_hidden_size = cfg.get("target_hidden_size") or h
        self.draft_vocab_size = cfg.get("draft_vocab_size")
        self.fc = Linear(3 * self.target_hidden_size, h, bias=False)
        rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)
        self.midlayer = Eagle3MidLayer(spec, rotary)
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = Linear(h, self.draft_vocab_size, bias=False) if self.draft_vocab_size else None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size or 0, dtype=torch.int64), persistent=False)

    def aux_layer_ids(self) -> list[int] | None:
        """Target layers whose OUTPUT the head reads, from ``eagle_config`` (None: the default choice)."""
        ids = (self.spec.raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return list(ids) if ids else None

    def skip_checkpoint_tensor(self, name: str) -> bool:
        return super().skip_checkpoint_tensor(name) or name.startswith(("embed_tokens.", "t2d"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set, list[str]]:
        loaded_d2t: list[torch.Tensor] = []

        def params_only():
            for name, t in weights:
                name = name.removeprefix("model.")
                if name == "d2t":
                    loaded_d2t.append(t)
                else:
                    yield name, t

        loaded, unexpected = super().load_weights(params_only())
        if self.draft_vocab_size:
            if not loaded_d2t:
                raise ValueError("EAGLE-3 checkpoint has draft_vocab_size but no d2t tensor")
            copy_checked(self.d2t, loaded_d2t[0].to(torch.int64), "d2t")
        return loaded, unexpected

    def set_max_positions(self, n: int) -> None:
        self.midlayer.self_attn.rotary.cover(n)

    def forward(self, fb: ForwardBatch, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds [T, h]; hidden [T, 3*h_target] (target's captured layers) or [T, h] (previous draft step)
        -> the head's pre-norm output [T, h] (the next step's hidden)."""
        hidden = hidden if hidden.dtype == embeds.dtype else hidden.to(embeds.dtype)
        if hidden.shape[-1] == 3 * self.target_hidden_size:
            hidden = self.fc(hidden)
        return self.midlayer(embeds, hidden, fb)

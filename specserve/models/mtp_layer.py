"""MiMo multi-token-prediction (MTP) layer: the draft network that ships inside a ``MiMoForCausalLM`` checkpoint.

Checkpoint names, under ``model.mtp_layers.{i}.``: ``token_layernorm.weight`` [h], ``hidden_layernorm.weight`` [h],
``input_proj.weight`` [h, 2h] (no bias), a Qwen2 decoder layer (``input_layernorm``, ``self_attn.{q,k,v}_proj``
with bias, ``self_attn.o_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``) and
``final_layernorm.weight`` [h]. The decoder-layer tensors sit directly under the prefix (no sub-module name), so
this module IS the decoder layer plus the four extra tensors, and its parameter names are the checkpoint's.

Computation at position i (the EAGLE shift: the token is the one at i + 1, the hidden is the target's at i):

    x   = input_proj(cat(hidden_layernorm(target_hidden_i), token_layernorm(embed(token_{i+1}))))  # hidden first
    out = final_layernorm(decoder_layer(x))          # -> the target's LM head gives the draft distribution

``target_hidden`` is the target's last hidden state AFTER its final norm (the LM head's input), and a second draft
step feeds ``out`` back in its place (the same layer applied again). The token embedding at position 0 is zeroed
(SGLang and vLLM do this: the MTP input at the first position is "not needed"). Embedding and LM head are the
target's.
"""

from __future__ import annotations

import torch

from specserve.attention import ForwardBatch
from specserve.models.direct_call import Linear
from specserve.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from specserve.models.spec import ModelSpec


class MtpLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec) -> None:
        h, eps = spec.hidden_size, spec.rms_norm_eps
        rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)
        super().__init__(spec, 0, rotary)  # attention layer 0 of the proposer's own one-layer KV pool
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, eps)

    def set_max_positions(self, n: int) -> None:
        self.self_attn.rotary.cover(n)

    def fuse_inputs(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions [T], token embeddings [T, h], target (or previous draft) hidden [T, h] -> layer input [T, h]."""
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        return self.input_proj(torch.cat([self.hidden_layernorm(hidden.to(embeds.dtype)),
                                          self.token_layernorm(embeds)], dim=-1))

    def forward(self, fb: ForwardBatch, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds [T, h] of the input tokens, hidden [T, h] -> MTP hidden [T, h] (after final_layernorm)."""
        x = self.fuse_inputs(fb.positions, embeds, hidden)
        return self.final_layernorm(super().forward(x, fb.positions, fb))

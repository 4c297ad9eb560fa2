"""EAGLE-1/2 draft head (checkpoint architecture ``LlamaForCausalLMEagle``, Qwen2 twin ``Qwen2ForCausalLMEagle``).

Network: ``fc(cat(embed(token), target_hidden))`` -> one Llama decoder layer whose input norm is the identity
-> output hidden. The output hidden is (a) fed to the TARGET's LM head for the draft distribution (no final
norm) and (b) the hidden input of the next draft step. Embedding and LM head are the target's; a checkpoint's own
``embed_tokens`` copy is ignored.

Checkpoint names (no ``model.`` prefix; one is stripped if present): ``fc.weight`` [h, 2h], optional ``fc.bias``
[h], ``layers.0.self_attn.{q,k,v,o}_proj.*``, ``layers.0.mlp.{gate,up,down}_proj.*``,
``layers.0.post_attention_layernorm.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from specserve.attention import ForwardBatch
from specserve.models.direct_call import Linear
from specserve.models.layers import DecoderLayer, RotaryEmbedding
from specserve.models.spec import ModelSpec
from specserve.models.weights import CheckpointLoadable


class EagleHead(CheckpointLoadable):
    qkv_bias: bool | None = None  # None: the config's attention_bias (Llama); True for the Qwen2 twin

    @classmethod
    def spec_from_config(cls, cfg: dict) -> ModelSpec:
        return ModelSpec.from_config(cfg, qkv_bias=cls.qkv_bias)

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = Linear(2 * h, h, bias=True)
        rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)
        self.layers = nn.ModuleList([DecoderLayer(spec, 0, rotary)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's layer 0 has no input norm

    def optional_weights(self) -> set[str]:
        return {"fc.bias"}

    def skip_checkpoint_tensor(self, name: str) -> bool:
        return super().skip_checkpoint_tensor(name) or name.startswith(("embed_tokens.", "lm_head."))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set, list[str]]:
        return super().load_weights((n.removeprefix("model."), t) for n, t in weights)

    def set_max_positions(self, n: int) -> None:
        self.layers[0].self_attn.rotary.cover(n)

    def forward(self, fb: ForwardBatch, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds [T, h] of the input tokens, hidden [T, h] target (or previous draft) hidden -> [T, h]."""
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        return self.layers[0](x, fb.positions, fb)


class Qwen2EagleHead(EagleHead):
    qkv_bias = True


EAGLE_HEADS: dict[str, type[EagleHead]] = {
    "LlamaForCausalLMEagle": EagleHead,
    "Qwen2ForCausalLMEagle": Qwen2EagleHead,
}

"""Gemma (``GemmaForCausalLM``, Gemma 1): the Llama network with these differences.

- The MLP gate activation is GELU with the tanh approximation. The config names it in ``hidden_activation`` or, when
  that is absent, in ``hidden_act``, where the released checkpoints' ``"gelu"`` means the tanh approximation.
- The token embeddings are multiplied by sqrt(hidden_size), a factor first rounded to the model's dtype (55.4256 is
  55.5 in bfloat16 for hidden_size 3072). ``embed`` still returns the unscaled table rows.
- Every RMSNorm scales by ``1 + weight`` (the checkpoints store the offset from 1) and multiplies in float32 before
  casting back.
- ``tie_word_embeddings`` and ``head_dim`` default to transformers' GemmaConfig values (True, 256), since the released
  configs leave out the first. ``head_dim`` need not be hidden_size / num_attention_heads.

The shared decoder layer, attention, rotary embedding and weight loading are Llama's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention import ForwardBatch
from specserve.models.layers import ACTIVATIONS, RMSNorm
from specserve.models.llama import DecoderModel, LlamaForCausalLM
from specserve.models.spec import ModelSpec, UnsupportedModelError

# transformers' GemmaConfig defaults where they differ from what ModelSpec assumes for a missing field
CONFIG_DEFAULTS = {"tie_word_embeddings": True, "head_dim": 256, "max_position_embeddings": 8192}
LEGACY_GELU = "gelu"  # in ``hidden_act`` of a Gemma config: the tanh approximation


def gemma_activation(cfg: dict) -> str:
    """The MLP activation named by a Gemma config -> a key of ACTIVATIONS."""
    field = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    name = cfg.get(field) or "gelu_pytorch_tanh"
    if field == "hidden_act" and name == LEGACY_GELU:
        return "gelu_pytorch_tanh"
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"Gemma config field {field} = {name!r} is not supported "
                                    f"(supported: {', '.join(sorted(ACTIVATIONS))}; hidden_act also 'gelu')")
    return name


class GemmaRMSNorm(RMSNorm):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))  # the scale is 1 + weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return F.rms_norm(x.float(), self.shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)


class GemmaModel(DecoderModel):
    norm_cls = GemmaRMSNorm

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        normalizer = torch.tensor(spec.hidden_size**0.5, dtype=torch.float32, device="cpu")
        self.normalizer = {dt: normalizer.to(dt).item() for dt in (torch.float32, torch.float16, torch.bfloat16)}

    def input_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        x = super().input_hidden(fb)
        return x * self.normalizer[x.dtype]


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel

    @classmethod
    def spec_from_config(cls, cfg: dict) -> ModelSpec:
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("Gemma config field use_bidirectional_attention = true is not supported "
                                        "(specserve runs causal decoders only)")
        cfg = {**CONFIG_DEFAULTS, **cfg}
        return ModelSpec.from_config(cfg, qkv_bias=cls.qkv_bias, qk_norm=cls.qk_norm,
                                     hidden_act=gemma_activation(cfg))

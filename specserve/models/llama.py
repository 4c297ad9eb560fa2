"""Llama-family decoder (Llama 2/3/3.1, Mistral-style configs) and the shared CausalLM machinery.

Qwen2 and Qwen3 are the same network with q/k/v bias or per-head q/k norms; they subclass this. Gemma subclasses
``DecoderModel`` too (its norm class and its scaling of the token embeddings) and names it in ``model_cls``.
Parameter names follow the HF checkpoints (``model.layers.{i}.self_attn...``) except the fused
``qkv_proj`` and ``gate_up_proj``, which ``load_weights`` fills from the separate checkpoint tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specserve.attention import ForwardBatch
from specserve.models.direct_call import DirectCall, Linear
from specserve.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding, vocab_embedding
from specserve.models.spec import ModelSpec
from specserve.models.tensor_parallel import building_group, vocab_share
from specserve.models.weights import CheckpointLoadable


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [R, V] float32 for fb.logits_indices (all rows when None)
    hidden: torch.Tensor  # [T, h] final hidden state (after the last norm), the LM head's input
    aux_hidden: list[torch.Tensor] = field(default_factory=list)  # [T, h] each, per fb.capture_layers


class DecoderModel(DirectCall):
    norm_cls: type[RMSNorm] = RMSNorm  # the layers' norms and the final norm

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(spec.vocab_size, spec.hidden_size)
        rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, rotary, self.norm_cls) for i in range(spec.num_layers))
        self.norm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps)

    def input_hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """The first layer's input [T, h]: the token embeddings (fb.input_embeds in their place when given)."""
        return self.embed_tokens(fb.input_ids) if fb.input_embeds is None else fb.input_embeds

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> (final hidden [T, h], residual stream at the input of each layer in fb.capture_layers).

        A capture id equal to num_layers means the output of the last layer (before the final norm).
        """
        x = self.input_hidden(fb)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in fb.capture_layers:
                captured[i] = x
            x = layer(x, fb.positions, fb)
        if len(self.layers) in fb.capture_layers:
            captured[len(self.layers)] = x
        return self.norm(x), [captured[i] for i in fb.capture_layers]


class LlamaForCausalLM(CheckpointLoadable):
    qkv_bias: bool | None = None  # None: read `attention_bias` from the config
    qk_norm: bool = False
    model_cls: type[DecoderModel] = DecoderModel

    @classmethod
    def spec_from_config(cls, cfg: dict) -> ModelSpec:
        return ModelSpec.from_config(cfg, qkv_bias=cls.qkv_bias, qk_norm=cls.qk_norm)

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = self.model_cls(spec)
        # tensor parallelism (specserve.parallel): this rank's rows of the (padded) vocabulary
        self.tp = tp = building_group()
        self.vocab_rows = vocab_share(spec.vocab_size, tp)
        self.lm_head = Linear(spec.hidden_size, self.vocab_rows[1] - self.vocab_rows[0], bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, fb: ForwardBatch) -> ModelOutput:
        """-> logits (None on the ranks other than the first under tensor parallelism), hidden states."""
        hidden, aux = self.model(fb)
        rows = hidden if fb.logits_indices is None else hidden.index_select(0, fb.logits_indices)
        return ModelOutput(self.local_logits(rows), hidden, aux)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[R, h] -> [R, V] float32; under tensor parallelism every rank's vocabulary rows gathered on rank 0 (None on
        the others), which every rank must call together."""
        logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        full = self.tp.gather_columns(logits)
        return None if full is None else full[:, : self.spec.vocab_size]

    def local_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def tp_rules(self) -> dict:
        return {} if self.spec.tie_word_embeddings else {("lm_head.weight", -1): (0, *self.vocab_rows)}

    def set_max_positions(self, n: int) -> None:
        """Size the RoPE table for positions up to n (e.g. a --context-length above the config's)."""
        self.model.layers[0].self_attn.rotary.cover(n)  # one rotary module is shared by all layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, h]: rows of the embedding table (before ``input_hidden``'s scaling, if the model has one):
        the token embeddings draft heads take, and a tied LM head's rows. Called by rank 0 alone (drafters): under
        tensor parallelism it brings the other ranks in first (``ranks.Leader``)."""
        if self.tp is not None:
            self.tp.link.announce("embed", input_ids)
        return self.local_embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, h] -> [R, V] float32, called by rank 0 alone (drafters, prompt logprobs), as ``embed``."""
        if self.tp is not None:
            self.tp.link.announce("logits", hidden)
        return self.local_logits(hidden)

    # ---------------------------------------------------------------- weights
    def skip_checkpoint_tensor(self, name: str) -> bool:
        return super().skip_checkpoint_tensor(name) or (name == "lm_head.weight" and self.spec.tie_word_embeddings)

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

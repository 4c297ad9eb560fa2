"""MiMo (``MiMoForCausalLM``): a Qwen2 network plus ``num_nextn_predict_layers`` multi-token-prediction layers.

The target forward is plain Qwen2 and never runs the MTP layers; they are loaded with the model (their tensors
``model.mtp_layers.{i}.*`` are part of the checkpoint, see ``specserve.models.mtp_layer``) and kept for the MTP
proposer (``--speculative-algorithm EAGLE`` without a draft path). A checkpoint whose config announces MTP layers
but ships none of their tensors still loads as a plain target (the MTP layers are dropped, with a warning); one
that ships only part of them fails to load, like any checkpoint missing weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from specserve.models.mtp_layer import MtpLayer
from specserve.models.qwen2 import Qwen2ForCausalLM
from specserve.models.spec import ModelSpec
from specserve.models.tensor_parallel import sharding

logger = logging.getLogger(__name__)

MTP_PREFIX = "model.mtp_layers."


def num_mtp_layers(cfg: dict) -> int:
    """MTP layers a raw config.json announces (``num_nextn_predict_layers``, 0 when absent)."""
    return int(cfg.get("num_nextn_predict_layers") or 0)


class MiMoForCausalLM(Qwen2ForCausalLM):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        with sharding(None):  # the MTP drafter runs whole, on rank 0, under tensor parallelism
            self.model.mtp_layers = nn.ModuleList(MtpLayer(spec) for _ in range(num_mtp_layers(spec.raw)))

    @property
    def mtp_layers(self) -> nn.ModuleList:
        """The loaded MTP layers (empty when the config has none or the checkpoint shipped none)."""
        return self.model.mtp_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set, list[str]]:
        loaded, unexpected = super().load_weights(weights)
        if len(self.mtp_layers) and not any(name.startswith(MTP_PREFIX) for name, _ in loaded):
            logger.warning("config.json announces %d MTP layer(s) but the checkpoint has no %s* tensors: "
                           "loaded as a plain Qwen2 target (no MTP drafting)", len(self.mtp_layers), MTP_PREFIX)
            self.model.mtp_layers = nn.ModuleList()  # nothing of it is expected any more
        return loaded, unexpected

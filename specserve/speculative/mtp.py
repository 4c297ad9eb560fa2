"""MTP proposer: a MiMo-style target drafts with its own multi-token-prediction layer.

Selected by ``EagleProposer.select`` when ``--speculative-algorithm EAGLE`` (or NEXTN) is given WITHOUT
``--speculative-draft-model-path`` and the target config has ``num_nextn_predict_layers > 0`` (SGLang serves MiMo
this way). Everything but the head is EAGLE-2's machinery (``EagleProposer``): the MTP layer consumes the same
inputs as an EAGLE head (the target's post-norm hidden state at position i and the token at i + 1, KV in the
proposer's one-layer pool at the target's slot indices), its output goes through the target's LM head, and
``num_steps > 1`` re-applies the same layer to its own output hidden, as SGLang does for MTP. Only the first MTP
layer drafts (MiMo ships one).
"""

from __future__ import annotations

import logging

import torch

from specserve.attention import ForwardBatch
from specserve.cache.kv_pool import KVPool
from specserve.flags import ConfigError
from specserve.models.loader import dtype_name
from specserve.platform import PlatformPolicy
from specserve.speculative.base import DraftMemory
from specserve.speculative.eagle import EagleProposer

logger = logging.getLogger(__name__)


class MtpProposer(EagleProposer):
    def _load_head(self, args):
        """The MTP layer is part of the TARGET's checkpoint and was loaded (and packed for CPU) with it."""
        layers = getattr(self.target, "mtp_layers", None)
        if not layers:
            raise ConfigError(
                f"--speculative-draft-model-path is required: the target ({self.runner.spec.architecture}) has no "
                "loaded MTP layers to draft with (num_nextn_predict_layers is 0 or its model.mtp_layers.* tensors "
                "are missing)"
            )
        if len(layers) > 1:
            logger.info("the target has %d MTP layers; drafting re-applies the first one", len(layers))
        self.draft_dtype = self.runner.dtype
        if args.speculative_draft_dtype not in ("auto", dtype_name(self.draft_dtype)):
            logger.warning("--speculative-draft-dtype %s is ignored with MTP: the MTP layer is part of the target "
                           "and runs in its dtype", args.speculative_draft_dtype)
        return layers[0], self.runner.spec

    @classmethod
    def memory_cost(cls, args, target_spec, target_dtype: torch.dtype, platform: PlatformPolicy) -> DraftMemory:
        """The MTP layer's weights are the target's (already counted); its KV pool has one layer of the target's
        shape, in the target's dtype."""
        return DraftMemory(0, KVPool.bytes_per_token(1, target_spec.num_kv_heads, target_spec.head_dim, target_dtype))

    def _forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Tokens fb.input_ids [T] + target (or previous MTP) hidden [T, h] -> MTP hidden [T, h], final-normed."""
        return self.head(fb, self.target.embed(fb.input_ids), hidden)

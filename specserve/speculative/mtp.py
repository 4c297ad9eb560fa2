"""MTP proposer: a MiMo-style target drafts with its own multi-token-prediction layer.

Selected by ``EagleProposer.select`` when ``--speculative-algorithm EAGLE`` (or NEXTN) is given WITHOUT
``--speculative-draft-model-path`` and the target config has ``num_nextn_predict_layers > 0`` (SGLang serves MiMo
this way). It is the EAGLE-2 tree drafter (``EagleProposer``) with the MTP layer as its draft model
(``draft_models.MtpDraft``: the layer consumes an EAGLE head's inputs, keeps its KV in a one-layer pool at the
target's slot indices, runs in the target's dtype and drafts through the target's LM head; ``num_steps > 1``
re-applies it to its own output hidden). Only the first MTP layer drafts (MiMo ships one).
"""

from __future__ import annotations

from specserve.speculative.draft_models import MtpDraft
from specserve.speculative.eagle import EagleProposer


class MtpProposer(EagleProposer):
    draft_model = MtpDraft

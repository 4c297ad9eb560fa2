"""STANDALONE proposer (``--speculative-algorithm STANDALONE``): a smaller causal LM with the target's tokenizer
drafts the tree, with its own KV cache (same slot indices as the target).

It is the EAGLE-2 tree drafter (``EagleProposer``) with the LM as its draft model (``draft_models.StandaloneDraft``:
the tokenizer check, one KV layer per LM layer, every token at its own position so the root sits at
``root_offset = 1``, and catch-up extends that end at the new root, whose draft KV goes to a slot the drafter holds
until the next step). What is left here are the algorithm's start-up rules: a draft path is required and the
default tree is SGLang's for a standalone draft.
"""

from __future__ import annotations

from specserve.speculative.draft_models import StandaloneDraft
from specserve.speculative.eagle import EagleProposer


class StandaloneProposer(EagleProposer):
    draft_model = StandaloneDraft
    needs_draft_model = True

    @classmethod
    def default_tree(cls, args, architecture: str) -> tuple[int, int, int]:
        return 3, 1, 4  # SGLang's default for a standalone draft, whatever the target

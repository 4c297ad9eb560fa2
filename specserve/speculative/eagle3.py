"""EAGLE-3 proposer (``--speculative-algorithm EAGLE3``): the EAGLE-2 tree drafter of ``eagle.py`` with the EAGLE-3
head as its draft model (``draft_models.Eagle3HeadDraft``: the target captures its residual stream at three layers
in every prefill and verify forward and the head reads their concatenation; its own final norm and LM head over a
draft vocabulary whose ids map to target ids with ``d2t``).

What is left here are the algorithm's start-up rules: a draft path is required, ``--speculative-token-map`` is
dropped (the head has its own draft vocabulary), and the bundled demo head gets its own default tree.
"""

from __future__ import annotations

import logging
import os

from specserve.speculative.draft_models import Eagle3HeadDraft
from specserve.speculative.eagle import EagleProposer

logger = logging.getLogger(__name__)


#: The default draft tree (steps, topk, draft tokens) of the bundled demo EAGLE-3 head (``demo-eagle3``), chosen
#: with ``specserve bench-speculative`` (docs/benchmarks.md): deeper and narrower than SGLang's Llama default
#: (5, 4, 8), it verified 5.15 against 4.18 tokens a step on the held-out prompts at batch 1 (greedy) and ran 1.98x
#: against 1.84x plain decoding in the same interleaved run. Any other head keeps the architecture's default.
DEMO_EAGLE3_TREE = (8, 3, 12)


def is_demo_eagle3(path: str | None) -> bool:
    """True when a draft path names the bundled demo EAGLE-3 head (``demo-eagle3`` or its folder)."""
    from specserve.demo_models import demo_path, resolve_demo

    if not path:
        return False
    return os.path.realpath(resolve_demo(path)) == os.path.realpath(demo_path("demo-eagle3"))


class Eagle3Proposer(EagleProposer):
    draft_model = Eagle3HeadDraft
    needs_draft_model = True

    @classmethod
    def check_args(cls, args) -> None:
        super().check_args(args)
        if args.speculative_token_map:
            logger.warning("--speculative-token-map is ignored with EAGLE3 (its head has its own draft vocabulary)")
            args.speculative_token_map = None

    @classmethod
    def default_tree(cls, args, architecture: str) -> tuple[int, int, int]:
        if cls._deep_default(args, architecture) and is_demo_eagle3(args.speculative_draft_model_path):
            return DEMO_EAGLE3_TREE
        return super().default_tree(args, architecture)

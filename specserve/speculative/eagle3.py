"""EAGLE-3 proposer (``--speculative-algorithm EAGLE3``): the EAGLE-2 tree drafter of ``eagle.py`` with the EAGLE-3
head as its draft model (``draft_models.Eagle3HeadDraft``: the target captures its residual stream at three layers
in every prefill and verify forward and the head reads their concatenation; its own final norm and LM head over a
draft vocabulary whose ids map to target ids with ``d2t``).

What is left here are the algorithm's start-up rules: a draft path is required, ``--speculative-token-map`` is
dropped (the head has its own draft vocabulary), and the bundled heads get their own default trees.
"""

from __future__ import annotations

import logging
import os

from specserve.devices import runs_on_cpu
from specserve.speculative.draft_models import Eagle3HeadDraft
from specserve.speculative.eagle import EagleProposer

logger = logging.getLogger(__name__)


#: The default draft tree (steps, topk, draft tokens) of the bundled demo EAGLE-3 head (``demo-eagle3``), chosen
#: with ``specserve bench-speculative`` (docs/benchmarks.md): deeper and narrower than SGLang's Llama default
#: (5, 4, 8), it verified 5.15 against 4.18 tokens a step on the held-out prompts at batch 1 (greedy) and ran 1.98x
#: against 1.84x plain decoding in the same interleaved run. Any other head keeps the architecture's default.
DEMO_EAGLE3_TREE = (8, 3, 12)
#: The same for SmolLM2's bundled head (``smollm2-eagle3``) on its held-out requests (bf16, batch 1): 2.04 tokens a
#: step, with two draft forwards fewer than (5, 4, 8) (2.07); the trees' speeds were within one run's spread
#: (docs/training.md; a Xeon with AMX, whose tile unit takes 8 rows for about what one costs).
SMOLLM2_EAGLE3_TREE = (3, 4, 8)
#: ...but where a bf16 verify forward's linears run on the few-row kernel's vector loop (AVX512-BF16 without the tile
#: unit: passes of up to 6 rows, small_gemm.cpp), 6 nodes take one pass over SmolLM2's weights and 8 take two: on a
#: 2-core AMD EPYC (3, 4, 6) ran 1.07x and 1.10x (3, 4, 8) at batch 1, accept length 2.00 against 2.11
#: (docs/benchmarks.md, "The default model").
SMOLLM2_EAGLE3_ONE_PASS_TREE = (3, 4, 6)
BUNDLED_TREES = {"demo-eagle3": DEMO_EAGLE3_TREE, "smollm2-eagle3": SMOLLM2_EAGLE3_TREE}


def verify_on_vector_loop(args) -> bool:
    """Whether a bf16 target's verify forwards would run their linears on the few-row kernel's vector loop here: a
    CPU run (``--device`` cpu, or auto without CUDA) in bf16 (``--dtype`` bfloat16, or auto: SmolLM2's folder is
    bf16) where the kernel runs and the tile unit does not."""
    from specserve.platform.cpu import small_gemm

    bf16 = args.dtype in ("auto", "bfloat16")
    return runs_on_cpu(args.device) and bf16 and small_gemm.available() and not small_gemm.amx_runs()


def bundled_tree(head: str, args) -> tuple[int, int, int]:
    """The default tree of a bundled head (``BUNDLED_TREES``), SmolLM2's one-pass tree where its verify forwards run
    on the vector loop (``verify_on_vector_loop``)."""
    if head == "smollm2-eagle3" and verify_on_vector_loop(args):
        return SMOLLM2_EAGLE3_ONE_PASS_TREE
    return BUNDLED_TREES[head]


def bundled_head(path: str | None) -> str | None:
    """The bundled EAGLE-3 head a draft path names (by name or folder: "demo-eagle3", "smollm2-eagle3"), else
    None."""
    from specserve.demo_models import demo_path, resolve_demo

    if not path:
        return None
    real = os.path.realpath(resolve_demo(path))
    return next((name for name in BUNDLED_TREES if real == os.path.realpath(demo_path(name))), None)


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
        head = bundled_head(args.speculative_draft_model_path)
        if cls._deep_default(args, architecture) and head is not None:
            return bundled_tree(head, args)
        return super().default_tree(args, architecture)

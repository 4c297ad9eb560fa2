"""EAGLE-3 proposer (``--speculative-algorithm EAGLE3``): the EAGLE-2 tree drafting of ``eagle.py`` with the
EAGLE-3 head (``heads/eagle3.py``).

Differences from EAGLE-1/2, all behind the proposer's hooks:
- the target captures its residual stream at three layers in every prefill and verify forward, and the head reads
  their concatenation [T, 3h] (through its ``fc``) instead of the final hidden state;
- the head has its own final norm and LM head over a draft vocabulary; draft ids map to target ids with ``d2t``.
Capture layers: the config's ``eagle_aux_hidden_state_layer_ids`` are layer OUTPUTS (= inputs of id + 1);
by default the inputs of layers [2, L // 2, L - 3] (SGLang's choice), clamped into the target's 0..L range.
"""

from __future__ import annotations

import logging
import os

import torch

from specserve.flags import ConfigError
from specserve.speculative.eagle import EagleProposer
from specserve.speculative.heads.eagle3 import Eagle3Head

logger = logging.getLogger(__name__)


def eagle3_capture_layers(num_layers: int, aux_layer_ids: list[int] | None) -> tuple[int, ...]:
    """Target layers to capture (at their input; id == num_layers means the last layer's output)."""
    if aux_layer_ids is not None:
        wanted = [i + 1 for i in aux_layer_ids]
    else:
        wanted = [2, num_layers // 2, num_layers - 3]
    clamped = tuple(min(max(i, 0), num_layers) for i in wanted)
    if clamped != tuple(wanted):
        logger.warning("EAGLE-3 capture layers %s clamped to %s for a %d-layer target", wanted, clamped, num_layers)
    return clamped


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
    head_registry = {"LlamaForCausalLMEagle3": Eagle3Head}
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

    def __init__(self, args, runner, kv) -> None:
        super().__init__(args, runner, kv)
        self.capture_layers = eagle3_capture_layers(runner.spec.num_layers, self.head.aux_layer_ids())
        head_vocab = self.head.draft_vocab_size
        self.d2t_ids = None  # [Vd] target id of each draft id; None = the identity (no gather per draft level)
        if head_vocab:
            ids = torch.arange(head_vocab, device=self.device) + self.head.d2t  # [Vd] target ids
            if int(ids.max()) >= runner.spec.vocab_size or int(ids.min()) < 0:
                raise ConfigError(
                    "--speculative-draft-model-path: the EAGLE-3 head's d2t maps draft ids outside the target "
                    f"vocabulary of {runner.spec.vocab_size}"
                )
            if bool(self.head.d2t.any()):  # an all-zero d2t: the target's vocabulary in the target's order
                self.d2t_ids = ids
            # a d2t sending two draft ids to one target id would give a node two children with one token: merged
            self.distinct_ids = int(torch.unique(ids).numel()) == ids.numel()
        logger.info("EAGLE-3 head: capture layers %s, draft vocabulary %s", self.capture_layers,
                    head_vocab or "= target's")

    def _check_head(self, head, spec) -> None:
        if head.target_hidden_size != self.runner.spec.hidden_size:
            raise ConfigError(
                f"--speculative-draft-model-path: the EAGLE-3 head expects target_hidden_size "
                f"{head.target_hidden_size}, the target has {self.runner.spec.hidden_size}"
            )

    def _target_hidden(self, out, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat(out.aux_hidden, dim=-1).index_select(0, rows)  # [R, 3h]

    def _draft_logits(self, draft_hidden: torch.Tensor):
        normed = self.head.norm(draft_hidden)
        if self.head.lm_head is None:
            return self.target.compute_logits(normed.to(self.runner.dtype)), None
        return self.head.lm_head(normed).float(), self.d2t_ids

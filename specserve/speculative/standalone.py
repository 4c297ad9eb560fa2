"""STANDALONE proposer (``--speculative-algorithm STANDALONE``): a smaller causal LM with the target's tokenizer
drafts the tree, with its own KV cache (same slot indices as the target).

Unlike the EAGLE shift, the draft model sees every token at its own position, the first token (BOS) included, as
the draft model was trained (SGLang instead feeds a standalone draft the EAGLE-shifted sequence, which hides the
first token from it). The cost is one extra token of draft compute per step:
- the draft's KV at position i holds token i. After a prefill or a verify step, one draft extend covers the newly
  committed positions AND the new root, whose draft KV goes to a slot the proposer holds until the next step
  (the target has no slot for the root yet); the extend's output at the root gives the first draft level;
- the next extend recomputes the root at its committed slot and the held slot is freed.
Drafting levels 1 .. S-1 are EAGLE's tree loop (``EagleProposer._draft_levels``) with ``root_offset = 1``.
"""

from __future__ import annotations

import logging

import torch

from specserve.models.registry import MODEL_REGISTRY
from specserve.speculative.base import PrefillChunk, VerifiedStep
from specserve.speculative.eagle import EagleProposer
from specserve.speculative.token_map import HotVocabHead

logger = logging.getLogger(__name__)


def check_same_tokenizer(target_dir: str, draft_dir: str, tokenizer_path: str | None, trust_remote_code: bool):
    """A standalone draft must tokenize exactly like the target: same token -> id map (special tokens included)."""
    from transformers import AutoTokenizer

    from specserve.flags import ConfigError

    def vocab(path: str) -> dict[str, int]:
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code).get_vocab()
        except Exception as e:  # noqa: BLE001 - any loading failure is reported the same way
            raise ConfigError(f"--speculative-draft-model-path: cannot load the draft's tokenizer: {e}") from e

    target, draft = vocab(tokenizer_path or target_dir), vocab(draft_dir)
    if target != draft:
        differing = sum(1 for tok, i in target.items() if draft.get(tok) != i) + len(set(draft) - set(target))
        raise ConfigError(
            f"--speculative-draft-model-path: the draft's tokenizer differs from the target's ({differing} tokens "
            f"differ; vocabularies of {len(draft)} and {len(target)}); STANDALONE needs the same tokenizer"
        )


class StandaloneProposer(EagleProposer):
    head_registry = MODEL_REGISTRY
    needs_draft_model = True
    root_offset = 1
    half_precision_calls = False  # a full LM drafter keeps float32 throughout (its own embedding, per-layer KV)

    @classmethod
    def default_tree(cls, args, architecture: str) -> tuple[int, int, int]:
        return 3, 1, 4  # SGLang's default for a standalone draft, whatever the target

    @classmethod
    def kv_layers(cls, draft_spec) -> int:
        return draft_spec.num_layers

    def _check_head(self, head, spec) -> None:
        target_vocab = self.runner.spec.vocab_size
        if spec.vocab_size != target_vocab:  # e.g. Qwen2.5 0.5B vs 7B: same tokenizer, padded differently
            logger.info("draft vocab_size %d != target's %d: drafts are limited to the shared ids",
                        spec.vocab_size, target_vocab)
        check_same_tokenizer(self.runner.model_dir, self.head_dir, self.args.tokenizer_path,
                             self.args.trust_remote_code)

    def draft_slots_per_request(self) -> int:
        return self.topk * (self.steps - 1) + 1  # tree scratch + the held root slot

    def draft_modules(self) -> list:
        return [self.head.model]  # the decoder stack (forward(fb)); the LM head runs on the kept rows only

    def _forward(self, fb, hidden) -> torch.Tensor:
        return self.head.model(fb)[0]  # final (normed) hidden [T, h]; no logits for rows we do not sample

    def _make_hot_head(self, path: str) -> HotVocabHead:
        return HotVocabHead.for_model(path, self.head, self.head_dir, self.head_spec, self.device, self.draft_dtype,
                                      min_size=self.topk, platform=self.platform)

    def _draft_logits(self, draft_hidden: torch.Tensor):
        if self.hot_head is not None:
            return self.hot_head(draft_hidden)
        logits = self.head.compute_logits(draft_hidden)  # [R, Vd]
        return logits[:, : self.runner.spec.vocab_size], None

    def _target_hidden(self, out, rows):
        return None

    # ------------------------------------------------------------------ catching up
    def _extend_with_root(self, reqs, starts: list[int], tokens: list[list[int]], with_root: list[bool]) -> None:
        """Extend over tokens[b] from position starts[b]; where with_root[b], the last token is the root and its KV
        goes to a freshly held slot; those requests get a new DraftState."""
        rooted = [r for r, w in zip(reqs, with_root, strict=True) if w]
        held = self.kv.alloc(len(rooted)) if rooted else None
        if rooted and held is None:
            raise RuntimeError("no KV slot for the draft's root (the scheduler should have reserved it)")
        table = self.kv.table
        for i, req in enumerate(rooted):
            table[req.req_pool_idx, req.seq_len - 1] = held[i]
        last = self._extend(reqs, starts, tokens, None)
        keep = [i for i, w in enumerate(with_root) if w]
        if keep:
            self._store_states(rooted, last[keep])
            for i, req in enumerate(rooted):
                req.spec_state.root_slot = held[i : i + 1]

    def after_prefill(self, chunks: list[PrefillChunk], out) -> None:
        chunks = [c for c in chunks if not c.req.finished]
        if not chunks:
            return
        tokens = [c.req.fill_ids[c.start : c.start + c.length + (1 if c.completed else 0)] for c in chunks]
        self._extend_with_root([c.req for c in chunks], [c.start for c in chunks], tokens,
                               [c.completed for c in chunks])

    def after_verify(self, steps: list[VerifiedStep], out) -> None:
        if not steps:
            return
        for s in steps:
            self._free_root_slot(s.req)
        tokens = [s.req.fill_ids[s.root_pos : s.root_pos + len(s.new_tokens) + 1] for s in steps]
        self._extend_with_root([s.req for s in steps], [s.root_pos for s in steps], tokens, [True] * len(steps))

    def _free_root_slot(self, req) -> None:
        state = req.spec_state
        if state is not None and state.root_slot is not None:
            self.kv.free(state.root_slot)
            state.root_slot = None

    def release(self, req) -> None:
        self._free_root_slot(req)
        super().release(req)

"""The EAGLE-2 tree drafter (``EagleProposer``) and ``--speculative-algorithm EAGLE`` (alias NEXTN): a draft network
fed the target's hidden states drafts a dynamic tree.

Which network drafts is a ``DraftModel`` (``draft_models.py``), named by the proposer class's ``draft_model``: an
EAGLE-1/2 head here, an EAGLE-3 head (``eagle3.py``), the target's own MTP layer (``mtp.py``, which ``select``
picks for EAGLE without a draft path) or a standalone causal LM (``standalone.py``). Those classes differ only in
their draft model and their start-up rules; the drafter owns the tree machinery, the draft KV pool (indexed by the
target's slots) and the per-request ``DraftState``, and asks the draft model for its forward, its logits, what a
catch-up extend covers and where the root's draft KV lives.

Draft KV layout (the EAGLE shift; a standalone LM instead sees each token at its own position, ``root_offset``
1): the draft's KV at position i is computed from the target's hidden state at i and the token at i + 1. So after
the target has produced its hidden states for positions [a, b) and the token at b is known, one draft *extend*
over [a, b) brings the draft up to date; its output at the last position gives the draft distribution for the
token after the root, i.e. the first level of the next tree (kept per request in a ``DraftState``).

Drafting one tree (``propose``), with S = num_steps, K = topk, N = num_draft_tokens:
  level 0: the stored top-K tokens (children of the root) with their probabilities;
  level j = 1 .. S-1: one draft forward over the K live branches of every request (tree attention over scratch
  KV slots: a branch sees the prefix and its own ancestors), top-K children each, the best K of the K*K by
  cumulative probability stay live (``EagleCandidates``);
  drafting stops before level S-1 once deeper levels cannot change the selected tree, or (with
  --speculative-draft-stop-threshold) once every best live path is less likely than the threshold
  (``drafting_can_stop``);
  then the best N-1 candidates + the root form the verify tree (``select_eagle_tree``).
After prefill and verification, ``after_prefill`` / ``after_verify`` run the draft extend the draft model describes
(``DraftModel.prefill_catch_up`` / ``verify_catch_up``: with the EAGLE shift, the accepted tokens with the
target's hidden states at the accepted nodes; the draft-tree KV written while drafting is scratch and is dropped).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention import ForwardBatch, ForwardMode, extend_batch, last_token_rows
from specserve.attention.sdpa import TreeKeys
from specserve.cache.kv_pool import KVPool
from specserve.flags import SPEC_V2_NAMES, ConfigError, flag_name, require_positive
from specserve.grammar.backend import new_bitmask
from specserve.grammar.masks import PathStates, allow_stops, ban_mask
from specserve.platform import PlatformPolicy
from specserve.speculative.base import GRAMMAR_ROOM, DraftMemory, PrefillChunk, Proposer, VerifiedStep
from specserve.speculative.batch_policy import TreeShape
from specserve.speculative.coupling import RaceBatch
from specserve.speculative.draft_models import CatchUp, DraftModel, EagleHeadDraft
from specserve.speculative.token_map import HotVocabHead
from specserve.speculative.tree import DraftTree, EagleCandidates, max_tree_nodes

logger = logging.getLogger(__name__)


@dataclass
class DraftState:
    """Per-request drafting state between steps (the draft's view just after the root token)."""

    # [K] float32 draft probabilities of the root's best children and [K] int64 their target token ids; None for a
    # request whose root children are ranked when it drafts (``ranks_root_when_drafting``)
    topk_p: torch.Tensor | None
    topk_ids: torch.Tensor | None
    hidden: torch.Tensor  # [h] draft hidden to feed with those children at the next draft level
    root_slot: torch.Tensor | None = None  # [1] a drafter's own KV slot for the root (STANDALONE), else None


#: an extend of this many rows or more runs a one-layer draft's layer past the K/V for its requests' last rows only
#: (``DraftModel.one_layer``, ``last_rows_only``)
KV_ONLY_MIN_ROWS = 32

#: Targets that get the deeper default draft tree (SGLang: (5, 4, 8) for Llama, else (3, 1, 4)).
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM")
TREE_FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


class EagleProposer(Proposer):
    """The tree drafter; ``draft_model`` is the network it drafts with (an EAGLE-1/2 head here)."""

    draft_model: type[DraftModel] = EagleHeadDraft

    def __init__(self, args, runner, kv) -> None:
        self.args, self.runner, self.kv = args, runner, kv
        self.target = runner.model
        self.device = runner.device
        self.platform = runner.platform
        self.steps = args.speculative_num_steps
        self.topk = args.speculative_eagle_topk
        self.num_draft_tokens = args.speculative_num_draft_tokens
        self.stop_threshold = args.speculative_draft_stop_threshold
        self.score_temperature = args.speculative_draft_score_temperature  # greedy requests' (see _score_scale)
        # sampled requests draft with their verification's race noise (``RaceBatch``) when verification is lossless
        self.couples = (args.speculative_accept_threshold_single == 1.0 and args.speculative_accept_threshold_acc == 1.0
                        and not args.disable_speculative_coupled_drafting)
        self.grammar_aware = not args.disable_grammar_aware_drafting  # draft only what a request's grammar allows
        self._columns: tuple[torch.Tensor, np.ndarray] | None = None  # ``_draft_columns``' conversion
        self.one_call_rankings = 0  # draft rows ranked by the draft's one-call ``topk`` (tests read it)
        self.one_call_trees = 0  # trees whose levels the draft's ``levels`` drafted in one call (tests read it)
        self.draft = self.draft_model(args, runner, self.topk)
        self.draft.module.set_max_positions(runner.context_len + self.max_positions_ahead() + 8)
        spec = self.draft.spec
        self.kv_pool = KVPool(  # the draft's own KV, indexed by the same slots as the target's
            self.draft.kv_layers(spec), runner.max_total_tokens, spec.num_kv_heads, spec.head_dim,
            self.draft.kv_dtype, self.device, self.platform.kv_store(),
        )

    # ------------------------------------------------------------------ the draft model's, as the proposer's
    @property
    def head(self):
        """The draft network (an EAGLE head, the MTP layer or the standalone LM)."""
        return self.draft.module

    @property
    def head_spec(self):
        return self.draft.spec

    @property
    def hot_head(self) -> HotVocabHead | None:
        return self.draft.hot_head

    @property
    def draft_dtype(self) -> torch.dtype:
        return self.draft.dtype

    @property
    def half_dtype(self) -> torch.dtype | None:
        return self.draft.half_dtype

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.draft.capture_layers

    @property
    def distinct_ids(self) -> bool:
        return self.draft.distinct_ids

    @property
    def d2t_ids(self) -> torch.Tensor | None:
        return self.draft.d2t_ids

    @property
    def root_offset(self) -> int:
        return self.draft.root_offset

    # ------------------------------------------------------------------ start-up rules
    @classmethod
    def check_args(cls, args) -> None:
        """S, K, N: all three or none (then ``default_tree`` at load time); N within what S levels of K can draft;
        the overlap scheduler drafts chains only (K = 1)."""
        super().check_args(args)
        given = [getattr(args, n) is not None for n in TREE_FLAGS]
        if any(given) and not all(given):
            missing = ", ".join(flag_name(n) for n, g in zip(TREE_FLAGS, given, strict=True) if not g)
            raise ConfigError(
                f"{missing}: give --speculative-num-steps, --speculative-eagle-topk and "
                "--speculative-num-draft-tokens together, or none of them"
            )
        if args.enable_spec_v2 and args.speculative_eagle_topk is not None and args.speculative_eagle_topk > 1:
            raise ConfigError(
                f"--speculative-eagle-topk {args.speculative_eagle_topk}: the overlap scheduler ({SPEC_V2_NAMES}) "
                "supports topk 1 only; use --speculative-eagle-topk 1 or turn the overlap scheduler off"
            )
        if all(given):
            _check_tree_shape(args)

    @classmethod
    def default_tree(cls, args, architecture: str) -> tuple[int, int, int]:
        """SGLang's defaults: (5, 4, 8) for Llama-family targets, else (3, 1, 4); the overlap scheduler keeps
        (3, 1, 4) (it drafts chains)."""
        return (5, 4, 8) if cls._deep_default(args, architecture) else (3, 1, 4)

    @staticmethod
    def _deep_default(args, architecture: str) -> bool:
        return architecture in LLAMA_FAMILY and not args.enable_spec_v2

    @classmethod
    def select(cls, args, target_spec) -> type[Proposer]:
        """EAGLE (or NEXTN) without a draft path: the target must draft with its own MTP layers."""
        if args.speculative_draft_model_path:
            return cls
        if int(target_spec.raw.get("num_nextn_predict_layers") or 0) > 0:
            from specserve.speculative.mtp import MtpProposer

            return MtpProposer
        raise ConfigError(
            "--speculative-draft-model-path is required with --speculative-algorithm EAGLE: the target "
            f"({target_spec.architecture}) has no built-in MTP layers (num_nextn_predict_layers) to draft with"
        )

    @classmethod
    def memory_cost(cls, args, target_spec, target_dtype: torch.dtype, platform: PlatformPolicy) -> DraftMemory:
        """The draft model's weights and KV pool (``DraftModel.memory_cost``)."""
        return cls.draft_model.memory_cost(args, target_spec, target_dtype, platform)

    # ------------------------------------------------------------------ set-up
    def draft_slots_per_request(self) -> int:
        """Tree scratch, plus the held root slot of a draft that keeps one."""
        return self.scratch_slots_per_request() + (1 if self.draft.holds_root_slot else 0)

    def scratch_slots_per_request(self) -> int:
        return self.topk * (self.steps - 1)

    def max_positions_ahead(self) -> int:
        return max(self.num_draft_tokens, self.topk * self.steps) + 1 + self.root_offset + GRAMMAR_ROOM

    # ------------------------------------------------------------------ the draft network
    def compute_dtype(self, rows: int) -> torch.dtype:
        """The dtype a draft forward over `rows` tokens runs in: half_dtype where the draft has one and the platform
        runs a call of that many rows in half precision (on CPU a float32 draft with MixedLinears: calls of more than
        FP32_MAX_ROWS tokens, whose matmuls run packed bf16 anyway, so the activations between them stay half-size
        and unconverted; smaller calls keep float32's lower per-op cost)."""
        if self.half_dtype is not None and self.platform.runs_half_precision(rows):
            return self.half_dtype
        return self.draft_dtype

    def _forward(self, fb: ForwardBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """One draft forward: tokens fb.input_ids [T] + hidden [T, h] -> draft hidden [T, h] (draft dtype)."""
        return self.draft.forward(fb, hidden, self.compute_dtype)

    def _draft_logits(self, draft_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """draft hidden [R, h] -> (draft logits [R, Vd] float32, draft id -> target id map [Vd] or None when the
        draft vocabulary is the target's): ``DraftModel.logits``."""
        return self.draft.logits(draft_hidden)

    def _topk(self, draft_hidden: torch.Tensor, k: int | None = None,
              scale: float | torch.Tensor | None = None,
              grammar: tuple[list[PathStates | None], list[list[list[int]] | None]] | None = None,
              race: tuple[RaceBatch, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """draft hidden [R, h] -> top-k (probabilities [R, k] float32, TARGET token ids [R, k] int64); k defaults
        to the configured topk (what the per-request state keeps). scale (``_score_scale``): logits are multiplied
        by it before the softmax; the top-k ids are the same either way, only their probabilities (the scores the
        tree is ranked by) change. grammar: (walks, paths) for structured outputs (``_grammar_ban``): the tokens a
        request's grammar forbids after a row's path are never drafted (they could never be accepted). race:
        (sampled requests, draft level, rows per request): their rows are scored with their verification's noise
        at that level (``RaceRows.scores``)."""
        if (ranked := self._one_call_topk(draft_hidden, k or self.topk, scale, race, grammar)) is not None:
            self.one_call_rankings += 1
            return ranked
        logits, to_target = self._draft_logits(draft_hidden)
        if scale is not None:
            logits = logits * scale
        if race is not None:
            batch, level, rows_per_req = race
            vocab_ids = to_target if to_target is not None else torch.arange(logits.shape[-1], device=logits.device)
            logits = batch.at_level(level, rows_per_req, vocab_ids).scores(logits)
        ban = self._grammar_ban(*grammar, to_target, logits.shape) if grammar is not None else None
        if ban is None:
            p, ids = torch.softmax(logits, dim=-1).topk(k or self.topk, dim=-1)
        else:  # a row with nothing allowed gets probabilities 0 (its candidates rank last), not NaN
            p, ids = torch.softmax(logits.masked_fill(ban, float("-inf")), dim=-1).topk(k or self.topk, dim=-1)
            p = p.nan_to_num(0.0)
        return p, (ids if to_target is None else to_target[ids])

    def _one_call_topk(self, draft_hidden: torch.Tensor, k: int, scale: float | torch.Tensor | None,
                       race: tuple[RaceBatch, int, int] | None,
                       grammar: tuple[list[PathStates | None], list[list[list[int]] | None]] | None
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``_topk`` in one call of the draft's own (``DraftModel.topk``) where it has one for these rows and they need
        no more than it does: one scale for every row, or every row racing without filters; a grammar's rows given to
        it as their bitmask -> (probabilities, target ids), or None."""
        vocab_ids = self.draft.vocab_ids(draft_hidden)
        if vocab_ids is None or isinstance(scale, torch.Tensor) or (race is not None and scale is not None):
            return None
        noise = None
        if race is not None:
            batch, level, rows_per_req = race
            rows = batch.at_level(level, rows_per_req, vocab_ids)
            if not rows.unfiltered_all(draft_hidden.shape[0]):
                return None
            noise = (rows.log_expo, rows.inv_temps.view(-1), rows_per_req)
        allowed = None
        if grammar is not None:
            if self._wider_than_vocab(vocab_ids):
                return None
            if any(w is not None for w in grammar[0]):
                allowed = self._allowed(*grammar, draft_hidden.shape[0])
        return self.draft.topk(draft_hidden, k, scale or 1.0, noise, allowed)

    def _wider_than_vocab(self, vocab_ids: torch.Tensor) -> bool:
        """The draft ranks more columns than the target's vocabulary without a d2t map (an LM head padded past it),
        which one-call rankings under a grammar do not take: ``_grammar_ban`` crops to it."""
        return self.draft.d2t_ids is None and len(vocab_ids) != self.runner.spec.vocab_size

    def _allowed(self, walks: list[PathStates | None], paths: list[list[list[int]] | None], R: int) -> torch.Tensor:
        """The grammars' int32 bitmask rows for R draft rows (``_grammar_rows``; some request has a grammar), stop
        ids allowed where a grammar may end: what one-call rankings take as allowed."""
        first = next(w for w in walks if w is not None)
        with first.matcher.stats.masking():
            return allow_stops(*self._grammar_rows(walks, paths, R), self.runner.spec.vocab_size)

    def _grammar_ban(self, walks: list[PathStates | None], paths: list[list[list[int]] | None],
                     to_target: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
        """bool [R, Vd] draft-vocabulary bans for rows laid out request-major, R / B rows per request: request b's
        rows follow its ``paths[b]`` from its grammar's state (``walks[b]``; None: a request without a grammar,
        nothing banned). None when no request has a grammar. One bitmask and one ban for the whole batch."""
        first = next((w for w in walks if w is not None), None)
        if first is None:
            return None
        with first.matcher.stats.masking():
            # [R, V], or [R, Vd] over the draft vocabulary's tokens
            return ban_mask(*self._grammar_rows(walks, paths, shape[0]), self.runner.spec.vocab_size, self.device,
                            None if to_target is None else self._draft_columns(to_target))

    @staticmethod
    def _grammar_rows(walks: list[PathStates | None], paths: list[list[list[int]] | None], R: int
                      ) -> tuple[torch.Tensor, list[bool], list[set[int]]]:
        """The grammars' rows for R draft rows laid out request-major (see ``_grammar_ban``; some request has a
        grammar) -> (int32 bitmask [R, W], all allowed in the rows of requests without one; accepting [R]; each row's
        stop ids)."""
        grammar = [b for b, w in enumerate(walks) if w is not None]
        rows_per_req = R // len(walks)
        bitmask = new_bitmask(R, walks[grammar[0]].matcher.vocab_size)  # [R, W] all allowed
        accepting, stops = [False] * R, [set()] * R
        for b in grammar:
            assert len(paths[b]) == rows_per_req
            rows = slice(b * rows_per_req, (b + 1) * rows_per_req)
            accepting[rows] = walks[b].fill(paths[b], bitmask, b * rows_per_req)
            stops[rows] = [walks[b].stop_ids] * rows_per_req
        return bitmask, accepting, stops

    def _draft_columns(self, to_target: torch.Tensor) -> np.ndarray:
        """The draft vocabulary's target ids (``to_target`` [Vd]) as a CPU array, converted once."""
        if self._columns is None or self._columns[0] is not to_target:
            self._columns = (to_target, to_target.cpu().numpy())
        return self._columns[1]

    def _score_scale(self, reqs, rows_per_req: int) -> float | torch.Tensor | None:
        """The factor each draft row's logits are scaled by before scoring: 1 / --speculative-draft-score-temperature
        for greedy requests, 1 for sampled ones. -> None (every row 1), a float (every row alike) or a
        [B * rows_per_req, 1] tensor (rows request-major).

        Why greedy only: a greedy request accepts a draft token when it is the target's argmax, which a good draft's
        top token is more often than the draft's probability of it says, so sharpened scores rank candidates closer
        to their chance of acceptance (deeper trees). A sampled request accepts by the target's probabilities, which
        the draft's own approximate (docs/benchmarks.md: sharpening lowered its accept length)."""
        if self.score_temperature == 1.0:
            return None
        greedy = [r.params.is_greedy for r in reqs]
        if not any(greedy):
            return None
        inv = 1.0 / self.score_temperature
        if all(greedy):
            return inv
        per_req = torch.tensor([inv if g else 1.0 for g in greedy], device=self.device)  # [B]
        return per_req.repeat_interleave(rows_per_req).unsqueeze(1)  # [B * rows_per_req, 1]

    # ------------------------------------------------------------------ extend (catch up)
    def _extend(self, reqs, starts: list[int], tokens: list[list[int]], hidden: torch.Tensor | None,
                may_split: bool = False) -> torch.Tensor:
        """Draft extend: request b's positions [starts[b], starts[b] + len(tokens[b])) with those input tokens
        and target hidden rows (concatenated, [T, h]; None for a draft that reads none). Writes the draft KV at the
        request's own slots. may_split: attend request by request where padding would waste (prompt catch-ups, as
        the target's prefill). A one-layer draft runs its layer past the K/V for the last rows alone where
        ``last_rows_only`` says so.
        -> draft hidden at each request's last position [B, h]."""
        q_lens = [len(t) for t in tokens]
        last_only = self.draft.one_layer and last_rows_only(q_lens)
        fb = extend_batch(self.runner.attn_backend, ForwardMode.DRAFT_EXTEND, self.kv.table,
                          [r.req_pool_idx for r in reqs], starts, tokens, self.kv_pool, may_split, last_only)
        with torch.inference_mode():
            h = self._forward(fb, hidden)  # [T, h], or [B, h] when last_only
        if last_only:
            return h
        return h[-1:] if len(q_lens) == 1 else h.index_select(0, last_token_rows(q_lens, self.device))

    def ranks_root_when_drafting(self, req) -> bool:
        """Whether req's root children are ranked afresh when it drafts, so a catch-up need not rank them: a sampled
        request's with its position's race noise (coupled drafting), a grammar's under what it allows by then."""
        return (self.couples and not req.params.is_greedy) or (req.grammar is not None and self.grammar_aware)

    def _store_states(self, reqs, last_hidden: torch.Tensor) -> None:
        """last_hidden [B, h] -> each request's DraftState, with its root's top-K children where drafting reuses
        them."""
        stored = [b for b, r in enumerate(reqs) if not self.ranks_root_when_drafting(r)]
        p = ids = None
        if stored:
            rows = last_hidden if len(stored) == len(reqs) else last_hidden[stored]
            with torch.inference_mode():
                p, ids = self._topk(rows, scale=self._score_scale([reqs[b] for b in stored], 1))  # [B', K] each
        at = {b: i for i, b in enumerate(stored)}
        for b, (req, h_b) in enumerate(zip(reqs, last_hidden.unbind(0), strict=True)):
            i = at.get(b)
            req.spec_state = DraftState(None, None, h_b) if i is None else DraftState(p[i], ids[i], h_b)

    def _catch_up(self, c: CatchUp) -> None:
        """Run the draft model's catch-up extend; the seeded requests get a new DraftState, and where the draft
        holds a root slot, their root's draft KV goes to a freshly held slot (the target has none for it yet)."""
        seeded = [r for r, s in zip(c.reqs, c.seeded, strict=True) if s]
        held = None
        if self.draft.holds_root_slot and seeded:
            held = self.kv.alloc(len(seeded))
            if held is None:
                raise RuntimeError("no KV slot for the draft's root (the scheduler should have reserved it)")
            self.kv.write(*self.kv.cells(seeded, [r.seq_len - 1 for r in seeded], [1] * len(seeded)), held)
        last = self._extend(c.reqs, c.starts, c.tokens, c.hidden, c.may_split)
        keep = [i for i, s in enumerate(c.seeded) if s]
        if keep:
            self._store_states(seeded, last[keep])
            if held is not None:
                for i, req in enumerate(seeded):
                    req.spec_state.root_slot = held[i : i + 1]

    def after_prefill(self, chunks: list[PrefillChunk], out) -> None:
        chunks = [c for c in chunks if not c.req.finished]
        if not chunks:
            return
        self._catch_up(self.draft.prefill_catch_up(chunks, out))

    def after_verify(self, steps: list[VerifiedStep], out) -> None:
        if not steps:
            return
        for s in steps:
            self._free_root_slot(s.req)
        self._catch_up(self.draft.verify_catch_up(steps, out))

    def _free_root_slot(self, req) -> None:
        state = req.spec_state
        if state is not None and state.root_slot is not None:
            self.kv.free(state.root_slot)
            state.root_slot = None

    def release(self, req) -> None:
        self._free_root_slot(req)
        req.spec_state = None

    def draft_modules(self) -> list:
        return self.draft.draft_modules()

    # ------------------------------------------------------------------ drafting
    def propose(self, reqs, shape: TreeShape | None = None) -> DraftTree:
        """shape: a tree no larger than the configured one (batch-aware shrinking); None = the configured one."""
        S, K, N = (self.steps, self.topk, self.num_draft_tokens) if shape is None else \
            (shape.steps, shape.topk, shape.num_draft_tokens)
        dev, B = self.device, len(reqs)
        states = [r.spec_state for r in reqs]
        roots = torch.tensor([r.last_token for r in reqs], dtype=torch.int64, device=dev)  # [B]
        hidden = torch.stack([s.hidden for s in states])  # [B, h]
        # structured outputs: each grammar's states along this drafting's paths (None: a request without one)
        walks = [PathStates(r.grammar, r.stop_ids) if r.grammar is not None and self.grammar_aware else None
                 for r in reqs]
        self.grammar_walks = walks if any(w is not None for w in walks) else None
        race = RaceBatch.of(reqs, S) if self.couples else None
        with torch.inference_mode():
            root_p, root_ids = self._root_children(reqs, states, hidden, K, walks, race)  # [B, K] each
        cands = EagleCandidates(root_p, root_ids)
        if S > 1:
            live_tokens = cands.tensors()[0]  # [B, K] level 0 = the live branches
            live_hidden = hidden.unsqueeze(1).expand(B, K, hidden.shape[-1])  # [B, K, h]
            self.draft_trees += 1
            with torch.inference_mode():
                self.draft_forwards += self._draft_levels(reqs, cands, live_tokens, live_hidden, S, K, N - 1, race,
                                                          walks)
        return cands.select(roots, N, distinct=self.distinct_ids)

    def _root_children(self, reqs, states: list[DraftState], hidden: torch.Tensor, K: int,
                       walks: list[PathStates | None], race: RaceBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The root's top-K children of each request -> (probabilities [B, K], target ids [B, K]): a sampled request's
        ranked with its position's race noise (race), a grammar's over what it allows now (walks), the others' as
        their catch-up stored them (ranked here where it did not: ``ranks_root_when_drafting``). hidden [B, h]."""
        B = len(reqs)
        raced = set(race.rows) if race is not None else set()
        fresh = [b for b in range(B) if b not in raced and (walks[b] is not None or states[b].topk_p is None)]
        stored = [b for b in range(B) if b not in raced and b not in fresh]
        if len(stored) == B:  # stored top-K are sorted: the first K of them
            return torch.stack([s.topk_p for s in states])[:, :K], torch.stack([s.topk_ids for s in states])[:, :K]
        root_p = torch.empty(B, K, dtype=torch.float32, device=self.device)
        root_ids = torch.empty(B, K, dtype=torch.int64, device=self.device)
        if stored:
            root_p[stored] = torch.stack([states[b].topk_p[:K] for b in stored])
            root_ids[stored] = torch.stack([states[b].topk_ids[:K] for b in stored])
        if fresh:
            paths = [[[]] if walks[b] is not None else None for b in fresh]
            grammar = ([walks[b] for b in fresh], paths) if any(x is not None for x in paths) else None
            p, ids = self._topk(hidden[fresh], K, self._score_scale([reqs[b] for b in fresh], 1), grammar)
            root_p[fresh], root_ids[fresh] = p, ids
        if raced:
            paths = [None if w is None else [[]] for w in walks]
            grammar = (walks, paths) if any(x is not None for x in paths) else None
            p, ids = self._topk(hidden, K, None, grammar, (race, 0, 1))
            if len(raced) == B:
                return p, ids
            root_p[race.rows], root_ids[race.rows] = p[race.rows], ids[race.rows]
        return root_p, root_ids

    def _draft_levels(self, reqs, cands: EagleCandidates, live_tokens, live_hidden, S: int, K: int,
                      keep: int, race: RaceBatch | None = None, walks: list[PathStates | None] | None = None) -> int:
        """Levels 1 .. S-1: one draft forward each over the K live branches of every request, until the kept set
        of `keep` candidates can no longer change (or is confident enough: ``drafting_can_stop``).
        walks: each request's grammar states (``PathStates``; None, or a None entry: no grammar to draft under).
        -> the number of draft forwards run."""
        dev, B = self.device, len(reqs)
        h_dim = live_hidden.shape[-1]
        scratch = self.kv.alloc(B * K * (S - 1))
        if scratch is None:
            raise RuntimeError("no KV slots for drafting (the scheduler should have reserved them)")
        scratch = scratch.view(B, S - 1, K)
        base = [r.seq_len - 1 + self.root_offset for r in reqs]  # [B] draft position of level 1
        keys = self.runner.attn_backend.draft_tree(self.kv.table, [r.req_pool_idx for r in reqs], base,
                                                   scratch.view(B, -1))  # the levels' keys, laid out once
        positions = torch.tensor(base, device=dev).repeat_interleave(K)  # [B*K] level-1 positions
        ancestors = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)  # [B, K, (j-1)*K] over scratch slots
        eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
        scale = self._score_scale(reqs, K)
        # structured outputs: each live branch's tokens after the root, per request with a grammar (None: without)
        walks = walks or [None] * B
        paths = [None if w is None else [[t] for t in live_tokens[b].tolist()] for b, w in enumerate(walks)]
        grammar = (walks, paths) if any(w is not None for w in walks) else None
        try:
            if (n := self._one_call_levels(cands, live_tokens, live_hidden[:, 0], S, K, keep, race, scale, scratch,
                                           keys, positions, grammar)) is not None:
                return n
            for j in range(1, S):
                if cands.can_stop(keep, self.stop_threshold):
                    return j - 1
                mask = torch.cat([ancestors, eye], dim=2)  # [B, K, j*K] over the levels' scratch slots
                fb = ForwardBatch(ForwardMode.DRAFT_DECODE, live_tokens.reshape(-1), positions + (j - 1),
                                  scratch[:, j - 1].reshape(-1), keys.level(mask), self.kv_pool)
                out_hidden = self._forward(fb, live_hidden.reshape(B * K, h_dim)).view(B, K, h_dim)
                child_p, child_ids = self._topk(out_hidden.view(B * K, h_dim), K, scale, grammar,
                                                None if race is None else (race, j, K))  # [B*K, K] each
                best = cands.add_level(child_p.view(B, K, K), child_ids.view(B, K, K))  # [B, K]
                if j == S - 1:
                    return j
                branch = best // K  # [B, K] live branch each new live candidate extends
                live_tokens = child_ids.view(B, K * K).gather(1, best)
                if grammar is not None:
                    paths = _extend_paths(paths, branch, live_tokens)
                    grammar = (walks, paths)
                live_hidden = out_hidden.gather(1, branch.unsqueeze(-1).expand(B, K, h_dim))
                ancestors = mask.gather(1, branch.unsqueeze(-1).expand(B, K, j * K))
        finally:
            self.kv.free(scratch.reshape(-1))

    def _one_call_levels(self, cands: EagleCandidates, root_ids: torch.Tensor, hidden: torch.Tensor, S: int, K: int,
                         keep: int, race: RaceBatch | None, scale: float | torch.Tensor | None, scratch: torch.Tensor,
                         keys, positions: torch.Tensor,
                         grammar: tuple[list[PathStates | None], list[list[list[int]] | None]] | None = None
                         ) -> int | None:
        """Levels 1 .. S-1 in one call of the draft's own (``DraftModel.levels``) where it takes them: bf16 rows its
        kernels take, one score scale for every row or every request racing without filters -> the number of levels
        drafted (their candidates added to cands), or None. root_ids [B, K]: level 0's tokens; hidden [B, h]: the
        roots' draft hidden; scratch [B, S-1, K]; positions [B K]: level 1's. grammar: (walks, level 1's paths) as
        ``_draft_levels``' (the levels then one at a time inside that call, each asking the grammars' rows:
        ``_level_rows``)."""
        levels, B = self.draft.levels, root_ids.shape[0]
        if levels is None or isinstance(scale, torch.Tensor) or type(keys) is not TreeKeys:
            return None
        if grammar is not None and self._wider_than_vocab(self.draft.ranked_ids()):
            return None
        k_buf, v_buf = self.kv_pool.layer(levels.layer.layer_id)
        if (hidden.dtype != torch.bfloat16 or self.compute_dtype(B * K) != torch.bfloat16
                or not levels.fits(B * K, K, k_buf, v_buf)):
            return None
        noise = None
        if race is not None:
            vocab_ids = self.draft.ranked_ids()
            rows = race.at_level(1, K, vocab_ids)
            if scale is not None or not rows.unfiltered_all(B * K):
                return None
            noise = (race.log_noise(vocab_ids), rows.inv_temps.view(-1))
        level_positions = positions.unsqueeze(0) + torch.arange(S - 1, device=self.device).unsqueeze(1)  # [S-1, B K]
        rows = None if grammar is None else self._level_rows(*grammar, B * K)
        scores, tokens, parents = levels(torch.as_tensor(cands.live_scores), root_ids, hidden, level_positions, k_buf,
                                         v_buf, scratch, keys.kv_slots, keys.base, scale or 1.0, self.draft.d2t_ids,
                                         noise, keep, self.stop_threshold, rows)  # [B, n K K] each
        cands.extend_levels(scores, tokens, parents)
        self.one_call_trees += 1
        return scores.shape[1] // (K * K)

    def _level_rows(self, walks: list[PathStates | None], paths: list[list[list[int]] | None], R: int):
        """The grammars' rows for one-call levels (``HeadLevels``' allowed_rows): given how the live branches grew
        (branch, tokens [B, K]; None at level 1, where ``paths`` are theirs) -> the int32 bitmask [R, W] of what each
        live branch's children may be, stop ids allowed where a grammar may end."""

        def rows(branch: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
            nonlocal paths
            if branch is not None:
                paths = _extend_paths(paths, branch, tokens)
            return self._allowed(walks, paths, R)

        return rows


def last_rows_only(q_lens: list[int]) -> bool:
    """Whether a one-layer draft's catch-up extend of q_lens[b] rows per request runs its layer past the K/V for each
    request's last row only: from KV_ONLY_MIN_ROWS rows, or where the requests' rows differ in number. A few rows
    each, alike (the catch-up after a verify step at batch 1) run every row: the CPU's fused decoder-layer operator
    takes them in one call, where the last-rows path is several; rows of unequal numbers never fit that operator."""
    return sum(q_lens) >= KV_ONLY_MIN_ROWS or len(set(q_lens)) > 1


def _extend_paths(paths: list[list[list[int]] | None], branch: torch.Tensor,
                  tokens: torch.Tensor) -> list[list[list[int]] | None]:
    """The live branches' paths one level deeper: new branch k of request b extends old branch branch[b, k] by
    tokens[b, k] ([B, K] each); requests without a path list stay None."""
    branch_l, tokens_l = branch.tolist(), tokens.tolist()
    return [None if old is None else [old[i] + [t] for i, t in zip(branch_l[b], tokens_l[b], strict=True)]
            for b, old in enumerate(paths)]


def _check_tree_shape(args) -> None:
    for n in TREE_FLAGS:
        require_positive(args, n)
    steps, topk = args.speculative_num_steps, args.speculative_eagle_topk
    if args.speculative_num_draft_tokens < 2:
        raise ConfigError("--speculative-num-draft-tokens must be >= 2 (the root plus at least one draft)")
    if topk == 1 and args.speculative_num_draft_tokens != steps + 1:
        logger.warning("--speculative-eagle-topk 1: --speculative-num-draft-tokens set to num_steps + 1 = %d",
                       steps + 1)
        args.speculative_num_draft_tokens = steps + 1
    most = max_tree_nodes(steps, topk)
    if args.speculative_num_draft_tokens > most:
        raise ConfigError(
            f"--speculative-num-draft-tokens {args.speculative_num_draft_tokens} exceeds what the draft tree can "
            f"hold: the root plus eagle_topk + (num_steps - 1) * eagle_topk^2 drafted candidates = {most}"
        )

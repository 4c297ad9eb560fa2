"""SpecDecoder: the speculative decode step (draft -> one target verify forward -> accept -> commit -> catch up).

For B running requests with roots at positions P_b (= seq_len - 1, the root's KV not yet computed):
  1. ``proposer.propose(reqs)`` -> DraftTree, n_b real nodes per request (node 0 = the root);
  2. every real node gets a fresh KV slot, written into req_to_token at columns P_b .. P_b + n_b - 1 (scratch
     columns: they are rewritten at commit); one TARGET_VERIFY forward at positions P_b + depth with the tree
     mask gives logits at every node;
  3. verification: greedy walk (argmax of the processed logits) for greedy rows, lossless tree sampling for the
     others (``specserve.speculative.verify``; at the default thresholds each node's exponential race with the noise
     of its output position, so a seeded request emits the tokens plain decoding would); the target distributions at
     each node are processed
     exactly as plain decoding would at that point (penalties and min_new_tokens see the drafted path as already
     generated);
  4. the new tokens (accepted drafts, then the bonus token) are appended one by one through the output processor's
     finish checks (plain decoding's own), so EOS / stop ids / stop strings / max_new_tokens / context length end
     the request exactly where plain decoding would; tokens past a finish are never emitted or counted;
  5. commit: the accepted nodes' slots become positions P_b .. P_b + keep - 1 of the request; all other slots
     are freed (target and draft KV share slot indices, so this is one operation for both);
  6. ``proposer.after_verify`` lets the drafter catch up on the accepted tokens of the requests still running.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from specserve.attention import ForwardBatch, ForwardMode
from specserve.grammar.backend import new_bitmask
from specserve.grammar.masks import ForcedTree, ban_mask, jump_forward
from specserve.models.llama import ModelOutput
from specserve.models.loader import dtype_name
from specserve.request import Req, ReqOutput
from specserve.sampling.race import grid_keys
from specserve.sampling.sampler import (
    SamplingBatchInfo,
    apply_penalties_and_bias,
    greedy_ids,
    is_plain_greedy,
    is_plain_sampled,
    probs_from_logits,
    request_logprobs,
    request_seeds,
)
from specserve.scheduler.decode_step import DecodeContext, DecodeStep, PlainDecode
from specserve.scheduler.spec_overlap import OverlapPipeline
from specserve.speculative.accept_stats import add_step, position_rates
from specserve.speculative.base import GRAMMAR_ROOM, PrefillChunk, Proposer, VerifiedStep
from specserve.speculative.batch_policy import BatchPolicy, TreeShape, batch_kind
from specserve.speculative.simulate import AcceptSimulator
from specserve.speculative.tree import DraftTree, build_tree, cap_depth
from specserve.speculative.verify import (
    VerifyResult,
    race_node_ids,
    race_verify,
    simulate_accept,
    verify_greedy,
    verify_sampling,
)

BACKLOG_WINDOW = 32  # plain-decoded tokens a request keeps for its drafter (the most recent ones)


@dataclass
class Backlog:
    """The latest tokens a request got from plain decode steps since its drafter last caught up (batch-aware
    speculation), replayed to the drafter when speculation resumes.

    Only the last BACKLOG_WINDOW are kept: memory stays bounded and a long plain stretch costs nothing until
    speculation resumes. The drafter's KV at older plain-decoded positions is then simply not refreshed (stale
    slots); that can only lower acceptance, never change an output (verification is what decides)."""

    start: int  # position of the input of the oldest kept step (the root then)
    tokens: deque[int] = field(default_factory=deque)  # the tokens those steps produced
    # (the step's forward output, this request's row in it): its rows are read only when the backlog is replayed,
    # so a long plain stretch costs a tuple a step, not a slice of every captured layer
    rows: deque[tuple[ModelOutput, int]] = field(default_factory=deque)

    def add(self, token: int, out: ModelOutput, row: int) -> None:
        self.tokens.append(token)
        self.rows.append((out, row))
        if len(self.tokens) > BACKLOG_WINDOW:
            self.tokens.popleft()
            self.rows.popleft()
            self.start += 1


def gather_rows(rows) -> ModelOutput:
    """(forward output, row) pairs -> one ModelOutput of those rows' hidden states, in order ([T, h], and [T, h]
    per captured layer): each distinct output's rows are read by one index, not a slice per row."""
    outs: list[ModelOutput] = []
    base: dict[int, int] = {}  # id(output) -> its first row in the concatenation
    index, total = [], 0
    for out, row in rows:
        if id(out) not in base:
            base[id(out)], total = total, total + out.hidden.shape[0]
            outs.append(out)
        index.append(base[id(out)] + row)
    idx = torch.tensor(index, device=outs[0].hidden.device)

    def pick(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors).index_select(0, idx) if len(tensors) > 1 else tensors[0].index_select(0, idx)

    aux = [pick([o.aux_hidden[i] for o in outs]) for i in range(len(outs[0].aux_hidden))]
    return ModelOutput(None, pick([o.hidden for o in outs]), aux)


@dataclass
class SpecStats:
    """Counters of speculative decoding since start (all requests)."""

    verify_ct: int = 0  # per request per verify step
    accepted_drafts: int = 0
    drafted: int = 0
    tokens: int = 0  # tokens produced by verify steps (accepted drafts + bonus, after finish trimming)
    plain_steps: int = 0  # decode steps batch-aware speculation ran without speculation
    shrunk_steps: int = 0  # speculative steps with a tree smaller than the configured one
    trimmed_finishes: int = 0  # overlap scheduler: stop strings found after the next forward part had run
    forced_tokens: int = 0  # accepted tokens a grammar forced (jump-forward), counted in `tokens` too
    # [k-1] = verify steps (per request) that accepted >= k drafted tokens (specserve.speculative.accept_stats)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def avg_accept_length(self) -> float:
        """Tokens per request per verify step since start (1.0 = no gain)."""
        return self.tokens / self.verify_ct if self.verify_ct else 0.0


@dataclass
class StepRecord:
    """What a speculative step's forward part leaves for its output part (``SpecDecoder.process``)."""

    reqs: list[Req]
    logits: torch.Tensor  # [B, N, V] raw verify logits (logprobs are computed from them)
    paths: list[list[int]]  # [B] accepted node ids, root first
    tokens: list[list[int]]  # [B] verified new tokens (accepted drafts + bonus), before any finish
    n_out: list[int]  # [B] output length before the step
    taken: list[int]  # [B] tokens the forward part appended (it stops at a stop id / length finish)
    # [B] this forward part ended the request (req.spec_stopped as it set it: with the overlap scheduler the next
    # step's forward part may set the flag while this record is being processed)
    stopped: list[bool]
    n_nodes: list[int]  # [B] real tree nodes
    depths: list[int]  # [B] deepest drafted node
    forced: list[int]  # [B] accepted drafts that were grammar-forced (jump-forward) rather than drafted

    @property
    def num_tokens(self) -> int:
        return sum(self.taken)


def cap_to_remaining(reqs: list[Req], tree: DraftTree) -> DraftTree:
    """Drop the nodes a request cannot emit: with R new tokens left, nothing deeper than R - 1."""
    left = [r.remaining_new_tokens() for r in reqs]
    if min(left) >= tree.width:  # no node is deeper than width - 1
        return tree
    return cap_depth(tree, torch.tensor([max(0, n - 1) for n in left], device=tree.depth.device))


class SpecDecoder(DecodeStep):
    def __init__(self, ctx: DecodeContext, proposer: Proposer) -> None:
        super().__init__(ctx)
        self.proposer = proposer
        self.runner, self.kv, self.outputs = ctx.runner, ctx.kv, ctx.outputs
        self.outputs.reports_spec_meta = True
        self.device = ctx.runner.device
        self.capture_layers = proposer.capture_layers
        self.stats = SpecStats()
        self.plain = PlainDecode(ctx)  # batch-aware speculation's plain steps
        args = ctx.args
        self.threshold_single = args.speculative_accept_threshold_single
        self.threshold_acc = args.speculative_accept_threshold_acc
        self.race_walk = ctx.runner.platform.race_walk()  # sampled trees walked in one call where the host has it
        # SPECSERVE_SIMULATE_ACC_LEN (benchmarking only, lossy): None = normal verification
        self.simulator = AcceptSimulator.from_env(args.random_seed)
        self.policy = self._batch_policy(args)
        # the overlap scheduler (SPECSERVE_ENABLE_SPEC_V2): output processing overlaps the next forward part
        self.overlap = OverlapPipeline(self) if args.enable_spec_v2 else None
        self.no_jump_forward = args.disable_grammar_jump_forward
        # structured outputs: nodes a full-size tree may grow to with grammar-forced tokens: into the KV reserved
        # for drafting's scratch (free again by the verify forward), within the table columns a step may write
        N, S, K = proposer.num_draft_tokens, args.speculative_num_steps or 1, args.speculative_eagle_topk or 1
        self.forced_width = min(N + proposer.scratch_slots_per_request(), max(N, S * K) + GRAMMAR_ROOM)

    def _batch_policy(self, args) -> BatchPolicy:
        """Batch-aware speculation. Turning speculation off where plain steps measure faster is only done when it
        cannot change outputs: lossless verification, no simulated acceptance (lossy modes keep speculating)."""
        full = TreeShape(args.speculative_num_steps or 1, args.speculative_eagle_topk or 1,
                         self.proposer.num_draft_tokens)
        lossless = (self.threshold_single == 1.0 and self.threshold_acc == 1.0
                    and not self.proposer.force_greedy_verify and self.simulator is None)
        return BatchPolicy(full, args.speculative_batch_token_budget, args.speculative_disable_batch_size,
                           auto_off=lossless and not args.disable_speculative_auto_off)

    def slots_needed(self, reqs: list[Req]) -> int:
        return max(super().slots_needed(reqs), self.plain.slots_needed(reqs))  # a plain step may run forced tokens

    def slots_per_request(self) -> int:
        """KV slots one request may need during a step (drafting scratch + verify nodes, counted together)."""
        return self.proposer.num_draft_tokens + self.proposer.draft_slots_per_request()

    def reserve_per_request(self) -> int:
        return self.slots_per_request()

    def after_prefill(self, chunks: list[PrefillChunk], out: ModelOutput) -> None:
        self.proposer.after_prefill(chunks, out)

    def has_pending(self) -> bool:
        return self.overlap is not None and self.overlap.pending is not None

    def drain(self) -> list[ReqOutput]:
        return self.overlap.drain() if self.overlap is not None else []

    def accept_counts(self) -> tuple[int, int]:
        return self.stats.tokens, self.stats.verify_ct

    def reset_counters(self) -> None:
        self.stats, self.policy = SpecStats(), self._batch_policy(self.ctx.args)
        self.proposer.forget()
        if self.overlap is not None:
            self.overlap.overlapped_steps = 0

    def info(self) -> dict:
        st, args = self.stats, self.ctx.args
        draft_dtype = getattr(self.proposer, "draft_dtype", None)
        return dict(
            speculative_algorithm=args.speculative_algorithm,
            speculative_num_steps=args.speculative_num_steps,  # as resolved at load (defaults filled in)
            speculative_eagle_topk=args.speculative_eagle_topk,
            speculative_num_draft_tokens=args.speculative_num_draft_tokens,
            avg_spec_accept_length=st.avg_accept_length,
            spec_verify_ct=st.verify_ct,
            spec_accept_rate=st.accepted_drafts / st.drafted if st.drafted else 0.0,
            spec_accepted_per_position=list(st.accepted_per_position),
            spec_accept_rate_per_position=position_rates(st.accepted_per_position, st.verify_ct),
            spec_plain_steps=st.plain_steps,
            spec_shrunk_steps=st.shrunk_steps,
            spec_batch_policy=self.policy.summary(),
            spec_overlap=self.overlap is not None,  # the overlap scheduler (Spec V2)
            spec_overlapped_steps=self.overlap.overlapped_steps if self.overlap is not None else 0,
            spec_trimmed_finishes=st.trimmed_finishes,
            spec_forced_tokens=st.forced_tokens,
            speculative_draft_stop_threshold=args.speculative_draft_stop_threshold,
            speculative_draft_score_temperature=args.speculative_draft_score_temperature,
            speculative_draft_dtype=None if draft_dtype is None else dtype_name(draft_dtype),  # None: no draft model
            spec_draft_trees=self.proposer.draft_trees,  # see Proposer.draft_trees / draft_forwards
            spec_draft_forwards=self.proposer.draft_forwards,
        )

    # ------------------------------------------------------------------ the step
    def run(self, reqs: list[Req]) -> list[ReqOutput]:
        """One decode step for the running batch: speculative with the tree the batch policy picks, or plain.
        With the overlap scheduler, the outputs are those of the previous speculative step (spec_overlap)."""
        if self.overlap is not None:
            return self.overlap.run(reqs)
        kind = self.batch_kind(reqs)
        # tokens a grammar forced in a plain step (jump-forward) wait for their KV: a plain step runs them first
        shape = None if self.forced_pending(reqs) else self.choose_shape(reqs, kind)
        if shape is None:
            return self.timed_plain_step(reqs, kind)
        started = self.step_start()
        self.flush_backlog(reqs)  # the drafter catches up on plain-decoded tokens: speculation's cost, charged here
        record = self.forward_step(reqs, shape)
        outputs, done = self.process(record)
        self.release_done(done)
        self.record_step(started, len(reqs), True, record.num_tokens, kind)
        return outputs

    def timed_plain_step(self, reqs: list[Req], kind: str | None = None) -> list[ReqOutput]:
        """A plain step, measured for the batch policy (kind: ``batch_kind(reqs)``, when the caller has it)."""
        kind = self.batch_kind(reqs) if kind is None else kind
        started = self.step_start()
        outputs, tokens = self._plain_step(reqs)
        self.record_step(started, len(reqs), False, tokens, kind)
        return outputs

    @staticmethod
    def forced_pending(reqs: list[Req]) -> bool:
        """Whether some request holds tokens without KV besides its last one: grammar-forced tokens a plain step
        appended (``OutputProcessor.append_forced``), which only a plain step's forward runs (a draft tree grows from
        a root whose prefix has its KV)."""
        return any(r.unforwarded > 1 for r in reqs)

    @staticmethod
    def batch_kind(reqs: list[Req]) -> str:
        """The batch policy's kind of this batch (``batch_policy.batch_kind``: greedy, sampled or mixed, with or
        without a grammar)."""
        return batch_kind([r.params.is_greedy for r in reqs], [r.grammar is not None for r in reqs])

    def choose_shape(self, reqs: list[Req], kind: str) -> TreeShape | None:
        """The batch policy's tree for a step of `reqs` (a batch of this ``batch_kind``); None = a plain step."""
        behind = any(r.spec_backlog is not None for r in reqs)  # the drafter has plain-decoded tokens to replay
        return self.policy.choose(len(reqs), kind, self.most_new(reqs), behind)

    @staticmethod
    def most_new(reqs: list[Req]) -> int:
        """The most new tokens any of `reqs` may still make: the batch policy fits the tree to it."""
        return max(r.remaining_new_tokens() for r in reqs)

    def step_start(self) -> tuple[float, int]:
        """(now, torch.compile graphs built so far): what ``record_step`` measures a step from."""
        stats = self.runner.compile_stats
        return time.perf_counter(), 0 if stats is None else stats.graphs

    def record_step(self, started: tuple[float, int], batch: int, speculative: bool, tokens: int, kind: str) -> None:
        """Give the batch policy a step's time (a batch of this ``batch_kind``), flagged when torch.compile built a
        graph during it."""
        start, graphs = started
        stats = self.runner.compile_stats
        # a step slowed by a compile (on this thread, or on the background compiler's while it shares the CPU)
        compiled = stats is not None and (stats.graphs != graphs or stats.kinds_pending > 0)
        self.policy.record(batch, speculative, time.perf_counter() - start, tokens, compiled, kind)

    def release(self, req: Req) -> None:
        """req leaves the batch (finished, aborted, retracted): drop its drafting state and backlog."""
        req.spec_backlog = None
        req.spec_stopped = False
        self.proposer.release(req)

    # ------------------------------------------------------------------ plain steps and the backlog
    def _plain_step(self, reqs: list[Req]) -> tuple[list[ReqOutput], int]:
        """A plain decode step (what plain decoding does, jump-forward included); each request still running records
        each token its forward ran, with the target's hidden states there, in its backlog (as the input of the token
        after it), which the drafter replays before the next speculative step. -> (outputs, tokens appended)."""
        self.stats.plain_steps += 1
        starts = [r.kv_len for r in reqs]  # the first position each request's rows run
        take = self.plain.rows(reqs)  # rows per request
        # counted first, so that the outputs of a request this step finishes report it: its sampled token, if its last
        # row runs now (forced tokens are counted as they are appended)
        for req, start, t in zip(reqs, starts, take, strict=True):
            req.spec_plain_tokens += start + t == req.seq_len
        before = sum(len(r.output_ids) for r in reqs)
        outputs, out = self.plain.forward(reqs, self.proposer.capture_layers, take)
        kept = ModelOutput(None, out.hidden, out.aux_hidden)  # what a backlog reads: not the step's logits [B, V]
        row = 0
        for req, start, t in zip(reqs, starts, take, strict=True):
            if not req.finished:  # (a finished request is released: its state is gone)
                if req.spec_backlog is None:
                    req.spec_backlog = Backlog(start)
                for i in range(t):
                    req.spec_backlog.add(req.token_at(start + i + 1), kept, row + i)
            row += t
        return outputs, sum(len(r.output_ids) for r in reqs) - before

    def flush_backlog(self, reqs: list[Req]) -> None:
        """Replay the backlogs of `reqs` through ``proposer.after_verify`` as one multi-token step each."""
        pending = [r for r in reqs if r.spec_backlog is not None]
        if not pending:
            return
        steps, rows = [], []
        for req in pending:
            bl, req.spec_backlog = req.spec_backlog, None
            k = len(bl.tokens)
            steps.append(VerifiedStep(req, bl.start, list(range(k)), list(bl.tokens), len(rows)))
            rows.extend(bl.rows)
        self.proposer.after_verify(steps, gather_rows(rows))

    # ------------------------------------------------------------------ speculative steps: the forward part
    def forward_step(self, reqs: list[Req], shape: TreeShape) -> StepRecord:
        """Draft, verify forward, acceptance, KV commit, token append and drafter catch-up: everything the next
        step depends on. Output processing (stop strings, logprobs, counters, outputs) is ``process``'s.

        Finishes that need no detokenization (a stop id, max_new_tokens, the context length) end the request
        here: tokens after it are not appended and it takes no further step (``req.spec_stopped``). A stop string
        is found later by ``process``, which then drops the tokens after it (``release_done`` trims them)."""
        if shape != self.policy.full:
            self.stats.shrunk_steps += 1
        tree, grammar_trees = self._jump_forward(reqs, cap_to_remaining(reqs, self.proposer.propose(reqs, shape)))
        n_nodes = tree.num_nodes.tolist()
        root_pos = [r.seq_len - 1 for r in reqs]
        slots = self._verify_slots(reqs, root_pos, n_nodes)  # [T] request-major, node order
        out = self._verify_forward(reqs, tree, root_pos, n_nodes, slots)
        logits = self._padded(out.logits, tree)  # [B, N, V]
        ban = self._tree_grammar_ban(reqs, grammar_trees, tree, logits.shape[-1])
        result = self._verify(reqs, tree, logits, ban)
        paths = result.accepted_nodes.tolist()
        forced = [0] * len(reqs)
        for b, t in grammar_trees.items():
            forced[b] = sum(node >= t.forced_from for node in paths[b][1:])
        record = StepRecord(reqs, logits, paths, result.token_lists(), [], [], [], n_nodes,
                            tree.depth.max(dim=1).values.tolist(), forced)
        steps, kept, row_offset = [], [], 0
        for b, req in enumerate(reqs):
            tokens, n_out = record.tokens[b], len(req.output_ids)
            take = self._forward_take(req, tokens, n_out)
            req.output_ids.extend(tokens[:take])
            accepted = record.paths[b][: len(tokens)]  # root first, one node per new token
            kept.append(accepted[: min(len(accepted), take + 1)])  # nodes whose KV stays: root + drafts in the output
            record.n_out.append(n_out)
            record.taken.append(take)
            record.stopped.append(req.spec_stopped)
            if not req.spec_stopped:
                steps.append(VerifiedStep(req, root_pos[b], accepted, tokens[:take], row_offset))
            row_offset += n_nodes[b]
        self._commit_slots(reqs, root_pos, slots, n_nodes, kept)
        self.proposer.after_verify(steps, out)
        return record

    def _forward_take(self, req: Req, tokens: list[int], n_out: int) -> int:
        """How many of the verified `tokens` req takes: up to the first that ends it without detokenization."""
        for k, tok in enumerate(tokens):
            req.accept_grammar(tok, n_out + k + 1)
            if self.outputs.ends_without_text(req, tok, n_out + k + 1):
                req.spec_stopped = True
                return k + 1
        return len(tokens)

    def _verify_slots(self, reqs: list[Req], root_pos: list[int], n_nodes: list[int]) -> torch.Tensor:
        """A fresh KV slot per real tree node, written into req_to_token at columns P_b .. P_b + n_b - 1
        -> slots [T] (request-major, node order: the verify forward's rows)."""
        flat = self.kv.alloc(sum(n_nodes))
        if flat is None:
            raise RuntimeError("no KV slots for verification (the scheduler should have reserved them)")
        self.kv.write(*self.kv.cells(reqs, root_pos, n_nodes), flat)
        return flat

    def _verify_forward(self, reqs, tree: DraftTree, root_pos, n_nodes, slots):
        dev = self.device
        valid = tree.valid  # [B, N]
        ids = tree.tokens[valid]  # [T] row-major = request by request, node order
        positions = tree.positions(torch.tensor(root_pos, device=dev))[valid]  # [T]
        rows = torch.tensor([r.req_pool_idx for r in reqs], device=dev)
        kv_lens = [p + n for p, n in zip(root_pos, n_nodes, strict=True)]
        masks = [tree.mask[b, :n, :n] for b, n in enumerate(n_nodes)]
        attn = self.runner.attn_backend.tree(self.kv.table, rows, kv_lens, n_nodes, masks)
        fb = ForwardBatch(ForwardMode.TARGET_VERIFY, ids, positions, slots, attn, self.runner.kv_pool,
                          capture_layers=self.proposer.capture_layers)
        return self.runner.forward(fb)  # logits [T, V]

    @staticmethod
    def _padded(flat: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        """[T, V] rows of the real nodes -> [B, N, V] (padding nodes get zero rows)."""
        B, N = tree.tokens.shape
        if flat.shape[0] == B * N:
            return flat.view(B, N, -1)
        out = flat.new_zeros(B, N, flat.shape[-1])
        out[tree.valid] = flat
        return out

    # ------------------------------------------------------------------ verification
    def _verify(self, reqs: list[Req], tree: DraftTree, logits: torch.Tensor,
                grammar_ban: torch.Tensor | None) -> VerifyResult:
        """logits [B, N, V] raw -> VerifyResult, every row judged against its own processed distribution.
        grammar_ban: bool [B * N, V], the grammars' bans per node (``_tree_grammar_ban``), or None."""
        if self.simulator is not None:  # simulated accept lengths: the target's judgement is ignored
            lens = self.simulator.sample(tree.batch_size, tree.max_depth + 1).to(self.device)  # [B]
            return simulate_accept(tree, greedy_ids(logits), lens)
        if all(is_plain_greedy(r.params, len(r.output_ids)) for r in reqs):
            if grammar_ban is not None:  # only grammars to apply: no sampling batch needed
                logits = logits.masked_fill(grammar_ban.view(logits.shape), float("-inf"))
            return verify_greedy(tree, greedy_ids(logits))
        temps = self._plain_temperatures(reqs, grammar_ban)
        if temps is not None:  # every node of every request: the target's tempered softmax, no per-node processing
            probs = torch.softmax(logits.to(torch.float32) / temps, dim=-1)  # [B, N, V], as probs_from_logits
            return self._race_verify(reqs, tree, probs, None)
        info, processed = self._processed(reqs, tree, logits, grammar_ban)  # processed [B, N, V]
        greedy = [r.params.is_greedy or self.proposer.force_greedy_verify for r in reqs]
        if all(greedy):
            return verify_greedy(tree, greedy_ids(processed))
        B, N, V = processed.shape
        probs = probs_from_logits(processed.view(B * N, V), info).view(B, N, V)
        if self.threshold_single != 1.0 or self.threshold_acc != 1.0:  # SGLang's lossy rule
            sampled = verify_sampling(tree, probs, [r.generator for r in reqs], self.threshold_single,
                                      self.threshold_acc)
            if not any(greedy):
                return sampled
            # greedy rows: one-hot probs, but they must not draw coins from a generator: the argmax walk
            by_argmax = verify_greedy(tree, greedy_ids(processed))
            return _merge_results(torch.tensor(greedy, device=self.device), by_argmax, sampled)
        return self._race_verify(reqs, tree, probs, greedy_ids(processed) if any(greedy) else None, greedy)

    def _race_verify(self, reqs: list[Req], tree: DraftTree, probs: torch.Tensor, ids: torch.Tensor | None,
                     greedy: list[bool] | None = None) -> VerifyResult:
        """Lossless sampled verification: each sampled request's token at each node is plain decoding's race winner
        for its seed there (probs [B, N, V], its processed distribution at each node); ids [B, N]: the greedy
        requests' tokens (None: no request is greedy, greedy None too)."""
        rows = list(range(len(reqs))) if greedy is None else [b for b, g in enumerate(greedy) if not g]
        keys = grid_keys(request_seeds([reqs[b].generator for b in rows]), [len(reqs[b].output_ids) for b in rows],
                         tree.max_depth + 1, self.device)  # [S, D+1, 2]: column d keys output position len + d
        if ids is None:
            return race_verify(tree, probs, keys, self.race_walk)
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)  # [S]
        ids[index] = race_node_ids(tree.depth[index], probs[index], keys)
        return verify_greedy(tree, ids)

    def _plain_temperatures(self, reqs: list[Req], grammar_ban: torch.Tensor | None) -> torch.Tensor | None:
        """[B, 1, 1] float32 temperatures where every request samples from the target's tempered softmax alone
        (``is_plain_sampled``: at its root, so at every node of its tree) under lossless verification and no grammar;
        else None (the nodes go through ``_processed``)."""
        if grammar_ban is not None or self.proposer.force_greedy_verify:
            return None
        if self.threshold_single != 1.0 or self.threshold_acc != 1.0:
            return None
        vocab = self.runner.spec.vocab_size
        if not all(is_plain_sampled(r.params, len(r.output_ids), vocab) for r in reqs):
            return None
        temps = [r.params.temperature for r in reqs]
        return torch.tensor(temps, dtype=torch.float32, device=self.device).view(-1, 1, 1)

    def _processed(self, reqs: list[Req], tree: DraftTree, logits: torch.Tensor, grammar_ban: torch.Tensor | None):
        """Penalties, bias and min-token bans per node: node i of request b is judged as plain decoding would
        after generating b's output so far plus the drafted tokens on the path root -> i."""
        B, N, V = logits.shape
        paths = _node_paths(tree)  # [B][N] token lists (root excluded)
        params, gens, prompts, outputs, stops = [], [], [], [], []
        for b, r in enumerate(reqs):
            for i in range(N):
                params.append(r.params)
                gens.append(r.generator)
                prompts.append(r.origin_input_ids)
                outputs.append(r.output_ids + paths[b][i])
                stops.append(r.stop_ids)
        info = SamplingBatchInfo.from_params(params, gens, prompts, outputs, stops, self.runner.spec.vocab_size,
                                             self.device)
        info.grammar_ban = grammar_ban
        processed = apply_penalties_and_bias(logits.view(B * N, V), info)
        return info, processed.view(B, N, V)

    def _jump_forward(self, reqs: list[Req], tree: DraftTree) -> tuple[DraftTree, dict[int, ForcedTree]]:
        """Structured outputs: each constrained request's tree without the nodes its grammar forbids, and with the
        tokens its grammar forces appended (``jump_forward``), up to ``forced_width`` nodes for a full-size tree
        (pruning only with --disable-grammar-jump-forward). -> (the tree to verify, {b: request b's ForcedTree})."""
        rows = [b for b, r in enumerate(reqs) if r.grammar is not None]
        walks, self.proposer.grammar_walks = self.proposer.grammar_walks, None  # the drafting's grammar states
        if not rows:
            return tree, {}
        tokens, parents, sizes = tree.tokens.tolist(), tree.parents.tolist(), tree.num_nodes.tolist()
        room = self._forced_room(tree)
        out: dict[int, ForcedTree] = {}
        with reqs[rows[0]].grammar.stats.masking():
            for b in rows:
                n, req = sizes[b], reqs[b]
                out[b] = jump_forward(req.grammar, tokens[b][:n], parents[b][:n], req.stop_ids,
                                      0 if self.no_jump_forward else room, self.runner.spec.vocab_size,
                                      None if walks is None else walks[b])
        if all(out[b].tokens == tokens[b][:sizes[b]] for b in rows):
            return tree, out  # nothing dropped, nothing forced: the drafted tree as it is
        for b in rows:
            tokens[b], parents[b], sizes[b] = out[b].tokens, out[b].parents, len(out[b].tokens)
        width = max(tree.width, *sizes)
        dev = tree.tokens.device
        tok = torch.tensor([t + [0] * (width - len(t)) for t in tokens], dtype=torch.int64, device=dev)  # [B, N']
        par = torch.tensor([p + [0] * (width - len(p)) for p in parents], dtype=torch.int64, device=dev)  # [B, N']
        return build_tree(tok[:, 0], tok[:, 1:], par[:, 1:], torch.tensor(sizes, device=dev), check=False,
                          merge=False), out

    def _forced_room(self, tree: DraftTree) -> int:
        """The nodes a constrained request's tree may grow to with forced tokens: ``forced_width`` for a full-size tree
        (one the batch did not shrink), within the rows a forward keeps the platform's fused decoder layers
        (``ModelRunner.decode_rows``: past them a verify forward of one request ran 2.5-3.5x slower on a 2-core AMD
        EPYC, and each appended node costs a mask besides)."""
        if tree.width != self.proposer.num_draft_tokens:
            return tree.width
        rows = self.runner.decode_rows
        return self.forced_width if rows is None else max(tree.width, min(self.forced_width, rows))

    def _tree_grammar_ban(self, reqs: list[Req], trees: dict[int, ForcedTree], tree: DraftTree, vocab_size: int
                          ) -> torch.Tensor | None:
        """bool [B * N, V] grammar bans per tree node (node i: after the path root -> i) from ``_jump_forward``'s
        rows, None without grammars."""
        if not trees:
            return None
        B, N = tree.batch_size, tree.width
        bitmask = new_bitmask(B * N, reqs[next(iter(trees))].grammar.vocab_size)  # [B * N, W] all allowed
        accepting, stops = [False] * (B * N), [set()] * (B * N)
        for b, t in trees.items():
            n = len(t.tokens)
            bitmask[b * N : b * N + n] = t.bitmask
            accepting[b * N : b * N + n] = t.accepting
            stops[b * N : b * N + n] = [reqs[b].stop_ids] * n
        return ban_mask(bitmask, accepting, stops, vocab_size, self.device)  # [B * N, V]

    # ------------------------------------------------------------------ speculative steps: the output part
    def process(self, record: StepRecord) -> tuple[list[ReqOutput], list[tuple[Req, int]]]:
        """The step's tokens through the output processor's finish checks in order (stop strings included), logprobs,
        counters and outputs. -> (outputs, [(finished request, its output length)] for ``release_done``).

        Touches only output-side request state (stop checker, text, logprobs, counters, finish reason), so the
        overlap scheduler runs it while the next step's forward part runs."""
        lp = self._logprobs(record.reqs, record.logits, record.paths, record.tokens)
        outputs, done = [], []
        for b, req in enumerate(record.reqs):
            if req.finished:  # a stop string in the previous step's output: this step's tokens are dropped
                continue
            emitted = 0  # the step's tokens up to the finish, if any (the forward part appended them)
            for k, tok in enumerate(record.tokens[b][: record.taken[b]]):
                if lp is not None and req.wants_logprobs():
                    req.logprobs.append(lp[b][0][k])
                    req.top_logprobs.append(lp[b][1][k])
                    req.ids_logprobs.append(lp[b][2][k])
                emitted += 1
                self.outputs.check_finish(req, tok, record.n_out[b] + k + 1)
                if req.finished:
                    break
            if record.stopped[b] and not req.finished:
                raise RuntimeError(f"request {req.rid} stopped in the forward part but not by the finish checks")
            self._count(req, len(record.tokens[b]) - 1, emitted, record.n_nodes[b] - 1, record.depths[b])
            req.spec_forced_tokens += record.forced[b]
            self.stats.forced_tokens += record.forced[b]
            completion = record.n_out[b] + emitted
            if req.finished:
                done.append((req, completion))
            if (out := self.outputs.step_output(req, completion)) is not None:
                outputs.append(out)
        return outputs, done

    def release_done(self, done: list[tuple[Req, int]]) -> None:
        """Give back the KV of requests ``process`` finished, first trimming what a later forward part appended
        past their finish (a stop string is found one step late with the overlap scheduler)."""
        for req, completion in done:
            if len(req.output_ids) > completion:
                self.stats.trimmed_finishes += 1
            del req.output_ids[completion:]
            self.kv.trim(req)  # KV past the trimmed end
            self.outputs.release(req)

    def _commit_slots(self, reqs: list[Req], root_pos: list[int], slots: torch.Tensor, n_nodes: list[int],
                      kept: list[list[int]]) -> None:
        """Request b keeps the KV of its nodes kept[b] (root first) as positions P_b .. P_b + len(kept[b]) - 1;
        every other node's slot is freed. slots [T]: the verify slots, request-major (n_nodes[b] each)."""
        offsets = [0, *accumulate(n_nodes)][:-1]  # [B] first row of each request
        flat_kept = torch.tensor([off + node for off, nodes in zip(offsets, kept, strict=True) for node in nodes],
                                 dtype=torch.int64, device=slots.device)  # [kept total] rows of slots
        self.kv.write(*self.kv.cells(reqs, root_pos, [len(nodes) for nodes in kept]), slots[flat_kept])
        dropped = torch.ones(len(slots), dtype=torch.bool, device=slots.device)
        dropped[flat_kept] = False
        self.kv.free(slots[dropped])
        for req, pos, nodes in zip(reqs, root_pos, kept, strict=True):
            req.kv_len = pos + len(nodes)

    def _count(self, req: Req, accepted_drafts: int, appended: int, drafted: int, depth: int) -> None:
        """Counters of one request's verify step; `depth` = its tree's deepest drafted node."""
        stats = self.stats
        add_step(stats.accepted_per_position, accepted_drafts, depth)
        add_step(req.spec_accept_per_position, accepted_drafts, depth)
        stats.verify_ct += 1
        stats.accepted_drafts += accepted_drafts
        stats.drafted += drafted
        stats.tokens += appended
        self.outputs.generated_tokens += appended
        req.spec_verify_ct += 1
        req.spec_accepted_drafts += accepted_drafts
        req.spec_drafted += drafted
        hist = req.spec_accept_histogram
        hist.extend([0] * (accepted_drafts + 1 - len(hist)))
        hist[accepted_drafts] += 1

    def _logprobs(self, reqs, logits, paths, token_lists):
        """Per request: (logprobs of the new tokens, their top-n lists, their token_ids_logprob lists), from the raw
        verify logits at the node each token was produced at (as plain decoding computes them); None when nobody
        asked."""
        want = [b for b, r in enumerate(reqs) if r.wants_logprobs()]
        if not want:
            return None
        out: list = [None] * len(reqs)
        for b in want:
            nodes = paths[b][: len(token_lists[b])]
            rows = logits[b, torch.tensor(nodes, device=self.device)]  # [k, V]
            ids = torch.tensor(token_lists[b], device=self.device)
            chosen, tops, probes = request_logprobs(reqs[b].params, rows, ids)
            out[b] = ([(c, t) for c, t in zip(chosen, token_lists[b], strict=True)], tops, probes)
        return out


def _node_paths(tree: DraftTree) -> list[list[list[int]]]:
    """Tokens on the path root -> node (root excluded, node included) for every node: [B][N] lists."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for toks, pars in zip(tokens, parents, strict=True):
        paths: list[list[int]] = []
        for i, p in enumerate(pars):
            paths.append([] if p < 0 else paths[p] + [toks[i]])
        out.append(paths)
    return out


def _merge_results(pick_first: torch.Tensor, first: VerifyResult, second: VerifyResult) -> VerifyResult:
    """Row b from `first` where pick_first[b], else from `second` (both computed on the same tree)."""
    def sel(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shape = (-1,) + (1,) * (a.dim() - 1)
        return torch.where(pick_first.view(shape), a, c)

    return VerifyResult(*(sel(getattr(first, f), getattr(second, f)) for f in
                          ("accept_len", "accepted_nodes", "bonus_tokens", "last_nodes", "new_tokens")))

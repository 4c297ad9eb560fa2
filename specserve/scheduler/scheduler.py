"""Scheduler: continuous batching over a token-slot KV cache.

Each ``step()`` runs one forward:
- a **prefill** (EXTEND) batch when waiting requests can be admitted: the radix cache supplies their cached
  prefix, prompts longer than ``--chunked-prefill-size`` are prefilled a chunk per step, admission stops at
  ``--max-running-requests`` and when the KV pool (free + evictable) cannot hold the new tokens plus a
  reserve for the decoding requests;
- otherwise a **decode** batch over every running request (one token each). When the pool cannot hold the
  step's tokens, requests are **retracted**: their KV goes to the radix cache (or is freed), they return to
  the head of the queue and are resumed later by prefilling prompt + output so far, so nothing is lost or
  duplicated.
Finished and aborted requests leave at once and give back their KV (to the radix cache when it is on).

The scheduler is synchronous and single-threaded; ``Engine`` (and the server) drive it from a loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specserve.attention import (
    ForwardBatch,
    ForwardMode,
    decode_attn_metadata,
    extend_inputs,
    last_token_rows,
    mixed_attn_metadata,
)
from specserve.cache.radix_cache import RadixCache
from specserve.config import ServerArgs
from specserve.sampling.sampler import (
    SamplingBatchInfo,
    compute_logprobs,
    greedy_ids,
    is_plain_greedy,
    request_logprobs,
    sample,
)
from specserve.scheduler.model_runner import ModelRunner
from specserve.scheduler.req import Req, ReqOutput
from specserve.scheduler.spec_decode import SpecDecoder
from specserve.speculative.base import PrefillChunk, create_proposer

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
RETRACT_RATIO_BUMP = 0.3
DECODE_LOG_INTERVAL = 40  # decode steps between two progress log lines (SGLang's default)
PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per LM-head call (bounds the [R, V] logits of a long prompt)


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_mixed_steps: int = 0  # --enable-mixed-chunk: prefill steps that also decoded the running requests
    generated_tokens: int = 0
    spec_verify_ct: int = 0  # per request per verify step
    spec_accepted_drafts: int = 0
    spec_drafted: int = 0
    spec_tokens: int = 0  # tokens produced by verify steps (accepted drafts + bonus, after finish trimming)
    spec_plain_steps: int = 0  # decode steps batch-aware speculation ran without speculation
    spec_shrunk_steps: int = 0  # speculative steps with a tree smaller than the configured one
    spec_trimmed_finishes: int = 0  # overlap scheduler: stop strings found after the next forward part had run
    # [k-1] = verify steps (per request) that accepted >= k drafted tokens (specserve.speculative.accept_stats)
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def avg_spec_accept_length(self) -> float:
        """Tokens per request per verify step since start (1.0 = no gain)."""
        return self.spec_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0


class Scheduler:
    @torch.inference_mode()  # pools, tables and weights are inference tensors, like everything made in step()
    def __init__(self, args: ServerArgs, runner: ModelRunner | None = None) -> None:
        self.args = args
        self.runner = runner or ModelRunner(args)
        self.device = self.runner.device
        self.allocator = self.runner.allocator
        self.req_pool = self.runner.req_to_token_pool
        self.tree = RadixCache(self.allocator.free, device=self.device, disable=args.disable_radix_cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the request whose prompt is part-way through prefill
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self._extra_outputs: list[ReqOutput] = []  # outputs made outside a step (retraction failures, a drain)
        self.prefilling: list[tuple[Req, int, int]] = []  # the prefill batch while it runs (see step)
        self.vocab_size = self.runner.spec.vocab_size
        self.context_len = self.runner.context_len
        self.spec: SpecDecoder | None = None
        if args.speculative_algorithm:
            self.spec = SpecDecoder(self, create_proposer(args, self.runner, self._alloc))
            for module in self.spec.proposer.draft_modules():
                self.runner.speed_up_forward(module)
        self.capture_layers = self.spec.proposer.capture_layers if self.spec else ()
        self._log_mark = (time.monotonic(), 0, 0, 0)  # (time, generated tokens, spec tokens, verify count)
        self._slots_per_decode = self.spec.slots_per_request() if self.spec else 1

    # ------------------------------------------------------------------ public API
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> ReqOutput | None:
        """Abort a waiting or running request; frees its KV. Returns its final output, or None if unknown."""
        self._drain_spec()
        for i, (req, start, take) in enumerate(self.prefilling):
            if req.rid == rid:  # its prefill raised: give back the chunk's slots unless its KV was counted
                del self.prefilling[i]
                return self._abort_failed_prefill(req, start, take)
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                if req.req_pool_idx is not None:  # a chunked or retracted request holding KV
                    self._release(req)
                if self.chunked is req:
                    self.chunked = None
                return self._finish_output(req, {"type": "abort", "message": "aborted"})
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self._release(req)
            return self._finish_output(req, {"type": "abort", "message": "aborted"})
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._release(req)
                return self._finish_output(req, {"type": "abort", "message": "aborted"})
        return None

    def _abort_failed_prefill(self, req: Req, start: int, take: int) -> ReqOutput:
        if self.chunked is req:
            self.chunked = None
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is not None:
            if req.kv_len == start:  # the forward never completed: the chunk's slots hold no cached KV
                self.allocator.free(self.req_pool.req_to_token[req.req_pool_idx, start : start + take].clone())
            self._release(req)
        return self._finish_output(req, {"type": "abort", "message": "aborted"})

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._extra_outputs)

    @torch.inference_mode()
    def step(self) -> list[ReqOutput]:
        """Run one forward (prefill if anything can be admitted, else decode)."""
        batch = self._select_prefill()
        if batch:
            self._drain_spec()
            # (req, kv_len before, tokens taken): a prefill that raises leaves these for abort() to release
            self.prefilling = [(r, r.kv_len, t) for r, t in batch]
            outputs = self._run_mixed(batch) if self._can_mix() else self._run_prefill(batch)
            self.prefilling = []
        elif self.running:
            outputs = self._run_decode()
        else:
            outputs = self._fail_unfittable()
        return self._take_extra_outputs() + outputs

    def _drain_spec(self) -> None:
        """The overlap scheduler holds the last speculative step's outputs until the next step: process them
        now, before something other than a speculative step touches the running requests."""
        if self.spec is None or self.spec.overlap is None or self.spec.overlap.pending is None:
            return
        self._extra_outputs.extend(self.spec.overlap.drain())
        self.running = [r for r in self.running if not r.finished]

    def _fail_unfittable(self) -> list[ReqOutput]:
        """Nothing runs, yet the head request cannot start: the pool is too small for it. Fail it."""
        req = self.chunked or (self.waiting[0] if self.waiting else None)
        if req is None:
            return []
        out = self.abort(req.rid)
        out.finished_reason = req.finished_reason = {
            "type": "abort", "message": "the request does not fit in the KV cache (--max-total-tokens)"}
        return [out]

    def flush_cache(self) -> bool:
        """Drop the prefix cache; only allowed when idle."""
        if self.has_work():
            return False
        self.tree.reset()
        self.allocator.clear()
        return True

    def kv_usage(self) -> float:
        return 1.0 - (self.allocator.available_size() + self.tree.evictable_size()) / self.runner.max_total_tokens

    # ------------------------------------------------------------------ memory
    def _available(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size()

    def _alloc(self, n: int) -> torch.Tensor | None:
        if self.allocator.available_size() < n:
            self.tree.evict(n - self.allocator.available_size())
        return self.allocator.alloc(n)

    def _decode_reserve(self, reqs: list[Req]) -> int:
        reserve = sum(math.ceil(r.remaining_new_tokens() * self.new_token_ratio) for r in reqs)
        return reserve + (len(reqs) * self._slots_per_decode if self.spec else 0)

    def _release(self, req: Req) -> None:
        """Give back req's KV: into the radix cache (freeing duplicates) or straight to the free list."""
        row, kv_len = req.req_pool_idx, req.kv_len
        slots = self.req_pool.req_to_token[row, :kv_len].clone()
        if self.tree.disable:
            self.allocator.free(slots)
        else:
            cached = self.tree.insert(req.fill_ids[:kv_len], slots)
            # [prefix_len, cached): computed by us but already in the tree -> ours are duplicates
            self.allocator.free(slots[req.prefix_len : max(cached, req.prefix_len)])
            self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(row)
        req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node = None, 0, 0, None
        if self.spec:  # drafting state is rebuilt by the prefill that resumes a retracted request
            self.spec.release(req)

    # ------------------------------------------------------------------ prefill
    def _select_prefill(self) -> list[tuple[Req, int]]:
        """Pick (request, tokens to prefill this step) pairs; allocates rows and slots."""
        budget = self.args.max_prefill_tokens
        if self.args.chunked_prefill_size > 0:
            budget = min(budget, self.args.chunked_prefill_size)
        batch: list[tuple[Req, int]] = []
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            take = self._take_chunk(req, budget, batch)
            if take == 0:
                self.chunked = req
            if take == 0 or self.chunked is not None:
                return batch
            budget -= take
        if self.args.schedule_policy == "lpm" and len(self.waiting) > 1:
            self._sort_waiting_by_prefix()
        while self.waiting and budget > 0:
            if len(self.running) + len(batch) >= self.runner.max_running_requests:
                break
            req = self.waiting[0]
            if not self._admit(req, batch):
                break
            take = self._take_chunk(req, budget, batch)
            if take == 0:
                self._unadmit(req)
                break
            self.waiting.popleft()
            budget -= take
            if self.chunked is not None:
                break
        return batch

    def _sort_waiting_by_prefix(self) -> None:
        def matched(r: Req) -> int:
            return len(self.tree.match_prefix(r.fill_ids[:-1])[0])

        self.waiting = deque(sorted(self.waiting, key=matched, reverse=True))

    def _admit(self, req: Req, batch: list[tuple[Req, int]]) -> bool:
        """Give req a req_to_token row and its cached prefix, if memory allows."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        prefix, node = self.tree.match_prefix(req.fill_ids[:-1])  # keep >= 1 token to compute logits
        if req.input_logprobs is not None and not req.input_logprobs.complete:
            prefix = prefix[: req.input_logprobs.next_position()]  # the scored positions are computed, not cached
        self.tree.inc_lock_ref(node)
        need = req.seq_len - len(prefix)
        reserve = self._decode_reserve(self.running + [r for r, _ in batch] + [req])
        if self._available() < min(need, self._chunk_cap()) + reserve and (self.running or batch):
            self.tree.dec_lock_ref(node)
            self.req_pool.free(row)
            return False
        self.req_pool.write(row, 0, prefix)
        req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node = row, len(prefix), len(prefix), node
        if not req.admitted_once:
            req.cached_tokens, req.admitted_once = len(prefix), True
        return True

    def _chunk_cap(self) -> int:
        cap = self.args.max_prefill_tokens
        return min(cap, self.args.chunked_prefill_size) if self.args.chunked_prefill_size > 0 else cap

    def _take_chunk(self, req: Req, budget: int, batch: list[tuple[Req, int]]) -> int:
        """Allocate slots for up to `budget` of req's unprefilled tokens and add it to the batch.

        Returns the tokens taken; 0 when the pool cannot supply them (the caller puts req back).
        """
        need = req.seq_len - req.kv_len
        take = min(need, budget)
        slots = self._alloc(take) if take > 0 else None
        if slots is None:
            return 0
        self.req_pool.write(req.req_pool_idx, req.kv_len, slots)
        batch.append((req, take))
        if take < need:
            self.chunked = req
        return take

    def _unadmit(self, req: Req) -> None:
        self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node = None, 0, 0, None

    def _run_prefill(self, batch: list[tuple[Req, int]]) -> list[ReqOutput]:
        self.stats.num_prefill_steps += 1
        q_lens = [t for _, t in batch]
        fb = ForwardBatch(ForwardMode.EXTEND, *self._prefill_inputs(batch), self.runner.kv_pool,
                          logits_indices=last_token_rows(q_lens, self.device), capture_layers=self.capture_layers)
        return self._after_prefill(batch, self.runner.forward(fb), [])

    def _prefill_inputs(self, batch: list[tuple[Req, int]]):
        """(ids [T], positions [T], out_cache_loc [T], AttnMetadata) of the batch's prefill chunks."""
        return extend_inputs(self.req_pool.req_to_token, [r.req_pool_idx for r, _ in batch],
                             [r.kv_len for r, _ in batch], [r.fill_ids[r.kv_len : r.kv_len + t] for r, t in batch],
                             may_split=True)

    def _after_prefill(self, batch: list[tuple[Req, int]], out, decode_reqs: list[Req]) -> list[ReqOutput]:
        """After a forward whose logits rows are decode_reqs' (one each, first) then the batch's last chunk rows:
        advance the chunks, sample for decode_reqs and the requests whose prompt is now complete (they start
        running), and let the drafter catch up on the prefill."""
        q_lens = [t for _, t in batch]
        n_dec = len(decode_reqs)
        row_starts = [n_dec + sum(q_lens[:i]) for i in range(len(q_lens))]  # forward rows of each chunk
        chunks = [PrefillChunk(r, r.kv_len, t, row, r is not self.chunked)
                  for (r, t), row in zip(batch, row_starts, strict=True)]
        self._score_prompts(chunks, out.hidden)
        done_rows, done_reqs, prefill_only = list(range(n_dec)), [], []
        for i, (req, take) in enumerate(batch):
            req.kv_len += take
            if req is self.chunked:
                continue
            if req.params.max_new_tokens == 0:
                prefill_only.append(req)
            else:
                done_rows.append(n_dec + i)
                done_reqs.append(req)
        outputs = [self._finish_prefill_only(req) for req in prefill_only]
        if done_rows:
            outputs += self._sample_and_append(decode_reqs + done_reqs, out.logits[done_rows])  # logits [R, V]
            self.running.extend(r for r in done_reqs if not r.finished)
        if self.spec:
            self.spec.proposer.after_prefill(chunks, out)
        return outputs

    def _score_prompts(self, chunks: list[PrefillChunk], hidden: torch.Tensor) -> None:
        """Input (prompt) logprobs of the chunks' requests that asked for them, from the forward's final hidden
        states [T, h]: the logits at prompt position p score prompt token p + 1. Before the chunks' kv_len moves."""
        for c in chunks:
            lp = c.req.input_logprobs
            if lp is None or lp.complete:
                continue
            prompt = c.req.origin_input_ids
            first, last = lp.next_position(), min(c.start + c.length, len(prompt) - 1)  # positions [first, last)
            for lo in range(first, last, PROMPT_LOGPROB_ROWS):  # [R, V] logits a slice at a time
                hi = min(lo + PROMPT_LOGPROB_ROWS, last)
                rows = torch.arange(c.row_offset + lo - c.start, c.row_offset + hi - c.start, device=self.device)
                logits = self.runner.model.compute_logits(hidden.index_select(0, rows))  # [R, V]
                targets = torch.tensor(prompt[lo + 1 : hi + 1], device=self.device)
                chosen, tops, probes = request_logprobs(c.req.params, logits, targets)
                lp.logprobs.extend(chosen)
                lp.top.extend(tops)
                lp.ids.extend(probes)

    def _finish_prefill_only(self, req: Req) -> ReqOutput:
        """A max_new_tokens 0 request ends once its prompt is prefilled (scored), with no token sampled."""
        req.finished_reason = {"type": "length", "length": 0}
        self._release(req)
        return self._step_output(req)

    # ------------------------------------------------------------------ mixed prefill + decode
    def _can_mix(self) -> bool:
        """--enable-mixed-chunk: the running requests decode in the prefill's forward, when their slots are free
        now (a step never retracts in the middle of a prefill; the next decode step does that if needed)."""
        return (self.args.enable_mixed_chunk and self.spec is None and bool(self.running)
                and self._available() >= len(self.running))

    def _run_mixed(self, batch: list[tuple[Req, int]]) -> list[ReqOutput]:
        """One forward over a decode token per running request (rows first) and the batch's prefill chunks, each
        group attending on its own (``mixed_attn_metadata``), so the decode rows are not padded to the chunk."""
        self.stats.num_prefill_steps += 1
        self.stats.num_mixed_steps += 1
        self._count_decode_step()
        reqs = list(self.running)
        d_ids, d_pos, d_slots, d_attn = self._decode_inputs(reqs)
        p_ids, p_pos, p_slots, p_attn = self._prefill_inputs(batch)
        q_lens = [t for _, t in batch]
        n_dec = len(reqs)
        rows = torch.cat([torch.arange(n_dec, device=self.device), n_dec + last_token_rows(q_lens, self.device)])
        attn = mixed_attn_metadata([(n_dec, d_attn), (len(p_ids), p_attn)])
        fb = ForwardBatch(ForwardMode.EXTEND, torch.cat([d_ids, p_ids]), torch.cat([d_pos, p_pos]),
                          torch.cat([d_slots, p_slots]), attn, self.runner.kv_pool, logits_indices=rows)
        out = self.runner.forward(fb)  # logits [len(reqs) + len(batch), V]
        for r in reqs:
            r.kv_len += 1
        outputs = self._after_prefill(batch, out, reqs)
        self.running = [r for r in self.running if not r.finished]
        return outputs

    # ------------------------------------------------------------------ decode
    def _run_decode(self) -> list[ReqOutput]:
        self._ensure_decode_room()
        if not self.running:
            return []
        self._count_decode_step()
        if self.spec:
            outputs = self.spec.run(self.running)
        else:
            outputs, _ = self.plain_decode(self.running)
        self.running = [r for r in self.running if not r.finished]
        return outputs

    def plain_decode(self, reqs: list[Req], capture_layers: tuple[int, ...] = ()) -> tuple[list[ReqOutput], object]:
        """One plain decode forward (one token per request): sample, append, release finished ones.
        -> (outputs, the forward's ModelOutput: hidden [B, h] and the captured layers, for a drafter's backlog)."""
        fb = ForwardBatch(ForwardMode.DECODE, *self._decode_inputs(reqs), self.runner.kv_pool,
                          capture_layers=capture_layers)
        out = self.runner.forward(fb)  # logits [B, V]
        for r in reqs:
            r.kv_len += 1
        return self._sample_and_append(reqs, out.logits), out

    def _decode_inputs(self, reqs: list[Req]):
        """A slot per request for its next token, written into req_to_token -> (ids [B], positions [B],
        out_cache_loc [B], AttnMetadata)."""
        slots = self._alloc(len(reqs))
        kv_lens = [r.seq_len for r in reqs]  # the new token is the last key
        host = [r.req_pool_idx for r in reqs] + [n - 1 for n in kv_lens] + [r.last_token for r in reqs]
        rows, positions, ids = torch.tensor(host, dtype=torch.int64, device=self.device).view(3, -1).unbind(0)  # [B]
        self.req_pool.req_to_token[rows, positions] = slots
        return ids, positions, slots, decode_attn_metadata(self.req_pool.req_to_token, rows, positions, kv_lens)

    def _count_decode_step(self) -> None:
        self.stats.num_decode_steps += 1
        if self.stats.num_decode_steps % DECODE_LOG_INTERVAL == 0:
            self._log_progress()
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def _log_progress(self) -> None:
        """One line per DECODE_LOG_INTERVAL decode steps: batch, queue, KV use, throughput (and accept length)."""
        st, now = self.stats, time.monotonic()
        t0, gen0, spec0, ver0 = self._log_mark
        self._log_mark = (now, st.generated_tokens, st.spec_tokens, st.spec_verify_ct)
        line = (f"decode: #running-req {len(self.running)}, #queue-req {len(self.waiting)}, "
                f"KV usage {self.kv_usage():.1%}, gen throughput {(st.generated_tokens - gen0) / (now - t0):.1f} tok/s")
        if self.spec and st.spec_verify_ct > ver0:
            line += f", accept len {(st.spec_tokens - spec0) / (st.spec_verify_ct - ver0):.2f}"
        logger.info(line)

    def _ensure_decode_room(self) -> None:
        """Retract until the step's slots fit (one per running request; with speculation, its drafting and
        verify slots): a part-prefilled request first, then running requests, latest admitted first. A lone
        request that still does not fit is failed."""
        while self.running and self._available() < len(self.running) * self._slots_per_decode:
            if self.spec is not None and self.spec.overlap is not None and self.spec.overlap.pending is not None:
                self._drain_spec()  # finished requests give back their KV first; retraction needs the pipeline empty
                continue
            if self.chunked is not None:
                req, self.chunked = self.chunked, None
            elif len(self.running) > 1:
                req = self.running.pop()
            else:
                req = self.running.pop()
                self._release(req)
                reason = {"type": "abort", "message": "KV cache too small for this request"}
                self._extra_outputs.append(self._finish_output(req, reason))
                break
            self._release(req)
            req.retracted_count += 1
            self.stats.num_retractions += 1
            self.waiting.appendleft(req)
            self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_BUMP)
            logger.debug("retracted %s (%d tokens so far)", req.rid, len(req.output_ids))

    def _take_extra_outputs(self) -> list[ReqOutput]:
        out, self._extra_outputs = self._extra_outputs, []
        return out

    # ------------------------------------------------------------------ sampling and finishing
    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> list[ReqOutput]:
        """logits [B, V] (one row per req) -> sample, append, check finish, release finished."""
        if all(is_plain_greedy(r.params, len(r.output_ids)) for r in reqs):
            next_ids = greedy_ids(logits)  # nothing to process: skip building the sampling batch
        else:
            info = SamplingBatchInfo.from_params(
                [r.params for r in reqs], [r.generator for r in reqs], [r.origin_input_ids for r in reqs],
                [r.output_ids for r in reqs], [r.stop_ids for r in reqs], self.vocab_size, self.device,
            )
            next_ids = sample(logits, info)
        lp = self._logprobs(reqs, logits, next_ids)
        next_list = next_ids.tolist()
        outputs = []
        for i, (req, tok) in enumerate(zip(reqs, next_list, strict=True)):
            if lp is not None and req.wants_logprobs():
                req.logprobs.append((float(lp[0][i]), tok))
                req.top_logprobs.append(lp[1][i])
                req.ids_logprobs.append(lp[2][i])
            self._append_token(req, tok)
            self.stats.generated_tokens += 1
            if req.finished:
                self._release(req)
            if (out := self._step_output(req)) is not None:
                outputs.append(out)
        return outputs

    def _logprobs(self, reqs: list[Req], logits: torch.Tensor, next_ids: torch.Tensor):
        if not any(r.wants_logprobs() for r in reqs):
            return None
        top_n = [r.params.top_logprobs_num if r.wants_logprobs() else 0 for r in reqs]
        probes = [r.params.token_ids_logprob if r.wants_logprobs() else None for r in reqs]
        temps = [r.params.temperature if r.params.temp_scaled_logprobs else 1.0 for r in reqs]
        return compute_logprobs(logits, next_ids, top_n, probes, temps)

    def _append_token(self, req: Req, tok: int) -> None:
        """Append one sampled token and decide whether req finishes on it."""
        req.output_ids.append(tok)
        self._check_finish(req, tok, len(req.output_ids))

    def _check_finish(self, req: Req, tok: int, n_out: int) -> None:
        """Decide whether req finishes on `tok`, its n_out-th output token (stop strings see it here)."""
        past_min = n_out >= req.params.min_new_tokens
        matched = None
        stop_id = self.hits_stop_id(req, tok, n_out)
        if req.stop_checker is not None and not (stop_id and not req.params.no_stop_trim):
            text, matched = req.stop_checker.add([tok], allow_match=past_min)  # a matched stop id shows no text
            req.pending_text += text
        if stop_id:
            req.finished_reason = {"type": "stop", "matched": tok}
        elif matched is not None:
            req.finished_reason = {"type": "stop", "matched": matched}
            return
        elif self.ends_by_length(req, n_out):
            req.finished_reason = {"type": "length", "length": n_out}
        if req.finished and req.stop_checker is not None:
            req.pending_text += req.stop_checker.flush()

    @staticmethod
    def hits_stop_id(req: Req, tok: int, n_out: int) -> bool:
        """`tok`, the n_out-th output token, is an EOS / stop_token_id and min_new_tokens is reached."""
        return n_out >= req.params.min_new_tokens and tok in req.stop_ids

    def ends_by_length(self, req: Req, n_out: int) -> bool:
        """max_new_tokens or the context length is reached with n_out output tokens."""
        return n_out >= req.params.max_new_tokens or len(req.origin_input_ids) + n_out >= self.context_len

    def ends_without_text(self, req: Req, tok: int, n_out: int) -> bool:
        """Whether req finishes on its n_out-th token `tok` for a reason that needs no detokenization (a stop id
        past min_new_tokens, max_new_tokens, the context length): ``_check_finish`` minus stop strings."""
        return self.hits_stop_id(req, tok, n_out) or self.ends_by_length(req, n_out)

    def _step_output(self, req: Req, completion: int | None = None) -> ReqOutput | None:
        """req's output tokens not sent yet, as one output, or None while they may wait (``should_send``).

        completion: output tokens so far (default len(req.output_ids); the overlap scheduler passes its own count,
        as the forward thread may already have appended the next step's tokens)."""
        completion = len(req.output_ids) if completion is None else completion
        if not self.should_send(req, completion):
            return None
        new_ids = req.output_ids[req.sent_tokens : completion]
        new_logprobs = req.logprobs[req.sent_logprobs :] if req.wants_logprobs() else []
        new_top = req.top_logprobs[req.sent_logprobs :] if req.wants_logprobs() else []
        new_ids_lp = req.ids_logprobs[req.sent_logprobs :] if req.wants_logprobs() else []
        req.sent_tokens, req.sent_logprobs = completion, len(req.logprobs)
        input_lp = None
        if req.input_logprobs is not None and not req.sent_input_logprobs:
            input_lp, req.sent_input_logprobs = req.input_logprobs, True
        return ReqOutput(
            rid=req.rid,
            new_token_ids=new_ids,
            finished_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=completion,
            cached_tokens=req.cached_tokens,
            new_logprobs=new_logprobs,
            new_top_logprobs=new_top,
            new_ids_logprobs=new_ids_lp,
            input_logprobs=input_lp,
            new_text=self._take_text(req),
            spec=req.spec_meta(completion) if self.spec else {},
        )

    def should_send(self, req: Req, completion: int) -> bool:
        """Whether req's unsent tokens go out now: always when it finishes; its first token at once (time to first
        token); then, for a streamed request, every ``--stream-interval`` tokens. A non-streaming request's
        caller only reads the finished result, so its tokens wait for the finish (SGLang's rule)."""
        if req.finished:
            return True
        pending = completion - req.sent_tokens
        if pending <= 0:
            return False
        return req.sent_tokens == 0 or (req.stream and pending >= self.args.stream_interval)

    @staticmethod
    def _take_text(req: Req) -> str | None:
        if req.stop_checker is None:
            return None
        text, req.pending_text = req.pending_text, ""
        return text

    def _finish_output(self, req: Req, reason: dict) -> ReqOutput:
        """Finish req with `reason` (an abort, a failure) -> its last output, with any tokens not sent yet."""
        req.finished_reason = reason
        out = self._step_output(req)
        assert out is not None  # a finished request always gets its output
        return out


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
import weakref
from collections import deque
from dataclasses import asdict, dataclass

import torch

from specserve.attention import ForwardBatch, ForwardMode, extend_inputs, last_token_rows
from specserve.cache.kv_manager import KVManager
from specserve.config import ServerArgs
from specserve.request import Req, ReqOutput
from specserve.sampling.params import SamplingParams
from specserve.sampling.sampler import request_logprobs
from specserve.scheduler.decode_step import DecodeContext, make_decode_step
from specserve.scheduler.model_runner import ModelRunner
from specserve.scheduler.output import OutputProcessor
from specserve.speculative.base import PrefillChunk

logger = logging.getLogger(__name__)



def _weak_method(method):
    """A callable running ``method`` without keeping its object alive."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def _aborted() -> dict:
    return {"type": "abort", "message": "aborted"}

INIT_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
RETRACT_RATIO_BUMP = 0.3
# warm-up requests (``Scheduler.warm_up``), greedy, EOS ignored, ids spread over the vocabulary: groups run one after
# the other, (prompt length, new tokens) each. First requests with as many keys each (no attention mask), then with
# unequal ones (a mask); each group's batch shrinks as its requests end (3, 2, then 1 request in the second), so the
# graphs built take any batch size; then two lone requests of unequal prompts (a drafter's catch-up over a prompt,
# batch-1 steps at several lengths). Each mode of batch-aware speculation gets its tries in each batch size.
WARM_UP_GROUPS = (((16, 24), (16, 24), (16, 12)), ((16, 64), (11, 24), (13, 12)), ((24, 48),), ((9, 48),))
DECODE_LOG_INTERVAL = 40  # decode steps between two progress log lines (SGLang's default)
PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per LM-head call (bounds the [R, V] logits of a long prompt)


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_mixed_steps: int = 0  # --enable-mixed-chunk: prefill steps that also decoded the running requests


class Scheduler:
    @torch.inference_mode()  # pools, tables and weights are inference tensors, like everything made in step()
    def __init__(self, args: ServerArgs, runner: ModelRunner | None = None) -> None:
        self.args = args
        self.runner = runner or ModelRunner(args)
        self.grammar_stats = None  # the grammar backend's GrammarStats, set by the loop that compiles grammars
        self.device = self.runner.device
        self.kv = KVManager(self.runner.allocator, self.runner.req_to_token_pool, self.runner.max_total_tokens,
                            self.device, disable_radix_cache=args.disable_radix_cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the request whose prompt is part-way through prefill
        self._extra_outputs: list[ReqOutput] = []  # outputs made outside a step (retraction failures, a drain)
        self.prefilling: list[tuple[Req, int, int]] = []  # the prefill batch while it runs (see step)
        self.context_len = self.runner.context_len
        # the processor calls back into the scheduler through a weak reference: a scheduler held in a reference cycle
        # would keep its KV pools alive after its engine is gone, until a full garbage collection
        self.outputs = OutputProcessor(args.stream_interval, self.context_len, self.runner.spec.vocab_size,
                                       self.device, _weak_method(self._release),
                                       check_first_grammar=not args.disable_grammar_check_first,
                                       jump_forward_grammar=not (args.disable_grammar_jump_forward
                                                                 or args.enable_spec_v2),
                                       jump_rows=self.runner.decode_rows)
        self.decoder = make_decode_step(DecodeContext(args, self.runner, self.kv, self.outputs))
        self._start_counting()

    def _start_counting(self) -> None:
        """The scheduler's counters and admission estimate as before any request (at start, after the warm-up)."""
        self.stats, self.new_token_ratio = SchedulerStats(), INIT_NEW_TOKEN_RATIO
        self.outputs.generated_tokens = 0
        self._log_mark = (time.monotonic(), 0, 0, 0)  # (time, generated tokens, verify-step tokens, verify count)

    # ------------------------------------------------------------------ public API
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> ReqOutput | None:
        """Abort a waiting or running request; frees its KV. Returns its final output, or None if unknown."""
        self._drain_decoder()
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
                return self.outputs.finish_output(req, _aborted())
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self._release(req)
            return self.outputs.finish_output(req, _aborted())
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._release(req)
                return self.outputs.finish_output(req, _aborted())
        return None

    def _abort_failed_prefill(self, req: Req, start: int, take: int) -> ReqOutput:
        if self.chunked is req:
            self.chunked = None
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is not None:
            if req.kv_len == start:  # the forward never completed: the chunk's slots hold no cached KV
                self.kv.drop_uncomputed(req, start, take)
            self._release(req)
        return self.outputs.finish_output(req, _aborted())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._extra_outputs)

    @torch.inference_mode()
    def step(self) -> list[ReqOutput]:
        """Run one forward (prefill if anything can be admitted, else decode)."""
        batch = self._select_prefill()
        if batch:
            self._drain_decoder()
            # (req, kv_len before, tokens taken): a prefill that raises leaves these for abort() to release
            self.prefilling = [(r, r.kv_len, t) for r, t in batch]
            outputs = self._run_mixed(batch) if self._can_mix() else self._run_prefill(batch)
            self.prefilling = []
        elif self.running:
            outputs = self._run_decode()
        else:
            outputs = self._fail_unfittable()
        return self._take_extra_outputs() + outputs

    def _drain_decoder(self) -> None:
        """The overlap scheduler holds the last speculative step's outputs until the next step: process them
        now, before something other than a decode step touches the running requests."""
        if not self.decoder.has_pending():
            return
        self._extra_outputs.extend(self.decoder.drain())
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

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run warm-up requests to their end before any other (with torch.compile: the decode, verify and draft
        graphs are built now, not during the first users' requests), then drop what they left: the prefix cache,
        the counters, the batch policy's measurements. -> seconds taken."""
        start = time.perf_counter()
        vocab = self.runner.spec.vocab_size
        room = self.context_len  # prompt + new tokens, as requests are capped (``RequestFactory.params``)
        for i, group in enumerate(WARM_UP_GROUPS):
            for j, (prompt_len, new_tokens) in enumerate(group):
                prompt_len = min(prompt_len, room // 2)
                new_tokens = min(new_tokens, room - prompt_len)
                if prompt_len < 1 or new_tokens < 1:
                    continue
                ids = [(97 * (32 * (3 * i + j) + k) + 1) % vocab for k in range(prompt_len)]
                params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True).normalize()
                self.add_request(Req(f"warm-up-{i}-{j}", ids, params, set(), None))
            while self.has_work():
                self.step()
        self.flush_cache()
        self._start_counting()
        self.decoder.reset_counters()
        return time.perf_counter() - start

    def flush_cache(self) -> bool:
        """Drop the prefix cache; only allowed when idle."""
        if self.has_work():
            return False
        self.kv.reset()
        return True

    def kv_usage(self) -> float:
        return self.kv.usage()

    def server_info(self) -> dict:
        """The scheduler's state and every component's counters (the server's /server_info fields)."""
        return {
            "max_total_tokens": self.runner.max_total_tokens,
            "max_total_num_tokens": self.runner.max_total_tokens,  # SGLang's name
            "max_req_input_len": self.context_len - 1,
            "page_size": 1,  # the KV cache holds one token per slot
            "context_length": self.context_len,
            "max_running_requests": self.runner.max_running_requests,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_chunked_reqs": int(self.chunked is not None),
            **self.kv.stats(),
            **asdict(self.stats),
            "generated_tokens": self.outputs.generated_tokens,
            **self.runner.info(),
            **self.decoder.info(),
            **(self.grammar_stats.info() if self.grammar_stats is not None else {}),
        }

    # ------------------------------------------------------------------ memory
    def _decode_reserve(self, reqs: list[Req]) -> int:
        reserve = sum(math.ceil(r.remaining_new_tokens() * self.new_token_ratio) for r in reqs)
        return reserve + len(reqs) * self.decoder.reserve_per_request()

    def _release(self, req: Req) -> None:
        """req leaves the batch: its KV goes back (``KVManager.release``), its decoding state is dropped (rebuilt by
        the prefill that resumes a retracted request)."""
        self.kv.release(req)
        self.decoder.release(req)

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
                self.kv.unadmit(req)
                break
            self.waiting.popleft()
            budget -= take
            if self.chunked is not None:
                break
        return batch

    def _sort_waiting_by_prefix(self) -> None:
        self.waiting = deque(sorted(self.waiting, key=lambda r: self.kv.cached_prefix_len(r.fill_ids), reverse=True))

    def _admit(self, req: Req, batch: list[tuple[Req, int]]) -> bool:
        """Give req a table row and its cached prefix, if memory allows (a lone request always gets in)."""
        reserve = self._decode_reserve(self.running + [r for r, _ in batch] + [req])
        return self.kv.admit(req, reserve, self._chunk_cap(), force=not (self.running or batch))

    def _chunk_cap(self) -> int:
        cap = self.args.max_prefill_tokens
        return min(cap, self.args.chunked_prefill_size) if self.args.chunked_prefill_size > 0 else cap

    def _take_chunk(self, req: Req, budget: int, batch: list[tuple[Req, int]]) -> int:
        """Allocate slots for up to `budget` of req's unprefilled tokens and add it to the batch.

        Returns the tokens taken; 0 when the pool cannot supply them (the caller puts req back).
        """
        need = req.unforwarded
        take = min(need, budget)
        if take <= 0 or not self.kv.extend(req, take):
            return 0
        batch.append((req, take))
        if take < need:
            self.chunked = req
        return take

    def _run_prefill(self, batch: list[tuple[Req, int]]) -> list[ReqOutput]:
        self.stats.num_prefill_steps += 1
        q_lens = [t for _, t in batch]
        fb = ForwardBatch(ForwardMode.EXTEND, *self._prefill_inputs(batch), self.runner.kv_pool,
                          logits_indices=last_token_rows(q_lens, self.device),
                          capture_layers=self.decoder.capture_layers)
        return self._after_prefill(batch, self.runner.forward(fb), [])

    def _prefill_inputs(self, batch: list[tuple[Req, int]]):
        """(ids [T], positions [T], out_cache_loc [T], AttnMetadata) of the batch's prefill chunks."""
        return extend_inputs(self.runner.attn_backend, self.kv.table, [r.req_pool_idx for r, _ in batch],
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
            outputs += self.outputs.sample_and_append(decode_reqs + done_reqs, out.logits[done_rows])  # [R, V]
            self.running.extend(r for r in done_reqs if not r.finished)
        self.decoder.after_prefill(chunks, out)
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
        return self.outputs.step_output(req)

    # ------------------------------------------------------------------ mixed prefill + decode
    def _can_mix(self) -> bool:
        """--enable-mixed-chunk: the running requests decode in the prefill's forward, when their slots are free
        now (a step never retracts in the middle of a prefill; the next decode step does that if needed)."""
        return (self.args.enable_mixed_chunk and self.decoder.mixes_with_prefill and bool(self.running)
                and self.kv.available() >= len(self.running)
                and all(r.unforwarded == 1 for r in self.running))  # no forced tokens waiting for KV

    def _run_mixed(self, batch: list[tuple[Req, int]]) -> list[ReqOutput]:
        """One forward over a decode token per running request (rows first) and the batch's prefill chunks, each
        group attending on its own (``AttentionBackend.mixed``), so the decode rows are not padded to the chunk."""
        self.stats.num_prefill_steps += 1
        self.stats.num_mixed_steps += 1
        self._count_decode_step()
        reqs = list(self.running)
        d_ids, d_pos, d_slots, d_attn = self.decoder.mixed_inputs(reqs)
        p_ids, p_pos, p_slots, p_attn = self._prefill_inputs(batch)
        q_lens = [t for _, t in batch]
        n_dec = len(reqs)
        rows = torch.cat([torch.arange(n_dec, device=self.device), n_dec + last_token_rows(q_lens, self.device)])
        attn = self.runner.attn_backend.mixed([(n_dec, d_attn), (len(p_ids), p_attn)])
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
        outputs = self.decoder.run(self.running)
        self.running = [r for r in self.running if not r.finished]
        return outputs

    def _count_decode_step(self) -> None:
        self.stats.num_decode_steps += 1
        if self.stats.num_decode_steps % DECODE_LOG_INTERVAL == 0:
            self._log_progress()
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def _log_progress(self) -> None:
        """One line per DECODE_LOG_INTERVAL decode steps: batch, queue, KV use, throughput (and accept length)."""
        now, generated = time.monotonic(), self.outputs.generated_tokens
        verified, verify_ct = self.decoder.accept_counts()
        t0, gen0, spec0, ver0 = self._log_mark
        self._log_mark = (now, generated, verified, verify_ct)
        line = (f"decode: #running-req {len(self.running)}, #queue-req {len(self.waiting)}, "
                f"KV usage {self.kv_usage():.1%}, gen throughput {(generated - gen0) / (now - t0):.1f} tok/s")
        if verify_ct > ver0:
            line += f", accept len {(verified - spec0) / (verify_ct - ver0):.2f}"
        logger.info(line)

    def _ensure_decode_room(self) -> None:
        """Retract until the step's slots fit (one per running request, or one per token a grammar forced since its
        last forward; with speculation, its drafting and verify slots): a part-prefilled request first, then running
        requests, latest admitted first. A lone request that still does not fit is failed."""
        while self.running and self.kv.available() < self.decoder.slots_needed(self.running):
            if self.decoder.has_pending():
                self._drain_decoder()  # finished requests give back their KV first; retraction needs the pipeline empty
                continue
            if self.chunked is not None:
                req, self.chunked = self.chunked, None
            elif len(self.running) > 1:
                req = self.running.pop()
            else:
                req = self.running.pop()
                self._release(req)
                reason = {"type": "abort", "message": "KV cache too small for this request"}
                self._extra_outputs.append(self.outputs.finish_output(req, reason))
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

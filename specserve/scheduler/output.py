"""OutputProcessor: what happens to a request's tokens once a forward produced them.

Sampling a step's logits and appending the tokens (``sample_and_append``), the finish checks (stop ids, stop strings,
max_new_tokens, the context length) and the per-step ``ReqOutput`` deltas with their streaming rule. Prefill, plain
decode and speculative decode all emit tokens through it, so a request ends at exactly the same token whichever
produced it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.grammar.masks import allowed_rows, ban_mask, fill_rows, masked_greedy
from specserve.request import Req, ReqOutput
from specserve.sampling.sampler import SamplingBatchInfo, compute_logprobs, greedy_ids, is_plain_greedy, sample


class OutputProcessor:
    def __init__(self, stream_interval: int, context_len: int, vocab_size: int, device,
                 release: Callable[[Req], None], check_first_grammar: bool = True,
                 jump_forward_grammar: bool = False, jump_rows: int | None = None) -> None:
        self.stream_interval, self.context_len, self.vocab_size, self.device = (
            stream_interval, context_len, vocab_size, device)
        self.release = release  # gives back a finished request's KV and decoding state
        self.reports_spec_meta = False  # outputs carry the request's speculative counters (set by the decoder)
        self.generated_tokens = 0  # tokens appended to outputs since start
        self.check_first_grammar = check_first_grammar  # see sample_constrained
        self.jump_forward_grammar = jump_forward_grammar  # see append_forced (plain steps; verify steps jump in-tree)
        # the most rows a decode forward takes on the fastest kernels (ModelRunner.decode_rows; None: no limit): a
        # step appends forced tokens only into the rows its batch leaves free
        self.jump_rows = jump_rows

    # ------------------------------------------------------------------ sampling
    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> list[ReqOutput]:
        """logits [B, V] (one row per req) -> sample, append, check finish, release finished -> outputs due."""
        next_ids, advanced = self.sample_constrained(reqs, logits)
        lp = _logprobs(reqs, logits, next_ids)
        outputs = []
        room = None if self.jump_rows is None else self.jump_rows - len(reqs)  # rows for forced tokens
        for i, (req, tok) in enumerate(zip(reqs, next_ids.tolist(), strict=True)):
            if lp is not None and req.wants_logprobs():
                req.logprobs.append((float(lp[0][i]), tok))
                req.top_logprobs.append(lp[1][i])
                req.ids_logprobs.append(lp[2][i])
            req.output_ids.append(tok)
            if i not in advanced:
                req.accept_grammar(tok, len(req.output_ids))
            self.check_finish(req, tok, len(req.output_ids))
            self.generated_tokens += 1
            if self.jump_forward_grammar and req.grammar is not None and not req.finished and room != 0:
                jumped = self.append_forced(req, room)
                room = None if room is None else room - jumped
            if req.finished:
                self.release(req)
            if (out := self.step_output(req)) is not None:
                outputs.append(out)
        return outputs

    def append_forced(self, req: Req, most: int | None = None) -> int:
        """Jump-forward: the tokens req's grammar forces after its output so far (a JSON key, ``": "``, a closing
        brace: each the only token its mask allows, the grammar not accepting), appended as outputs without a forward
        of their own, up to ``most`` (None: all); the next forward runs them beside the request's last sampled token
        (``PlainDecode``). A draw under such a mask gives its one token whatever the logits, sampler and seed, so the
        output is the one token-by-token decoding gives. Not for a request that wants logprobs (each token's need its
        own logits). -> the tokens appended."""
        if req.wants_logprobs():
            return 0
        grammar, n = req.grammar, 0
        with grammar.stats.masking():
            while not req.finished and not grammar.terminated() and (most is None or n < most):
                tok = grammar.forced_token()
                if tok is None:
                    req.grammar_unforced = len(req.output_ids)
                    break
                if tok >= self.vocab_size or tok in req.stop_ids or not grammar.accept(tok):
                    break
                req.output_ids.append(tok)
                n += 1
                if grammar.terminated():
                    req.grammar_end = len(req.output_ids)
                self.check_finish(req, tok, len(req.output_ids))
        if n:
            self.generated_tokens += n
            req.spec_plain_tokens += n  # (a speculative engine's plain step: not tokens of its verify steps)
            grammar.stats.add_jumped(n)
        return n

    def sample_constrained(self, reqs: list[Req], logits: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
        """logits [B, V] -> (next ids [B] int64, the rows whose grammar has already advanced over its token).

        Check-first: a constrained row whose sampling keeps the winner of a subset a winner (``check_first``) draws
        its token without its grammar's mask; the grammar checks that one token (a few microseconds against the tens
        a mask takes), or names the token it forces there (a JSON key's, on llguidance), and only where it can say
        neither is the row drawn again under the mask. The token is the one the mask would have given: the argmax,
        or the exponential race's winner for the same noise, over the whole vocabulary is, when allowed, also the
        winner over the allowed tokens. Other constrained rows (top_k, top_p, min_p: truncation computed on the
        masked distribution) are masked first."""
        constrained = [b for b, r in enumerate(reqs) if r.grammar is not None]
        checked = [b for b in constrained if self.check_first_grammar and check_first(reqs[b])]
        if checked:
            checked_rows = set(checked)
            constrained = [b for b in constrained if b not in checked_rows]
        next_ids = self._draw(reqs, logits, self.grammar_ban(reqs, constrained))
        if not checked:
            return next_ids, set()
        stats = reqs[checked[0]].grammar.stats
        with stats.masking():
            drawn = next_ids.tolist()
            tokens = list(drawn)
            redraw = []
            for b in checked:
                picked = reqs[b].grammar_pick(drawn[b], len(reqs[b].output_ids) + 1)
                if picked is None:
                    redraw.append(b)
                else:
                    tokens[b] = picked
            taken = checked_rows.difference(redraw)
            refused = len(redraw) + sum(tokens[b] != drawn[b] for b in taken)
        stats.add_checks(len(checked), refused)
        if redraw:
            for b, tok in zip(redraw, self._redraw([reqs[b] for b in redraw], logits, redraw), strict=True):
                tokens[b] = tok
        if tokens != drawn:
            next_ids = torch.tensor(tokens, dtype=torch.int64, device=next_ids.device)  # [B]
        return next_ids, taken

    def _redraw(self, sub: list[Req], logits: torch.Tensor, rows: list[int]) -> list[int]:
        """The rows ``rows`` of logits [B, V] that check-first could not settle (their requests ``sub``), drawn under
        their grammars' masks -> their tokens. Greedy rows on CPU: the masked argmax in numpy, straight from the
        masks' bits (no ban tensor, no masked copy of the logits)."""
        if (logits.device.type == "cpu" and logits.dtype == torch.float32
                and all(is_plain_greedy(r.params, len(r.output_ids)) for r in sub)):
            with sub[0].grammar.stats.masking():
                bitmask, accepting = fill_rows([r.grammar for r in sub])
                allowed = allowed_rows(bitmask, accepting, [r.stop_ids for r in sub], self.vocab_size)
            return masked_greedy(logits.detach().numpy()[rows], allowed)
        return self._draw(sub, logits[rows], self.grammar_ban(sub)).tolist()

    def _draw(self, reqs: list[Req], logits: torch.Tensor, ban: torch.Tensor | None) -> torch.Tensor:
        """logits [B, V], ban bool [B, V] or None -> next ids [B] int64 (the sampler, or the argmax where nothing
        else processes the logits)."""
        if all(is_plain_greedy(r.params, len(r.output_ids)) for r in reqs):
            return greedy_ids(logits if ban is None else logits.masked_fill(ban, float("-inf")))
        info = SamplingBatchInfo.from_params(
            [r.params for r in reqs], [r.generator for r in reqs], [r.origin_input_ids for r in reqs],
            [r.output_ids for r in reqs], [r.stop_ids for r in reqs], self.vocab_size, self.device,
        )
        info.grammar_ban = ban
        return sample(logits, info)

    def grammar_ban(self, reqs: list[Req], rows: list[int] | None = None) -> torch.Tensor | None:
        """bool [B, V] ban mask of the grammars of requests ``rows`` (default: every request with a grammar) for their
        next token (True = banned; other rows ban nothing), or None when there is no such row."""
        if rows is None:
            rows = [b for b, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        with reqs[rows[0]].grammar.stats.masking():
            bitmask, accepting = fill_rows([reqs[b].grammar for b in rows])
            rows_ban = ban_mask(bitmask, accepting, [reqs[b].stop_ids for b in rows], self.vocab_size, self.device)
            if len(rows) == len(reqs):
                return rows_ban  # [B, V]
            ban = torch.zeros(len(reqs), self.vocab_size, dtype=torch.bool, device=self.device)  # [B, V]
            ban[rows] = rows_ban
        return ban

    # ------------------------------------------------------------------ finishing
    def check_finish(self, req: Req, tok: int, n_out: int) -> None:
        """Decide whether req finishes on `tok`, its n_out-th output token (stop strings see it here)."""
        if req.grammar_error is not None and req.grammar_error[0] == n_out:
            req.finished_reason = {"type": "abort", "message": req.grammar_error[1]}
            return
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
        """`tok`, the n_out-th output token, is an EOS / stop_token_id and min_new_tokens is reached, or the
        grammar's own stop token, after which its grammar allows nothing."""
        return (n_out >= req.params.min_new_tokens and tok in req.stop_ids) or req.grammar_end == n_out

    def ends_by_length(self, req: Req, n_out: int) -> bool:
        """max_new_tokens or the context length is reached with n_out output tokens."""
        return n_out >= req.params.max_new_tokens or len(req.origin_input_ids) + n_out >= self.context_len

    def ends_without_text(self, req: Req, tok: int, n_out: int) -> bool:
        """Whether req finishes on its n_out-th token `tok` for a reason that needs no detokenization (a stop id
        past min_new_tokens, max_new_tokens, the context length): ``check_finish`` minus stop strings."""
        return self.hits_stop_id(req, tok, n_out) or self.ends_by_length(req, n_out) or req.grammar_ends(n_out)

    # ------------------------------------------------------------------ outputs
    def step_output(self, req: Req, completion: int | None = None) -> ReqOutput | None:
        """req's output tokens not sent yet, as one output, or None while they may wait (``should_send``).

        completion: output tokens so far (default len(req.output_ids); the overlap scheduler passes its own count,
        as the forward thread may already have appended the next step's tokens)."""
        completion = len(req.output_ids) if completion is None else completion
        if not self.should_send(req, completion):
            return None
        wants = req.wants_logprobs()
        new_ids = req.output_ids[req.sent_tokens : completion]
        new_logprobs = req.logprobs[req.sent_logprobs :] if wants else []
        new_top = req.top_logprobs[req.sent_logprobs :] if wants else []
        new_ids_lp = req.ids_logprobs[req.sent_logprobs :] if wants else []
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
            new_text=_take_text(req),
            spec=req.spec_meta(completion) if self.reports_spec_meta else {},
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
        return req.sent_tokens == 0 or (req.stream and pending >= self.stream_interval)

    def finish_output(self, req: Req, reason: dict) -> ReqOutput:
        """Finish req with `reason` (an abort, a failure) -> its last output, with any tokens not sent yet."""
        req.finished_reason = reason
        out = self.step_output(req)
        assert out is not None  # a finished request always gets its output
        return out


def check_first(req: Req) -> bool:
    """Whether req's next token may be drawn check-first (``OutputProcessor.sample_constrained``): greedy, or sampled
    without top_k / top_p / min_p, so that masking can only remove tokens, never bring one into play."""
    p = req.params
    return p.is_greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)


def _logprobs(reqs: list[Req], logits: torch.Tensor, next_ids: torch.Tensor):
    if not any(r.wants_logprobs() for r in reqs):
        return None
    top_n = [r.params.top_logprobs_num if r.wants_logprobs() else 0 for r in reqs]
    probes = [r.params.token_ids_logprob if r.wants_logprobs() else None for r in reqs]
    temps = [r.params.temperature if r.params.temp_scaled_logprobs else 1.0 for r in reqs]
    return compute_logprobs(logits, next_ids, top_n, probes, temps)


def _take_text(req: Req) -> str | None:
    if req.stop_checker is None:
        return None
    text, req.pending_text = req.pending_text, ""
    return text

"""Req: one generation request's state inside the engine, and ReqOutput: what a step reports for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.sampling.params import SamplingParams


@dataclass
class ReqOutput:
    """New tokens of one request after a scheduler step (deltas), plus its meta when finished."""

    rid: str
    new_token_ids: list[int]
    finished_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[tuple[float, int]] = field(default_factory=list)  # (logprob, token id)
    new_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    new_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)  # token_ids_logprob
    input_logprobs: InputLogprobs | None = None  # the prompt's, in the request's first output only
    spec: dict[str, Any] = field(default_factory=dict)  # speculative counters (verify count, ...)
    new_text: str | None = None  # text delta, only for requests the scheduler detokenizes (stop strings)


@dataclass
class InputLogprobs:
    """Prompt (input) logprobs from prompt position `start` on: entry i is about prompt token start + i. Entry 0's
    logprob is None (it would need the logits at start - 1, which are not computed), as in SGLang."""

    start: int
    token_ids: list[int]  # prompt[start:]
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[tuple[float, int]] | None] = field(default_factory=list)  # with top_logprobs_num
    ids: list[list[tuple[float, int]] | None] = field(default_factory=list)  # with token_ids_logprob

    def __post_init__(self) -> None:
        if self.token_ids and not self.logprobs:  # entry 0: nothing predicts it
            self.logprobs.append(None)
            self.top.append(None)
            self.ids.append(None)

    @property
    def complete(self) -> bool:
        return len(self.logprobs) == len(self.token_ids)

    def next_position(self) -> int:
        """The prompt position whose logits score the next missing entry (logits at position p score token p+1)."""
        return self.start + len(self.logprobs) - 1


def input_logprob_start(params: SamplingParams, prompt_len: int) -> int | None:
    """The first prompt position with an input logprob entry, or None when the request asks for none.
    logprob_start_len -1 means the last prompt token (SGLang), or no entry at all for a prefill-only request."""
    if not params.return_logprob:
        return None
    start = params.logprob_start_len
    if start == -1:
        start = prompt_len if params.max_new_tokens == 0 else prompt_len - 1
    return start


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        stop_ids: set[int],
        generator: torch.Generator | None,
        stop_checker=None,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.stop_ids = stop_ids  # eos (unless ignore_eos) + stop_token_ids
        self.generator = generator
        self.stop_checker = stop_checker  # None when the request has no stop strings
        # structured outputs: the grammar matcher (specserve/grammar/), set once the grammar is compiled; it has
        # accepted every output token except a final stop id
        self.grammar = None
        # the output length at which the grammar ended (it accepted its own stop token: nothing may follow), and at
        # which it refused a token (an engine bug; the request ends with an error): the finish checks read these,
        # since the matcher itself may already be past that token (a verify step feeds it all its tokens first)
        self.grammar_end: int | None = None
        self.grammar_error: tuple[int, str] | None = None
        # the output length after which jump-forward found no token forced (the next pick need not look again)
        self.grammar_unforced: int | None = None
        # KV state: row in req_to_token, tokens whose KV is stored there, radix lock
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.prefix_len = 0  # leading tokens whose slots came from the radix cache (shared, not owned)
        self.last_node = None
        self.cached_tokens = 0  # reported: prompt tokens served from the prefix cache (first admission)
        self.finished_reason: dict[str, Any] | None = None
        self.retracted_count = 0
        self.logprobs: list[tuple[float, int]] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.ids_logprobs: list[list[tuple[float, int]] | None] = []  # token_ids_logprob, per output token
        start = input_logprob_start(params, len(input_ids))
        # the prompt's logprobs, filled by the prefill (None: not asked); sent_input: already in an output
        self.input_logprobs = None if start is None else InputLogprobs(start, list(input_ids[start:]))
        self.sent_input_logprobs = False
        self.created = time.monotonic()
        self.admitted_once = False
        self.pending_text = ""  # stop-string requests: text produced since the last output
        # outputs: a streamed request's tokens go out every --stream-interval tokens, others' at the finish
        self.stream = True
        self.sent_tokens = 0  # output tokens already in an output
        self.sent_logprobs = 0  # entries of logprobs / top_logprobs already in an output
        # speculative decoding: the proposer's per-request state and the request's counters
        self.spec_state: Any = None
        self.spec_verify_ct = 0  # verify forwards this request took part in
        self.spec_accepted_drafts = 0  # drafted tokens the target accepted
        self.spec_drafted = 0  # drafted tokens offered for verification
        self.spec_forced_tokens = 0  # accepted tokens its grammar forced (appended to the tree without drafting)
        self.spec_accept_histogram: list[int] = []  # [k] = verify steps that accepted k drafted tokens
        self.spec_accept_per_position: list[int] = []  # [k-1] = verify steps that accepted >= k drafted tokens
        # tokens from plain decode steps (batch-aware speculation turned it off), grammar-forced ones included
        self.spec_plain_tokens = 0
        self.spec_backlog: Any = None  # those tokens, not yet replayed to the drafter (spec_decode.Backlog)
        self.spec_stopped = False  # a verify step's forward part ended it (stop id / length); output not out yet

    @property
    def fill_ids(self) -> list[int]:
        """All tokens of the sequence so far (prompt + output)."""
        return self.origin_input_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.origin_input_ids[-1]

    def token_at(self, position: int) -> int:
        """The sequence's token at ``position`` (``fill_ids[position]`` without building the list)."""
        n = len(self.origin_input_ids)
        return self.origin_input_ids[position] if position < n else self.output_ids[position - n]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def unforwarded(self) -> int:
        """Tokens of the sequence without KV yet: a prompt's unprefilled part, or a running request's last token plus
        any its grammar forced after it (``OutputProcessor.append_forced``)."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    def accept_grammar(self, tok: int, n_out: int) -> None:
        """Advance the grammar over `tok`, the n_out-th output token (a stop id ends the request and is not fed).
        The token was sampled under the grammar's mask, so a refusal is an engine bug: the finish checks end the
        request there with an error."""
        if self.grammar is None or tok in self.stop_ids:
            return
        if not self.grammar.accept(tok):
            self.grammar_error = (n_out, f"internal error: the grammar refused token {tok}")
        elif self.grammar.terminated():
            self.grammar_end = n_out

    def grammar_pick(self, tok: int, n_out: int) -> int | None:
        """Check-first sampling: `tok`, the n_out-th output token, was drawn without the grammar's mask. -> the token
        a draw under the mask gives, with the grammar advanced over it, where the grammar knows it without a mask
        (``Matcher.pick``); None when only the mask can say. A drawn stop id is the mask's to judge."""
        if tok in self.stop_ids or (picked := self.grammar.pick(tok, self.grammar_unforced == n_out - 1)) is None:
            return None
        if self.grammar.terminated():
            self.grammar_end = n_out
        return picked

    def grammar_ends(self, n_out: int) -> bool:
        """The grammar ends the output at its n_out-th token (its stop token, or a refused one)."""
        return n_out in (self.grammar_end, self.grammar_error and self.grammar_error[0])

    def wants_logprobs(self) -> bool:
        return bool(self.params.return_logprob)

    def spec_meta(self, completion: int | None = None) -> dict[str, Any]:
        """Speculative metrics reported in meta_info (SGLang's names); completion = output tokens so far."""
        ct = self.spec_verify_ct
        completion = len(self.output_ids) if completion is None else completion
        return {
            "spec_verify_ct": ct,
            # SGLang's completion_tokens / verify steps, minus tokens of plain steps (batch-aware speculation)
            "spec_accept_length": (completion - self.spec_plain_tokens) / ct if ct else 0.0,
            # structured outputs: the same without the grammar-forced tokens (jump-forward), and their count
            "spec_accept_length_drafted": (completion - self.spec_plain_tokens - self.spec_forced_tokens) / ct
            if ct else 0.0,
            "spec_forced_tokens": self.spec_forced_tokens,
            "spec_plain_tokens": self.spec_plain_tokens,
            "spec_accept_rate": self.spec_accepted_drafts / self.spec_drafted if self.spec_drafted else 0.0,
            "spec_accept_histogram": list(self.spec_accept_histogram),
            "spec_accept_per_position": list(self.spec_accept_per_position),
        }


def unstarted_output(req: Req, reason: dict[str, Any]) -> ReqOutput:
    """The only output of a request that ends before the scheduler ever saw it (aborted or failed while its grammar
    compiled): no tokens, ``reason`` as its finish."""
    req.finished_reason = reason
    return ReqOutput(req.rid, [], reason, len(req.origin_input_ids), 0, 0)

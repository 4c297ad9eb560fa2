"""The llguidance grammar backend (Microsoft's llguidance: Rust, a 3 MB wheel without dependencies)."""

from __future__ import annotations

import json

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import torch

from specserve.grammar.backend import JSON_MAX_WHITESPACE, GrammarBackend, Matcher, new_bitmask
from specserve.grammar.spec import ANY_JSON, GrammarError, GrammarSpec
from specserve.grammar.structural import to_lark

ANY_JSON_LARK = "start: %json {}"  # llguidance's builtin JSON value


def json_options(flexible: bool) -> dict:
    """llguidance's JSON options: whitespace between JSON tokens up to JSON_MAX_WHITESPACE characters, or none
    beyond the separators' single spaces ", " and ": " (as xgrammar's any_whitespace=False)."""
    if not flexible:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {"whitespace_pattern": rf"[ \t\n\r]{{0,{JSON_MAX_WHITESPACE}}}"}


class LLGuidanceMatcher(Matcher):
    def __init__(self, start: llguidance.LLMatcher, eos: int, vocab_size: int) -> None:
        self.m = start.deep_copy()  # a copy of the compiled grammar's start state: ~5 us, where parsing took ~370
        self.vocab_size = vocab_size
        self.eos = eos
        self.ended = False  # the last accepted token was the grammar's stop token
        self.scratch = new_bitmask(1, vocab_size)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        # row `row` of a CPU int32 bitmask [R, W] with contiguous rows, by address (indexing the tensor cost more)
        words = bitmask.shape[1]
        self.m.unsafe_compute_mask_ptr(bitmask.data_ptr() + 4 * row * bitmask.stride(0), 4 * words)

    def accept(self, token: int) -> bool:
        if token == self.eos:  # the grammar's stop token: consume_token takes it where the grammar may end
            self.fill(self.scratch, 0)  # is_accepting() describes the state of the last mask computed
            self.ended = self.m.is_accepting() and self.m.consume_token(token)
            return self.ended
        # try_consume_tokens leaves the state as it was on a refused token (consume_token would enter an error state)
        return self.m.try_consume_tokens([token]) == 1

    def pick(self, token: int, unforced: bool = False) -> int | None:
        """The forced token (``forced_token``) where there is one, whatever was drawn; elsewhere llguidance's mask
        allows what its parser accepts."""
        forced = None if unforced else self.forced_token()
        if forced is not None:
            return forced if self.accept(forced) else None
        return token if self.accept(token) else None

    def forced_token(self) -> int | None:
        """Where the grammar forces bytes (a JSON key), llguidance's mask allows only the first token of their
        canonical tokenization, though its parser would accept a shorter prefix token too ("d" of "done")."""
        forced = self.m.compute_ff_tokens() if self.m.compute_ff_bytes() else []  # bytes first: 1.5 us against 7
        return forced[0] if forced else None

    def fork(self) -> LLGuidanceMatcher:
        twin = self._twin()
        twin.m = self.m.deep_copy()
        return twin

    def accepting(self) -> bool:
        return self.m.is_accepting()

    def forced_tokens(self) -> list[int]:
        return self.m.compute_ff_tokens()  # llguidance's fast-forward tokens: the forced bytes, canonically tokenized

    def terminated(self) -> bool:
        return self.ended


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def _load(self) -> None:
        self.ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """-> a matcher at the start of the checked grammar, its first mask computed (llguidance builds its parser
        and lexer lazily): each request's matcher is a copy of it (``LLGuidanceMatcher``), so a cached grammar costs a
        new request a copy instead of a parse of the grammar's text."""
        grammar = self._grammar(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(spec.kind, "; ".join(m.strip() for m in messages) or "invalid grammar")
        start = llguidance.LLMatcher(self.ll_tokenizer, grammar)
        start.compute_bitmask()  # its state stays the start; the lazily built tables come with every copy
        return start

    def _grammar(self, spec: GrammarSpec) -> str:
        if spec.kind == "json_schema":
            if spec.text == ANY_JSON:
                return llguidance.grammar_from("lark", ANY_JSON_LARK)
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=json_options(self.any_whitespace))
        if spec.kind == "regex":
            return llguidance.grammar_from("regex", spec.text)
        if spec.kind == "structural_tag":
            fmt = json.loads(spec.text)["format"]
            return llguidance.grammar_from("lark", to_lark(fmt, json_options(self.any_whitespace), self._struct_tags))
        try:
            lark = llguidance.gbnf_to_lark.gbnf_to_lark(spec.text)
        except Exception as e:  # noqa: BLE001 - the converter raises its own errors and Python's
            raise GrammarError(spec.kind, f"invalid GBNF grammar: {e}") from None
        return llguidance.grammar_from("lark", lark)

    def _struct_tags(self, tags: list[tuple[str, str, dict, str]]) -> str:
        """llguidance's grammar of free text with triggered tags, (trigger, begin, JSON schema, end) each; a trigger
        that is one of the tokenizer's special tokens is matched as that token, others as text."""
        special = set(self.tokenizer.all_special_tokens)
        return llguidance.StructTag.to_grammar(
            [llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end)
             for trigger, begin, schema, end in tags],
            assume_special=all(trigger in special for trigger, *_ in tags))

    def _matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled, self.ll_tokenizer.eos_token, self.vocab_size)

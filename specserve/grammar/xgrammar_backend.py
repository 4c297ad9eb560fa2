"""The xgrammar grammar backend (SGLang's default; ``pip install 'specserve[xgrammar]'``)."""

from __future__ import annotations

import torch
import xgrammar

from specserve.grammar.backend import JSON_MAX_WHITESPACE, GrammarBackend, Matcher, new_bitmask, single_token
from specserve.grammar.spec import ANY_JSON, GrammarError, GrammarSpec


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int, encode) -> None:
        self.m = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.encode = encode  # text -> token ids, the model's tokenizer
        self.scratch = new_bitmask(1, vocab_size)  # forced_token's mask row

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def fork(self) -> XGrammarMatcher:
        twin = self._twin()
        twin.m = self.m.fork()
        return twin

    def accepting(self) -> bool:
        return self.m.is_completed()

    def terminated(self) -> bool:
        return self.m.is_terminated()

    def forced_token(self) -> int | None:
        """The mask read for a single allowed token, where xgrammar names forced text (1-2 us; a mask costs several
        times that, and a state that forces no byte allows more than one token). The forced text's own tokens would
        not do: xgrammar's mask allows every token that is a prefix of it."""
        if not self.m.find_jump_forward_string():
            return None
        self.fill(self.scratch, 0)
        return None if self.accepting() else single_token(self.scratch[0])

    def forced_tokens(self) -> list[int]:
        """xgrammar's jump-forward string, tokenized; its last token is left out (with the text after it, the model
        may well write it as another token)."""
        text = self.m.find_jump_forward_string()
        return self.encode(text)[:-1] if text else []


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def _load(self) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        # one compile thread: the server compiles off its scheduler thread already, and the machine's cores run the
        # forwards; our own LRU cache (GrammarBackend) stands in for xgrammar's
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        try:
            if spec.kind == "json_schema":
                if spec.text == ANY_JSON:
                    return self.compiler.compile_builtin_json_grammar()
                return self.compiler.compile_json_schema(spec.text, any_whitespace=self.any_whitespace,
                                                         max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            if spec.kind == "structural_tag":
                return self.compiler.compile_structural_tag(spec.text)
            return self.compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError) as e:  # a parse error is a RuntimeError "[time] file:line: msg"
            raise GrammarError(spec.kind, _message(str(e))) from None

    def _matcher(self, compiled: xgrammar.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled, self.vocab_size, self._encode)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _message(text: str) -> str:
    """xgrammar's error text without its "[time] /project/cpp/file.cc:line: " prefix."""
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("[") else text

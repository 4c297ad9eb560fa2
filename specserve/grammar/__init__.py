"""Constrained decoding: grammars (JSON schema, regex, GBNF, structural tags) compiled by a grammar engine, and the
token masks that keep a request's output inside its grammar, in plain decoding and along speculative draft trees."""

from specserve.grammar.backend import (
    DEFAULT_GRAMMAR_BACKEND,
    GRAMMAR_BACKENDS,
    GrammarBackend,
    Matcher,
    check_grammar_backend,
    make_grammar_backend,
    new_bitmask,
)
from specserve.grammar.spec import GrammarError, GrammarSpec

__all__ = ["DEFAULT_GRAMMAR_BACKEND", "GRAMMAR_BACKENDS", "GrammarBackend", "GrammarError", "GrammarSpec", "Matcher",
           "check_grammar_backend", "make_grammar_backend", "new_bitmask"]

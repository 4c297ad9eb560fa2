"""The grammar-engine interface: compile a request's grammar once, then follow one output with a matcher.

A ``GrammarBackend`` is made once per process for one tokenizer (``make_grammar_backend``). It compiles a
``GrammarSpec`` (``compile``: thread-safe, cached by the spec's text, raises ``GrammarError`` with the parser's
message) and makes a ``Matcher`` per request. A matcher is the state of one output in the grammar:

    fill(bitmask, row)   the tokens allowed next, as bits of an int32 [rows, ceil(V / 32)] bitmask (1 = allowed)
    accept(token)        advance by one token; False if the grammar does not allow it (the state is unchanged)
    pick(token)          check-first sampling: advance by the token a draw under the mask would give, where known
                         without a mask (``token`` itself when the mask allows it), and return it; None otherwise
    fork()               an independent copy of the state (the draft-tree walks explore from copies, so the request's
                         own matcher only ever advances over emitted tokens)
    accepting()          the output so far is a complete match, so the request may stop here (valid after fill)
    terminated()         the last accepted token was the grammar's own stop token: nothing may follow

Backends: ``llguidance`` (the default: a 3 MB wheel without dependencies) and ``xgrammar`` (SGLang's default;
``pip install 'specserve[xgrammar]'``, which also pulls triton). docs/guide.md says how they were measured.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from specserve.grammar.spec import GrammarError, GrammarSpec
from specserve.grammar.stats import GrammarStats

#: compiled grammars kept per backend (least recently used dropped first)
CACHE_SIZE = 256

#: --grammar-backend names -> "module:class" (imported on use: an engine without structured outputs loads neither)
GRAMMAR_BACKENDS = {
    "llguidance": "specserve.grammar.llguidance_backend:LLGuidanceBackend",
    "xgrammar": "specserve.grammar.xgrammar_backend:XGrammarBackend",
}
DEFAULT_GRAMMAR_BACKEND = "llguidance"
#: Most whitespace characters a JSON output may put between two of its tokens. Unbounded whitespace (SGLang's
#: default) lets a model that prefers a newline emit newlines until max_tokens, with the JSON never finished; 24
#: covers pretty-printed JSON five levels deep at indent 4. --constrained-json-disable-any-whitespace allows none.
JSON_MAX_WHITESPACE = 24
INSTALL_HINT = {"llguidance": "pip install llguidance", "xgrammar": "pip install 'specserve[xgrammar]'"}


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 [rows, ceil(V / 32)] bitmask (bits past V are ignored by ``allowed_tokens``)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def single_token(row: torch.Tensor) -> int | None:
    """The one token an int32 CPU bitmask row [W] allows, or None when it allows none or several (in numpy: a few
    microseconds where torch's nonzero took about ten)."""
    words = row.numpy().view(np.uint32)
    set_words = np.flatnonzero(words)
    if set_words.size != 1:
        return None
    w = int(set_words[0])
    bits = int(words[w])
    return w * 32 + bits.bit_length() - 1 if bits & (bits - 1) == 0 else None


class Matcher:
    """One output's state in its grammar (see the module docstring). ``vocab_size``: bits per bitmask row; ``stats``:
    its backend's GrammarStats (where the mask work of its steps is counted)."""

    vocab_size: int
    stats: GrammarStats

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        raise NotImplementedError

    def pick(self, token: int, unforced: bool = False) -> int | None:
        """``token`` was drawn without the mask. Where the engine knows, without filling a mask, which token a draw
        under it would give, advance by that token and return it: ``token`` when the mask allows it, or the only
        token the mask allows (with the grammar not accepting, so no stop token either). Else None, the state
        unchanged. unforced: the caller knows ``forced_token`` is None here. Default: ``accept``, for engines whose
        mask allows exactly what their parser accepts."""
        return token if self.accept(token) else None

    def fork(self) -> Matcher:
        raise NotImplementedError

    def _twin(self) -> Matcher:
        """A shallow copy of this matcher's Python object (``fork`` then replaces the engine's state in it): what
        ``copy.copy`` makes, in about 1 us instead of 6 (a draft level forks a state per live branch)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def accepting(self) -> bool:
        raise NotImplementedError

    def terminated(self) -> bool:
        raise NotImplementedError

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from this state, as the engine tokenizes the forced text (a jump-forward
        guess: ``masks.jump_forward`` checks each before appending it). Default: none known."""
        return []

    def forced_token(self) -> int | None:
        """The token every draw under this state's mask gives, whatever the logits: the only one the mask allows,
        with the grammar not accepting (so no stop token either); None where the grammar leaves a choice or the
        engine cannot tell. The state is unchanged. Default: none known (no jump-forward in plain decoding)."""
        return None


class GrammarBackend:
    """Compiles specs for one tokenizer and makes matchers (see the module docstring).

    Nothing is loaded until the first grammar arrives (``_load``), so a tokenizer the engine cannot use (a slow one,
    one it does not know) costs the requests that ask for a grammar a 400, not the server its start."""

    name = ""

    def __init__(self, tokenizer, vocab_size: int, any_whitespace: bool = True) -> None:
        self.tokenizer = tokenizer
        # the grammar's vocabulary: the model's logits, or the tokenizer's when it has more entries (added tokens);
        # bitmasks have this many bits, and the sampler crops them to the logits (ban_mask)
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.any_whitespace = any_whitespace  # JSON may hold whitespace between its tokens (JSON_MAX_WHITESPACE)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self._loaded = False
        self.stats = GrammarStats()

    def compile(self, spec: GrammarSpec):
        """-> the backend's compiled form of ``spec`` (cached); GrammarError naming the field if it is invalid."""
        with self._lock:
            if not self._loaded:
                try:
                    self._load()
                except Exception as e:  # noqa: BLE001 - any engine failure on this tokenizer
                    raise GrammarError(spec.kind, f"the {self.name} grammar engine cannot use this model's tokenizer: "
                                                  f"{e}") from None
                self._loaded = True
            if spec.key in self._cache:
                self._cache.move_to_end(spec.key)
                return self._cache[spec.key]
        start = time.perf_counter()
        compiled = self._compile(spec)  # outside the lock: compiles of different specs run side by side
        self.stats.add_compile(time.perf_counter() - start)
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def cached(self, spec: GrammarSpec):
        """-> ``spec``'s compiled form if it is in the cache, else None (nothing is compiled)."""
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
            return compiled

    def matcher(self, compiled) -> Matcher:
        """A matcher at the start of a compiled grammar (``compile`` has loaded the backend)."""
        m = self._matcher(compiled)
        m.stats = self.stats
        return m

    def _matcher(self, compiled) -> Matcher:
        raise NotImplementedError

    def _load(self) -> None:
        """Build what the engine needs from the tokenizer (called once, before the first compile)."""
        raise NotImplementedError

    def _compile(self, spec: GrammarSpec):
        raise NotImplementedError


def grammar_backend_class(name: str) -> type[GrammarBackend]:
    """The class of a --grammar-backend name (imports its package: ImportError when it is not installed)."""
    module, cls = GRAMMAR_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def check_grammar_backend(name: str) -> None:
    """Start-up check of --grammar-backend: a known name whose package is installed (ConfigError-style message)."""
    if name == "none":
        return
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"--grammar-backend: unknown backend {name!r}; choose from "
                         f"{', '.join([*GRAMMAR_BACKENDS, 'none'])}")
    try:
        grammar_backend_class(name)
    except ImportError as e:
        raise ValueError(f"--grammar-backend {name}: its package is not installed ({e}); "
                         f"{INSTALL_HINT[name]}") from e


def make_grammar_backend(name: str, tokenizer, vocab_size: int, any_whitespace: bool = True) -> GrammarBackend | None:
    """The backend of --grammar-backend for this tokenizer and a model of ``vocab_size`` logits; None for ``none``."""
    if name == "none":
        return None
    check_grammar_backend(name)
    return grammar_backend_class(name)(tokenizer, vocab_size, any_whitespace)


__all__ = ["GrammarBackend", "GrammarError", "GrammarSpec", "Matcher", "make_grammar_backend", "new_bitmask"]

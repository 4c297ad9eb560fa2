"""Per-request sampling parameters (SGLang field names and defaults).

Life cycle of a request's parameters:
  1. ``SamplingParams.from_dict(json_dict)``: unknown keys and wrong types are rejected
     (ValueError naming the field).
  2. ``params.normalize()``: canonical forms (stop list, top_k off == -1, tiny temperature == greedy,
     int logit_bias keys).
  3. ``params.verify(vocab_size)``: range checks (ValueError whose message starts with the field name).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy decoding (argmax).
GREEDY_TEMPERATURE_EPS = 1e-6
LOGIT_BIAS_LIMIT = 100.0
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # range torch.Generator.manual_seed accepts

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "top_logprobs_num", "seed", "logprob_start_len")
_NULLABLE_INT_FIELDS = ("max_new_tokens", "seed")
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
)
_BOOL_FIELDS = (
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "return_logprob",
    "return_text_in_logprobs", "temp_scaled_logprobs",
)
# SGLang sampling parameters specserve does not honour yet: accepted at their "off" value (null), refused
# otherwise, so a request never silently loses what it asked for.
UNSUPPORTED_FIELDS = {
    "custom_params": "custom_params needs a custom logit processor, which this server does not run",
}
# SGLang spellings of specserve's fields
ALIASES = {"sampling_seed": "seed"}
# fields where null is a value of its own (max_new_tokens: until EOS or the context is full); for the others a
# null means the default, as in SGLang
_NULLABLE = ("max_new_tokens", "seed", "stop", "stop_regex", "stop_token_ids", "logit_bias", "token_ids_logprob")
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bias_key_to_int(key: Any) -> int:
    """Logit-bias keys are token ids, as ints or (from JSON) strings of ints."""
    if _is_int(key):
        return key
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            pass
    raise ValueError(f"logit_bias keys must be token ids (int or string of an int), got {key!r}")


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: the engine decides (e.g. context length left)
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # Python regular expressions: the output stops where one matches
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    logit_bias: dict[int | str, float] | None = None
    # logprobs (SGLang's request-level fields, carried per request here)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # first prompt position with an input logprob entry; -1 = the last prompt token
    token_ids_logprob: list[int] | None = None  # ids whose logprobs are reported at every scored position
    return_text_in_logprobs: bool = False  # logprob entries carry the token's text
    temp_scaled_logprobs: bool = False  # logprobs of logits / temperature (sampled requests), not the raw ones
    # constrained decoding (SGLang's fields; at most one): the output follows this grammar (specserve/grammar/)
    json_schema: str | None = None  # a JSON schema as JSON text; "$$ANY$$" = any JSON object (response_format)
    regex: str | None = None
    ebnf: str | None = None  # GBNF (llama.cpp's EBNF), as SGLang's xgrammar backend takes it
    structural_tag: str | None = None  # SGLang's structural tag as JSON text (grammar/structural.py)
    # Derived by normalize(): the longest stop string, in characters (0 when there is none).
    stop_str_max_len: int = field(default=0, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Builds params from a request dict; None or {} gives the defaults. Type-checks every field."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {}
        for key, value in d.items():
            if key in UNSUPPORTED_FIELDS:
                if value is not None:
                    raise ValueError(f"{key}: {UNSUPPORTED_FIELDS[key]}")
                continue
            name = ALIASES.get(key, key)
            if name not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if name != key and value is None:
                continue
            if name in kwargs and kwargs[name] != value:
                raise ValueError(f"{key}: given together with {name} and a different value")
            kwargs[name] = value
        # SGLang: a null for a field that has a default means "use the default"
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k in _NULLABLE}
        for name in _FLOAT_FIELDS:  # accept ints for float fields
            if name in kwargs and _is_int(kwargs[name]):
                kwargs[name] = float(kwargs[name])
        params = cls(**kwargs)
        params._check_types()
        return params

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _NULLABLE_INT_FIELDS:
                continue
            if not _is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        for name in ("stop", "stop_regex"):
            stop = getattr(self, name)
            if stop is not None and not isinstance(stop, str):
                if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                    raise ValueError(f"{name} must be a string or a list of strings, got {stop!r}")
        for pattern in self.stop_regexes:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"stop_regex: {pattern!r} is not a valid regular expression: {e}") from None
        for name in ("stop_token_ids", "token_ids_logprob"):
            ids = getattr(self, name)
            if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) for t in ids)):
                raise ValueError(f"{name} must be a list of ints, got {ids!r}")
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> float, got {bias!r}")
            for key, value in bias.items():
                _bias_key_to_int(key)
                if not _is_number(value):
                    raise ValueError(f"logit_bias values must be numbers, got {value!r} for {key!r}")

    # ------------------------------------------------------------------ canonical form
    @property
    def stop_strs(self) -> list[str]:
        """The non-empty stop strings as a list (without mutating the params)."""
        return _non_empty(self.stop)

    @property
    def stop_regexes(self) -> list[str]:
        """The non-empty stop_regex patterns as a list."""
        return _non_empty(self.stop_regex)

    @property
    def has_text_stops(self) -> bool:
        """Stop strings or stop regexes: the scheduler detokenizes to find them."""
        return bool(self.stop_strs or self.stop_regexes)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, text) of the grammar the output must follow, or None."""
        given = [(name, getattr(self, name)) for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        return given[0] if given else None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def normalize(self) -> SamplingParams:
        """Puts the params in canonical form, in place; returns self for chaining."""
        self.stop = self.stop_strs
        self.stop_regex = self.stop_regexes
        self.stop_str_max_len = max((len(s) for s in self.stop), default=0)
        if self.top_k == 0:
            self.top_k = -1
        if _is_number(self.temperature) and 0 <= self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        if self.logit_bias is not None:
            self.logit_bias = {_bias_key_to_int(k): float(v) for k, v in self.logit_bias.items()}
        if not self.token_ids_logprob:  # [] is no request (SGLang)
            self.token_ids_logprob = None
        return self

    # ------------------------------------------------------------------ range checks
    def verify(self, vocab_size: int | None = None) -> None:
        """Raises ValueError, message starting with the field name, for any out-of-range value."""
        self._check_types()
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0 (0: prefill only, e.g. to score a prompt), got "
                             f"{self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )
        _check_finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k not in (-1, 0) and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_finite("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}")
        if self.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (the last prompt token) or >= 0, got "
                             f"{self.logprob_start_len}")
        for token_id in self.token_ids_logprob or []:
            _check_token_id("token_ids_logprob", token_id, vocab_size)
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}")
        for token_id in self.stop_token_ids or []:
            _check_token_id("stop_token_ids", token_id, vocab_size)
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[0]} cannot be given with {given[1]}: only one of json_schema, regex, ebnf and "
                             "structural_tag")
        for key, value in (self.logit_bias or {}).items():
            _check_token_id("logit_bias", _bias_key_to_int(key), vocab_size)
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")


def _non_empty(value: str | list[str] | None) -> list[str]:
    """A string, a list of strings or None -> its non-empty strings as a list."""
    if value is None:
        return []
    return [s for s in ([value] if isinstance(value, str) else value) if s]


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_token_id(name: str, token_id: int, vocab_size: int | None) -> None:
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        bound = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name} token ids must be {bound}, got {token_id}")

"""Per-request limits a server enforces before it spends anything on a request.

Each limit is a ``ServerArgs`` flag; ``check`` reads the raw request (prompts, the sampling-params dicts, the
request-level logprob fields) before tokenizing, expanding ``n`` or building a single sample, so a request asking
for a million samples, ten thousand stop strings or a 10 MB prompt is refused at once with a 400 naming the flag.
Values of the wrong type are left alone here: the strict validation that follows reports them.

The prompt-length bound needs no tokenizing: a token decodes to at most ``max_token_chars`` characters (the
longest vocabulary entry), so a prompt of more than ``context_len x max_token_chars`` characters cannot fit in the
context. A normalizer may fold a few characters into one (Unicode composition) before the model sees them, hence
the factor ``NORMALIZER_SLACK`` on top; a prompt under the bound is tokenized and checked exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.flags import flag_name
from specserve.frontend import RequestError

NORMALIZER_SLACK = 4  # characters a normalizer may fold into one (combining sequences), with room to spare


class LimitError(RequestError):
    """A request over a limit: HTTP 400 naming the request field (param) and the server flag."""


@dataclass(frozen=True)
class RequestLimits:
    max_request_samples: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_top_logprobs: int
    max_prompt_chars: int  # context length x the longest token's characters x NORMALIZER_SLACK

    @classmethod
    def from_args(cls, args, context_len: int, tokenizer) -> RequestLimits:
        return cls(args.max_request_samples, args.max_stop_strings, args.max_stop_string_chars, args.max_top_logprobs,
                   context_len * max_token_chars(tokenizer) * NORMALIZER_SLACK)

    def check(self, prompts: list[str] | None, n_prompts: int, sampling_params: list[Any],
              request_fields: dict[str, Any]) -> int:
        """Raises LimitError for the first limit the request breaks; returns its number of samples.
        sampling_params: one raw dict (or None) per prompt."""
        samples = sum(_int(sp, "n", 1) for sp in sampling_params)
        if samples > self.max_request_samples:
            _over(f"the request asks for {samples} samples ({n_prompts} prompts x n)", "max_request_samples",
                  self.max_request_samples, "n" if n_prompts == 1 else "prompt")
        for text in prompts or []:
            if isinstance(text, str) and len(text) > self.max_prompt_chars:
                self.check_prompt_chars(len(text))
        for sp in sampling_params:
            if isinstance(sp, dict):
                self._check_stops(sp.get("stop"), "stop")
                self._check_stops(sp.get("stop_regex"), "stop_regex")
                self._check_top_logprobs(sp.get("top_logprobs_num"))
        self._check_top_logprobs(request_fields.get("top_logprobs_num"))
        return samples

    def check_prompt_chars(self, chars: int) -> None:
        """A prompt (or a rendered chat) of `chars` characters that cannot fit in the context."""
        if chars > self.max_prompt_chars:
            raise LimitError(f"the prompt has {chars} characters, more than can fit in the model's context (at most "
                             f"{self.max_prompt_chars}); shorten it", "prompt")

    def _check_stops(self, stop: Any, field: str) -> None:
        """stop strings, or stop regexes (held to the same limits)."""
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        what = "stop strings" if field == "stop" else "stop regexes"
        if len(stops) > self.max_stop_strings:
            _over(f"the request has {len(stops)} {what}", "max_stop_strings", self.max_stop_strings, field)
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        if longest > self.max_stop_string_chars:
            _over(f"one of its {what} has {longest} characters", "max_stop_string_chars", self.max_stop_string_chars,
                  field)

    def _check_top_logprobs(self, value: Any) -> None:
        values = value if isinstance(value, list) else [value]
        top = max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)
        if top > self.max_top_logprobs:
            _over(f"the request asks for {top} top logprobs per token", "max_top_logprobs", self.max_top_logprobs,
                  "top_logprobs_num")


def _int(d: Any, key: str, default: int) -> int:
    value = d.get(key, default) if isinstance(d, dict) else default
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _over(what: str, flag: str, limit: int, param: str) -> None:
    raise LimitError(f"{what}; this server allows at most {limit} ({flag_name(flag)})", param)


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (byte-level vocabularies spell
    each byte as one character, so this bounds the decoded text too). At least 1."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 64
    return max((len(t) for t in vocab), default=1) or 1

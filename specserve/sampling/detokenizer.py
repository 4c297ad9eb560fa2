"""Incremental detokenization and stop-string handling for streaming output."""

from __future__ import annotations

import re
from typing import Any

from specserve.sampling.params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only finished text: never a partial multi-byte
    character (text ending in U+FFFD is held back until the next token completes it), correct for byte-level
    BPE and for sentencepiece-style leading spaces (decode a sliding window: prefix_offset/read_offset
    technique).

    The window is ids[prefix_offset:]. ids[prefix_offset:read_offset] were already emitted and serve only as
    context, so a token whose text depends on its left neighbour (a sentencepiece "▁word", a byte completing a
    character) decodes as it does inside the full sequence; the new text is the window's text minus the
    context's text.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start (context tokens, already emitted)
        self.read_offset = 0  # first token not yet emitted
        self.text = ""  # all text emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _emit(self, force: bool) -> str:
        context = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) <= len(context) or (window.endswith(REPLACEMENT_CHAR) and not force):
            return ""  # nothing new yet, or an incomplete character at the end: wait for more tokens
        new_text = window[len(context):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new_text
        return new_text

    def add(self, new_ids: list[int]) -> str:
        """Appends token ids; returns the newly final text (may be "")."""
        self.ids.extend(new_ids)
        return self._emit(force=False)

    def flush(self) -> str:
        """At finish: emits whatever is held back (even a trailing U+FFFD)."""
        return self._emit(force=True)


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest occurrence at index >= search_from of any stop string -> (index, matched string).
    On a tie (two stops starting at the same index) the longer one wins."""
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        idx = text.find(stop, max(search_from, 0))
        if idx < 0:
            continue
        if best is None or idx < best[0] or (idx == best[0] and len(stop) > len(best[1])):
            best = (idx, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string (streamers hold that
    much back so a stop string split across tokens is never half-emitted)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


# How far back (characters) before the new text a stop_regex match may start: a pattern's longest match where
# Python's parser bounds it, else this
STOP_REGEX_LOOKBACK = 1024


def regex_lookback(pattern: re.Pattern) -> int:
    """How many characters before the new text a match of pattern may start (at most STOP_REGEX_LOOKBACK)."""
    try:
        longest = re._parser.parse(pattern.pattern, pattern.flags).getwidth()[1]  # noqa: SLF001 - no public API
    except Exception:  # noqa: BLE001 - a private parser: any failure means "unknown"
        return STOP_REGEX_LOOKBACK
    return min(longest, STOP_REGEX_LOOKBACK)


def find_stop_regex(text: str, patterns: list[tuple[re.Pattern, int]], searched: int
                    ) -> tuple[int, str, int] | None:
    """The earliest match of any (pattern, lookback) that ends in the new text (past `searched`) -> (its start, the
    pattern's text (the finish's matched_stop, as SGLang reports it), the matched text's length)."""
    best: tuple[int, str, int] | None = None
    for pattern, lookback in patterns:
        m = next((m for m in pattern.finditer(text, max(searched - lookback, 0)) if m.end() > searched), None)
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), pattern.pattern, m.end() - m.start())
    return best


class StopChecker:
    """Per request: incremental detokenization + stop strings and stop regexes, for the scheduler.

    add() returns (newly emittable text, matched stop string or regex pattern, or None). Text that could be the
    start of a stop string is held back until it is known not to be one (a regex cannot be known in advance: text is
    not held for it). After a match the text is trimmed where the stop string or the regex match starts (kept when
    params.no_stop_trim) and nothing more is emitted. Stop *token ids* and eos are the scheduler's business; when a
    request ends for such a reason, call flush() to get the held-back text.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self.stops = params.stop_strs
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        compiled = [re.compile(p) for p in params.stop_regexes]
        self.regexes = [(p, regex_lookback(p)) for p in compiled]
        self.no_stop_trim = params.no_stop_trim
        self.emitted = 0  # characters of detokenizer.text already handed out
        self.matched_stop: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """All text handed out so far."""
        return self.detokenizer.text[:self.emitted]

    def add(self, new_ids: list[int], allow_match: bool = True) -> tuple[str, str | None]:
        """allow_match=False (before min_new_tokens): stop strings in this text are not matches."""
        if self.finished:
            return "", None
        searched = len(self.detokenizer.text)
        self.detokenizer.add(new_ids)
        if not allow_match:
            searched = len(self.detokenizer.text)
        return self._advance(searched, final=False)

    def flush(self) -> str:
        """At finish (eos, stop token, length): the held-back text, still trimmed at a stop string."""
        if self.finished:
            return ""
        searched = len(self.detokenizer.text)
        self.detokenizer.flush()
        text, _ = self._advance(searched, final=True)
        self.finished = True
        return text

    def _advance(self, searched: int, final: bool) -> tuple[str, str | None]:
        full = self.detokenizer.text
        # A new match must end in the new text, so it starts at most max_stop_len - 1 characters earlier.
        by_str = find_stop(full, self.stops, searched - self.max_stop_len + 1) if self.stops else None
        match = None if by_str is None else (*by_str, len(by_str[1]))  # (start, matched_stop, matched length)
        if self.regexes and len(full) > searched:
            by_regex = find_stop_regex(full, self.regexes, searched)
            if by_regex is not None and (match is None or by_regex[0] < match[0]):
                match = by_regex
        if match is not None:
            idx, stop, length = match
            end = idx + length if self.no_stop_trim else idx
            out = full[self.emitted:end]
            self.emitted = max(self.emitted, end)
            self.matched_stop, self.finished = stop, True
            return out, stop
        end = len(full) if final else len(full) - partial_stop_len(full, self.stops)
        out = full[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out, None

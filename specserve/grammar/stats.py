"""GrammarStats: what structured outputs cost the engine, for the server info and /metrics.

One per grammar backend (so one per engine or model worker), shared by the compile threads and the scheduler
thread: compiles (count, total and longest seconds) and the grammar work of the steps (the masks of sampling, of
verify trees and of drafting: steps that had any, and their seconds), the tokens drawn check-first (sampled
without the mask, then checked) with those the grammar refused, and the tokens plain decoding appended without a
forward of their own because the grammar forced them (jump-forward)."""

from __future__ import annotations

import threading
import time


class GrammarStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.compiles = 0
        self.compile_seconds = 0.0
        self.compile_seconds_max = 0.0
        self.mask_calls = 0
        self.mask_seconds = 0.0
        self.checked_tokens = 0
        self.check_refusals = 0
        self.jumped_tokens = 0

    def add_compile(self, seconds: float) -> None:
        with self._lock:
            self.compiles += 1
            self.compile_seconds += seconds
            self.compile_seconds_max = max(self.compile_seconds_max, seconds)

    def masking(self) -> _Timed:
        """Times one batch of mask work (a sampling step's, a verify tree's, a draft level's): a context manager."""
        return _Timed(self)

    def add_mask(self, seconds: float) -> None:
        with self._lock:
            self.mask_calls += 1
            self.mask_seconds += seconds

    def add_checks(self, checked: int, refused: int) -> None:
        with self._lock:
            self.checked_tokens += checked
            self.check_refusals += refused

    def add_jumped(self, tokens: int) -> None:
        with self._lock:
            self.jumped_tokens += tokens

    def info(self) -> dict:
        with self._lock:
            return {"grammar_compiles": self.compiles, "grammar_compile_seconds": self.compile_seconds,
                    "grammar_compile_seconds_max": self.compile_seconds_max, "grammar_mask_calls": self.mask_calls,
                    "grammar_mask_seconds": self.mask_seconds, "grammar_checked_tokens": self.checked_tokens,
                    "grammar_check_refusals": self.check_refusals, "grammar_jump_forward_tokens": self.jumped_tokens}


class _Timed:
    """``GrammarStats.masking``'s context manager (a class: a few times cheaper per use than a generator's, and a step
    may use it once per request)."""

    __slots__ = ("stats", "start")

    def __init__(self, stats: GrammarStats) -> None:
        self.stats = stats

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.stats.add_mask(time.perf_counter() - self.start)

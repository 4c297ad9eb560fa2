"""GrammarStats: what structured outputs cost the engine, for the server info and /metrics.

One per grammar backend (so one per engine or model worker), shared by the compile threads and the scheduler
thread: compiles (count, total and longest seconds) and the grammar work of the steps (the masks of sampling, of
verify trees and of drafting: steps that had any, and their seconds), and the tokens drawn check-first (sampled
without the mask, then checked) with those the grammar refused."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


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

    def add_compile(self, seconds: float) -> None:
        with self._lock:
            self.compiles += 1
            self.compile_seconds += seconds
            self.compile_seconds_max = max(self.compile_seconds_max, seconds)

    @contextmanager
    def masking(self):
        """Times one batch of mask work (a sampling step's, a verify tree's, a draft level's)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.mask_calls += 1
                self.mask_seconds += time.perf_counter() - start

    def add_checks(self, checked: int, refused: int) -> None:
        with self._lock:
            self.checked_tokens += checked
            self.check_refusals += refused

    def info(self) -> dict:
        with self._lock:
            return {"grammar_compiles": self.compiles, "grammar_compile_seconds": self.compile_seconds,
                    "grammar_compile_seconds_max": self.compile_seconds_max, "grammar_mask_calls": self.mask_calls,
                    "grammar_mask_seconds": self.mask_seconds, "grammar_checked_tokens": self.checked_tokens,
                    "grammar_check_refusals": self.check_refusals}

"""ThreadGovernor: how many threads the forwards use while other processes compete for the cores (CPU).

A forward's parallel ops (oneDNN linears, SDPA, softmax) split their work over the OpenMP threads and wait at a
barrier for the slowest. When another process keeps one of the cores busy, the thread sharing that core runs only
in the kernel's time slices (milliseconds, against ops of tens of microseconds), so every op waits for it: on a
2-core machine with one busy neighbour, plain decoding of the demo target fell from ~170 to 3-50 tok/s with 2
threads and kept ~165 tok/s with 1 (docs/benchmarks.md). The number of busy neighbours cannot be read reliably
from outside, so the governor measures: it times decode steps and compares thread counts on the same work.

The decision, from step timings only (no clock, no torch: unit-testable with made-up sequences):
- Steps are grouped by a key (the engine's: the decode batch size, rounded up to a power of two) and judged in
  windows of WINDOW_STEPS steps of one key, by their median (robust to a stray slow step: a page fault, a compile).
- Each count keeps the fastest window it has run per key (its quiet speed). A window SLOW_FACTOR slower than that
  suggests a busy neighbour: the governor at once *probes* the next lower count (half as many threads) for a window.
- Besides, it probes periodically: towards more threads while it runs fewer (is the machine quiet again?), towards
  fewer at the full count (in case the engine started beside the neighbour, so its "quiet" speed is the slow one).
- A probe is adopted when it beats the count it left on the same key: fewer threads must be DOWN_GAIN faster, more
  threads may be up to UP_TOLERANCE slower (when it is a tie the full count is preferred: it is the faster one
  for larger batches). A probe is cut short once more than half its window has failed.
- Probes are paced in busy time (the sum of the steps' own times, so idle time does not count): a rejected probe
  doubles the interval (PROBE_MIN_S up to PROBE_MAX_S), an adopted one resets it, and a probe is always followed
  by at least PROBE_SHARE times its own duration, so probing costs at most about 1/PROBE_SHARE of the time even
  when the probed count is very slow.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Hashable

logger = logging.getLogger(__name__)

WINDOW_STEPS = 8  # steps of one key per judged window
SLOW_FACTOR = 1.5  # a window this much slower than the count's best on its key -> probe fewer threads now
DOWN_GAIN = 1.2  # fewer threads are adopted when their window is at least this much faster
UP_TOLERANCE = 1.1  # more threads are adopted when their window is at most this much slower
PROBE_MIN_S = 1.0  # busy seconds to the first periodic probe, and after an adopted one
PROBE_MAX_S = 10.0  # the longest interval rejected probes back off to (a quiet machine waits at most this)
PROBE_SHARE = 20  # busy time after a probe >= this many times the probe's own duration


def thread_levels(max_threads: int) -> tuple[int, ...]:
    """The counts the governor moves between: max_threads, then halving down to 1 (8 -> (8, 4, 2, 1))."""
    levels = [max(1, max_threads)]
    while levels[-1] > 1:
        levels.append(levels[-1] // 2)
    return tuple(levels)


def batch_key(batch_size: int) -> int:
    """The key of a decode step of ``batch_size`` requests: the next power of two (steps of similar cost)."""
    return 1 << max(0, batch_size - 1).bit_length()


class ThreadGovernor:
    def __init__(self, max_threads: int, *, window: int = WINDOW_STEPS, slow_factor: float = SLOW_FACTOR,
                 down_gain: float = DOWN_GAIN, up_tolerance: float = UP_TOLERANCE, probe_min_s: float = PROBE_MIN_S,
                 probe_max_s: float = PROBE_MAX_S, probe_share: float = PROBE_SHARE) -> None:
        self.levels = thread_levels(max_threads)
        self.window, self.slow_factor = window, slow_factor
        self.down_gain, self.up_tolerance = down_gain, up_tolerance
        self.probe_min_s, self.probe_max_s, self.probe_share = probe_min_s, probe_max_s, probe_share
        self.level = 0  # index into levels of the adopted count
        self.probing: int | None = None  # index of the count being probed, if any
        self.probe_reason = ""
        self.best: dict[tuple[Hashable, int], float] = {}  # (key, threads) -> fastest window median, seconds
        self.last: dict[tuple[Hashable, int], float] = {}  # (key, threads) -> latest window median, seconds
        self.samples: dict[Hashable, list[float]] = {}  # key -> step seconds at the current count
        self.busy_s = 0.0  # the governor's clock: seconds of observed steps
        self.interval_s = probe_min_s
        self.next_probe_s = probe_min_s
        self.switches = 0  # adopted changes of count
        self.probes = 0

    @property
    def max_threads(self) -> int:
        return self.levels[0]

    @property
    def threads(self) -> int:
        """The count the next step should run with (a probe's while one runs)."""
        return self.levels[self.level if self.probing is None else self.probing]

    def observe(self, key: Hashable, seconds: float) -> int:
        """A step of kind ``key`` took ``seconds`` at ``threads`` -> the count for the next step."""
        self.busy_s += seconds
        samples = self.samples.setdefault(key, [])
        samples.append(seconds)
        if self.probing is not None and self._probe_lost(key, samples):
            self._end_probe(key, None)
        elif len(samples) >= self.window:
            median = statistics.median(samples)
            del self.samples[key]
            if self.probing is not None:
                self._end_probe(key, median)
            else:
                self._judge(key, median)
        return self.threads

    def info(self) -> dict:
        return {"cpu_threads": self.threads, "cpu_threads_max": self.max_threads,
                "cpu_thread_switches": self.switches, "cpu_thread_probes": self.probes}

    # ------------------------------------------------------------------ windows at the adopted count
    def _judge(self, key: Hashable, median: float) -> None:
        t = self.threads
        best = self.best.get((key, t))
        self._record(key, t, median)
        if best is not None and median > self.slow_factor * best and self.level + 1 < len(self.levels):
            self._start_probe(self.level + 1, f"steps {median / best:.1f}x slower than this count's best")
        elif self.busy_s >= self.next_probe_s and len(self.levels) > 1:
            self._start_probe(self.level - 1 if self.level > 0 else 1, "periodic")

    def _record(self, key: Hashable, threads: int, median: float) -> None:
        self.last[(key, threads)] = median
        best = self.best.get((key, threads))
        self.best[(key, threads)] = median if best is None else min(best, median)

    # ------------------------------------------------------------------ probes
    def _start_probe(self, level: int, reason: str) -> None:
        self.probing, self.probe_reason = level, reason
        self.probes += 1
        self.samples.clear()  # measured at the old count
        logger.debug("probing %d CPU threads (%s)", self.threads, reason)

    def _wins(self, probe_s: float, ref_s: float) -> bool:
        """Whether a probe step or window of probe_s beats the adopted count's ref_s."""
        if self.levels[self.probing] > self.levels[self.level]:
            return probe_s <= ref_s * self.up_tolerance
        return probe_s * self.down_gain <= ref_s

    def _probe_lost(self, key: Hashable, samples: list[float]) -> bool:
        """More than half the window has failed already: its median cannot win."""
        ref = self.last.get((key, self.levels[self.level]))
        return ref is not None and sum(not self._wins(s, ref) for s in samples) > self.window // 2

    def _end_probe(self, key: Hashable, median: float | None) -> None:
        """median None: cut short, lost. A key the adopted count has no window for is inconclusive."""
        home, probe = self.levels[self.level], self.levels[self.probing]
        probe_s = sum(self.samples.pop(key, [])) if median is None else median * self.window
        ref = self.last.get((key, home))
        if median is not None:
            self._record(key, probe, median)
        won = median is not None and ref is not None and self._wins(median, ref)
        if won:
            logger.info("CPU threads %d -> %d (%s): steps %.2f ms against %.2f ms at %d threads", home, probe,
                        self.probe_reason, median * 1e3, ref * 1e3, home)
            self.level, self.interval_s = self.probing, self.probe_min_s
            self.switches += 1
        elif ref is not None:
            self.interval_s = min(2 * self.interval_s, self.probe_max_s)
            if self.levels[self.probing] < home:  # fewer did not help: the slow windows are this count's normal now
                self.best[(key, home)] = max(self.best.get((key, home), 0.0), ref)
        self.next_probe_s = self.busy_s + max(self.interval_s, self.probe_share * probe_s)
        self.probing = None
        self.samples.clear()

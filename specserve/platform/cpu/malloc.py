"""Keep freed activation buffers inside the process (glibc malloc, CPU).

A CPU forward allocates its activations with the C allocator: at batch 32 a prefill chunk's tensors are several MB
each, and a speculative step adds the draft's (its KV gathers, its catch-up over the prompt). glibc's defaults hand
such buffers back to the kernel: blocks above the mmap threshold are unmapped when freed, and a heap whose free top
passes the trim threshold is shrunk. The next forward faults every page in again (the kernel zeroes each 4 KiB
page). Threads other than the main one also get arenas of their own, whose heaps cannot grow past 64 MiB, so large
blocks of the scheduler thread keep falling back to fresh mappings.

Measured on the project's 2-core machine (docs/benchmarks.md, batch 32, demo bf16 with its float32 EAGLE-3 head):
with the defaults a prefill chunk of the target took 8-15k minor page faults and about 30% longer once the
draft's catch-up ran in bf16 (its blocks then share the target's sizes), against 0-1k with the settings below.

``tune_malloc`` (``CpuPolicy.tune_allocator``, which ``Engine`` calls) sets, through ``mallopt`` before the
engine's threads start: one arena for the whole process (``M_ARENA_MAX``), a fixed mmap threshold of 32 MiB
(``M_MMAP_THRESHOLD``, glibc's largest dynamic value; larger blocks are still mapped on their own, and the KV pool
maps its own pages, ``cache/kv_pool.lazy_zeros``) and a trim threshold of 2 GiB (``M_TRIM_THRESHOLD``, the largest
it takes). The heap then keeps what it has held instead of returning it between steps, which is what a serving
process that runs the same shapes step after step wants.

Keeping the heap has a price over hours: small blocks that live long (the prefix cache's slot lists, request state)
land between a step's freed activation buffers, so the heap fragments and its free holes stay resident. In a
30-minute soak of the demo server (``benchmarks/soak.py``, docs/benchmarks.md) a ``malloc_trim(0)`` gave 124 MiB
back at once, 94 MiB of them free holes of the main heap. ``HeapTrimmer`` therefore calls ``malloc_trim(0)``, which
hands the free pages inside the heap back to the kernel (MADV_DONTNEED) whatever the trim threshold, once every
``TRIM_EVERY_S`` of serving and when the engine goes idle; the next step faults those pages in once, about one step's
worth of page faults a minute. With it the soak's worker RSS stayed within +3.7% of its post-warm-up value.

Left alone: a non-glibc C library; a process whose ``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` is set (the user chose); ``SPECSERVE_KEEP_MALLOC_DEFAULTS=1`` (for A/B measurements).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time

from specserve.platform.cpu.clib import c_function, libc_path

logger = logging.getLogger(__name__)

KEEP_DEFAULTS_ENV = "SPECSERVE_KEEP_MALLOC_DEFAULTS"
USER_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

# mallopt parameters (glibc's malloc.h) and the values set
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, 32 * 2**20), (M_TRIM_THRESHOLD, 2**31 - 1))  # mallopt's int max


def should_tune(environ) -> bool:
    """Whether ``tune_malloc`` may change the allocator's settings under this environment."""
    if environ.get(KEEP_DEFAULTS_ENV, "") not in ("", "0"):
        return False
    return not any(name in environ for name in USER_ENV)


@functools.cache
def _mallopt():
    """glibc's mallopt, or None (another C library, or none found)."""
    fn = c_function(libc_path(), "mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    version = c_function(libc_path(), "gnu_get_libc_version", [], ctypes.c_char_p)
    if fn is None or version is None:
        return None
    logger.debug("glibc %s", version().decode())
    return fn


@functools.cache
def tune_malloc() -> bool:
    """Apply SETTINGS once per process (see the module docstring); True when they were all accepted."""
    if not should_tune(os.environ):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    if ok:
        logger.info("malloc: one arena, 32 MiB mmap threshold, heap kept (set %s=1 to keep glibc's defaults)",
                    KEEP_DEFAULTS_ENV)
    return ok


M_MMAP_MAX = -4
# a trainer: no block is mapped on its own, and the heap keeps what is freed. A training step allocates and frees
# the same large activations (a 2048 x 8192 logits block is 64 MiB) again and again; mapped, each one is faulted in
# page by page on every step (SmolLM2's EAGLE-3 head: ~400k page faults, a quarter of the step's time)
TRAINING_SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))


@functools.cache
def tune_malloc_for_training() -> bool:
    """Apply TRAINING_SETTINGS once per process (same opt-outs as tune_malloc); True when they were accepted."""
    if not should_tune(os.environ):
        return False
    mallopt = _mallopt()
    return mallopt is not None and all(mallopt(param, value) == 1 for param, value in TRAINING_SETTINGS)


#: seconds of serving between two trims of the heap (the module docstring says why and what one costs)
TRIM_EVERY_S = 60.0


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    return c_function(libc_path(), "malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def trim_heap() -> bool:
    """Hand the heap's free pages back to the kernel; -> whether glibc released any memory."""
    fn = _malloc_trim()
    return fn is not None and fn(0) == 1


class HeapTrimmer:
    """Trims the heap every ``every_s`` seconds while the engine is busy and once each time it goes idle.

    ``tick(idle)`` is called once per scheduler loop iteration; the clock is injectable for tests.
    """

    def __init__(self, every_s: float = TRIM_EVERY_S, clock=time.monotonic, trim=trim_heap) -> None:
        self.every_s, self.clock, self.trim = every_s, clock, trim
        self.last = clock()
        self.idle_trimmed = False  # the current idle period has had its trim
        self.trims = 0

    def tick(self, idle: bool) -> bool:
        """-> whether it trimmed now."""
        now = self.clock()
        due = now - self.last >= self.every_s or (idle and not self.idle_trimmed)
        if not idle:
            self.idle_trimmed = False
        if not due:
            return False
        self.trim()
        self.last, self.trims = now, self.trims + 1
        self.idle_trimmed = idle
        return True

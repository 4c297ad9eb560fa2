"""Keep idle OpenMP worker threads from slowing the thread that runs the forwards (CPU).

PyTorch's CPU kernels (oneDNN linears, SDPA, softmax, large element-wise ops) run on OpenMP. With GNU libgomp
(what the torch wheels ship), every thread that has ever started a parallel region keeps its own pool of worker
threads, and libgomp counts them all. Once the process holds more of them than it has CPUs, libgomp stops letting
workers spin between parallel regions and puts them to sleep at once (its "throttled" spin count), so every
parallel op pays a futex wake-up. In the engine that is the normal case: the main thread loads the model (its
pool), then the scheduler thread runs the forwards (a second pool).

Measured on the project's 2-core reference machine (bf16, per op): a packed linear [4, 256] x [256, 1536] takes
21 us on the main thread and 36 us on a second thread while the main thread's pool exists; a softmax + top-k over
[4, 2048] 20 against 33 us; SDPA over 367 keys 30 against 43 us. Releasing the idle pool brings the second thread
back to the main thread's figures (``release_thread_pool``, which calls OpenMP 5's ``omp_pause_resource_all`` on the
calling thread: libgomp frees that thread's pool and its count).

Where the engine calls it (through ``PlatformPolicy.release_thread_pool``, on every device):
- the thread that loaded the model, once loading is done (``SchedulerLoop.__init__``);
- a thread submitting requests (``SchedulerLoop.submit``: an ``Engine`` user may have run torch in between);
- the scheduler thread when it goes idle, so a caller's own torch work (a transformers reference, a benchmark's
  other engine) does not pay the same price while the engine waits;
- the scheduler thread before it hands a step to the overlap scheduler's forward thread.
Re-creating a pool costs a thread start (tens of microseconds) the next time the thread runs a parallel op.

``SPECSERVE_KEEP_OMP_POOLS=1`` turns the release off (for A/B measurements, or an OpenMP runtime that misbehaves).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch  # noqa: F401 - loads the OpenMP runtime whose entry point we look up

from specserve.platform.cpu.clib import c_function

logger = logging.getLogger(__name__)

KEEP_POOLS_ENV = "SPECSERVE_KEEP_OMP_POOLS"
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a later region needs to start again


@functools.cache
def _pause_all():
    """The runtime's ``omp_pause_resource_all`` (None when no loaded OpenMP runtime has it)."""
    candidates = [None, *_loaded_omp_libraries()]  # None: the symbols already global in the process
    for path in candidates:
        fn = c_function(path, "omp_pause_resource_all", [ctypes.c_int], ctypes.c_int)
        if fn is not None:
            return fn
    logger.debug("no OpenMP runtime with omp_pause_resource_all is loaded; idle pools are kept")
    return None


def _loaded_omp_libraries() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux), e.g. torch/lib/libgomp.so.1."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP worker threads. -> True when the runtime did (or had none to free);
    False when it cannot (no such runtime, called inside a parallel region) or SPECSERVE_KEEP_OMP_POOLS is set."""
    if os.environ.get(KEEP_POOLS_ENV, "") not in ("", "0"):
        return False
    fn = _pause_all()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0

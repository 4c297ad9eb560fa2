"""specserve.platform.cpu.malloc: glibc malloc settings for a CPU serving process (measured effect in its docstring)."""

import os
import subprocess
import sys
import textwrap

import pytest

from specserve.platform.cpu.malloc import KEEP_DEFAULTS_ENV, USER_ENV, should_tune


@pytest.mark.parametrize("environ,want", [
    ({}, True),
    ({KEEP_DEFAULTS_ENV: "0"}, True),
    ({KEEP_DEFAULTS_ENV: "1"}, False),  # the opt-out for A/B runs
    ({"MALLOC_ARENA_MAX": "4"}, False),  # a user's own malloc settings are left as they are
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, False),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, False),
])
def test_should_tune_respects_the_environment(environ, want):
    assert should_tune(environ) is want


SCRIPT = textwrap.dedent("""
    import os, sys
    from specserve.platform.cpu import malloc
    print(malloc.tune_malloc(), malloc.tune_malloc(), malloc._mallopt() is not None)
""")


def _clean_env() -> dict:
    """This environment without any malloc setting of the user's (which would turn tune_malloc off)."""
    return {k: v for k, v in os.environ.items() if k not in (*USER_ENV, KEEP_DEFAULTS_ENV)}


def _run(env_extra: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True,
                         env={**_clean_env(), **env_extra})
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tune_malloc_applies_once_and_honours_the_opt_out():
    tuned, again, has_mallopt = _run({})
    assert has_mallopt == "True", "a Linux CI machine runs glibc"
    assert tuned == "True" and again == "True"  # every setting accepted; a second call is the cached result
    assert _run({KEEP_DEFAULTS_ENV: "1"})[:2] == ["False", "False"]


def test_a_cpu_engine_tunes_malloc_before_loading(llama_dir, monkeypatch):
    import specserve.engine as engine_mod
    from specserve.platform import CpuPolicy

    calls = []
    real_runner = engine_mod.ModelRunner
    monkeypatch.setattr(CpuPolicy, "tune_allocator", lambda self: calls.append("tune"))
    monkeypatch.setattr(engine_mod, "ModelRunner", lambda *a: calls.append("load") or real_runner(*a))
    with engine_mod.Engine(model_path=llama_dir, device="cpu", max_total_tokens=512) as e:
        assert isinstance(e.scheduler.runner.platform, CpuPolicy)
    assert calls == ["tune", "load"]


def test_heap_trimmer_trims_on_a_period_while_busy_and_once_per_idle_period():
    from specserve.platform.cpu.malloc import HeapTrimmer

    now, trims = [0.0], []
    t = HeapTrimmer(every_s=60, clock=lambda: now[0], trim=lambda: trims.append(now[0]))
    ticks = [(10, False), (59, False), (61, False), (62, True), (63, True), (90, True), (91, False), (92, True),
             (150, False), (153, False)]
    for when, idle in ticks:
        now[0] = when
        t.tick(idle)
    # 61: a minute busy; 62: going idle; 63 and 90: the same idle period; 92: idle again after work;
    # 153: a minute after the last trim
    assert trims == [61, 62, 92, 153] and t.trims == 4


TRIM_SCRIPT = """
import ctypes, sys
from specserve.platform.cpu import malloc
assert malloc.tune_malloc()  # heap kept: glibc itself never trims
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) // 1024
blocks = [libc.malloc(2**20) for _ in range(200)]  # 200 MiB below the mmap threshold: on the heap
keep = libc.malloc(64)  # a small live block above them: the heap's top cannot shrink
for b in blocks:
    ctypes.memset(b, 1, 2**20)
for b in blocks:
    libc.free(b)
before = rss()
print(malloc.trim_heap(), before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_hands_free_holes_back():
    out = subprocess.run([sys.executable, "-c", TRIM_SCRIPT], capture_output=True, text=True, timeout=120,
                         check=True, env=_clean_env())
    released, freed_mib = out.stdout.split()
    assert released == "True" and int(freed_mib) >= 150, out.stdout


REFAULT_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from specserve.platform.cpu.malloc import tune_malloc_for_training
    tuned = tune_malloc_for_training() if sys.argv[1] == "tuned" else False
    x = torch.ones(1)
    faults = []
    for _ in range(40):  # what a training step does: the same large activation allocated, written and freed again
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        y = torch.ones(16 * 2**20)  # 64 MiB
        x = x + y.sum()
        del y
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(tuned, sum(faults[10:]))
""")


def test_training_settings_keep_large_blocks_in_the_heap():
    """Tuned, a freed 64 MiB block stays in the heap and is reused; with glibc's defaults it is unmapped and each new
    one faults its 16k pages in again. (Tuned, the heap may still grow by a few blocks first: small blocks allocated
    after a freed one keep it from merging with the top, so the first repeats can land above it; once there are
    enough free blocks, steps reuse them. The first ten repeats are therefore not counted.)"""
    def run(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", REFAULT_SCRIPT, mode], capture_output=True, text=True,
                             timeout=120, check=True, env=_clean_env())
        tuned, faults = out.stdout.split()
        return tuned, int(faults)

    block = 16 * 2**20 * 4 // 4096  # pages in one 64 MiB block
    tuned, tuned_faults = run("tuned")
    _, default_faults = run("default")
    assert tuned == "True"
    # defaults: each of the 30 counted repeats faults a whole block in; tuned: at most a few late heap growths
    assert default_faults >= 29 * block and tuned_faults <= 3 * block, (default_faults, tuned_faults)

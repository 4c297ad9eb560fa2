"""specserve.platform.cpu.omp: releasing a thread's idle OpenMP workers (measured effect in its docstring)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Runs alone in a fresh interpreter: the thread counts must not see other tests' pools.
SCRIPT = textwrap.dedent("""
    import os, threading, time
    import torch
    from specserve.platform.cpu.omp import release_thread_pool

    def tasks():
        return len(os.listdir("/proc/self/task"))

    def settle(pred):
        deadline = time.monotonic() + 5
        while not pred() and time.monotonic() < deadline:
            time.sleep(0.01)

    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    print("no_pool", release_thread_pool())  # nothing to free yet: still a success
    before = tasks()
    a @ a  # the main thread's first parallel region starts its pool
    with_pool = tasks()
    print("release", release_thread_pool())
    settle(lambda: tasks() < with_pool)
    print("counts", before, with_pool, tasks())
    result = {}
    def worker():  # a second thread's pool is freed the same way
        a @ a
        result["pool"] = tasks()
        result["ok"] = release_thread_pool()
        settle(lambda: tasks() < result["pool"])
        result["after"] = tasks()
        result["same"] = torch.equal(a @ a, a @ a)  # a new pool starts on demand
    t = threading.Thread(target=worker)
    t.start(); t.join()
    print("thread", result["pool"], result["after"], result["ok"], result["same"])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_release_thread_pool_frees_the_callers_workers():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["no_pool"] == "True"
    assert lines["release"] == "True"
    before, with_pool, after = map(int, lines["counts"].split())
    assert with_pool > before, "the matmul should have started OpenMP workers"
    assert after == before, "the released pool's workers should be gone"
    pool, after_thread, ok, same = lines["thread"].split()
    assert ok == "True" and same == "True"
    assert int(after_thread) < int(pool)


def test_bench_omp_runs_end_to_end():
    """The benchmark behind docs/benchmarks.md's OpenMP section (own process: it sets the thread count)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_omp.py"
    out = subprocess.run([sys.executable, str(script), "--reps", "1", "--calls", "20"], capture_output=True,
                         text=True, timeout=120, check=True)
    table = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| op | main thread")
    rows = table[1:]
    assert any(r.startswith("| softmax+top4") for r in rows)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(v) > 0 for v in cells[1:-1]), row  # times
        assert float(cells[-1]) >= 0, row  # a ratio, printed to 2 decimals: 0.00 on a very noisy machine


def test_keep_pools_switch_turns_the_release_off(monkeypatch):
    from specserve.platform.cpu import omp

    monkeypatch.setenv(omp.KEEP_POOLS_ENV, "1")
    assert omp.release_thread_pool() is False
    monkeypatch.setenv(omp.KEEP_POOLS_ENV, "0")
    assert omp.release_thread_pool() is (omp._pause_all() is not None)

"""specserve.omp: releasing a thread's idle OpenMP workers (measured effect in the module's docstring)."""

import subprocess
import sys
import textwrap

import pytest

# Runs alone in a fresh interpreter: the thread counts must not see other tests' pools.
SCRIPT = textwrap.dedent("""
    import os, threading, time
    import torch
    from specserve.omp import release_thread_pool

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

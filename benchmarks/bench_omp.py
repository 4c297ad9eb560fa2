"""Per-op cost of OpenMP pools held by other threads (the reason for ``platform/cpu/omp.py``), side by side in one run.

Times a few ops of the sizes a batch-1 speculative step runs, in three settings, each repetition in turn:
  main      on the main thread (the only pool);
  held      on a second thread while the main thread's pool exists (the engine before ``omp.py``);
  released  on a second thread after the main thread released its pool (``release_thread_pool``).
Reported: the median over repetitions of each op's mean time per call, in microseconds.

    python benchmarks/bench_omp.py [--num-threads 2] [--reps 5] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specserve.bench.report import format_table
from specserve.platform.cpu.omp import release_thread_pool

SETTINGS = ("main", "held", "released")


def make_ops() -> dict[str, Callable[[], object]]:
    """Ops at the demo pair's batch-1 draft sizes (bf16 where the engine runs bf16)."""
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    w = torch.randn(1536, 256, dtype=torch.bfloat16)
    logits = torch.randn(4, 2048)
    q = torch.randn(1, 4, 4, 64, dtype=torch.bfloat16)  # [B, H, Q, D]
    kv = torch.randn(1, 2, 367, 64, dtype=torch.bfloat16)  # [B, Hkv, K, D]
    mask = torch.ones(1, 1, 4, 367, dtype=torch.bool)
    ops = {
        "linear [4,256]x[256,1536]": lambda: F.linear(x, w),
        "softmax+top4 [4,2048]": lambda: torch.softmax(logits, -1).topk(4, -1),
        "sdpa 4q x 367k": lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True),
        "add [4,256] (serial)": lambda: x + x,
    }
    if torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        except RuntimeError:  # a CPU without AVX512: oneDNN packs no bf16 weight there (no such row)
            return ops
        ops["packed linear (oneDNN)"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return ops


def time_ops(ops: dict[str, Callable], calls: int) -> dict[str, float]:
    """-> op -> mean microseconds per call (after a warm-up)."""
    out = {}
    with torch.inference_mode():
        for name, fn in ops.items():
            for _ in range(calls // 10):
                fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name] = (time.perf_counter() - start) / calls * 1e6
    return out


def on_thread(fn: Callable[[], dict]) -> dict:
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(fn()))
    t.start()
    t.join()
    return box


def run(num_threads: int, reps: int, calls: int) -> dict[str, dict[str, float]]:
    """-> setting -> op -> median microseconds per call."""
    torch.set_num_threads(num_threads)
    ops = make_ops()
    samples: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for _ in range(reps):
        samples["main"].append(time_ops(ops, calls))  # the main thread's pool now exists
        samples["held"].append(on_thread(lambda: time_ops(ops, calls)))
        release_thread_pool()
        samples["released"].append(on_thread(lambda: time_ops(ops, calls)))
    return {s: {op: statistics.median(r[op] for r in rows) for op in ops} for s, rows in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_omp.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000, help="calls per op per timing")
    args = p.parse_args(argv)
    result = run(args.num_threads, args.reps, args.calls)
    rows = [{"op": op, **{s: result[s][op] for s in SETTINGS}, "ratio": result["held"][op] / result["released"][op]}
            for op in result["main"]]
    print(f"us per call, median of {args.reps} repetitions, {args.num_threads} threads")
    print(format_table(rows, [("op", "op", None), ("main", "main thread", ".1f"),
                              ("held", "2nd thread, main's pool held", ".1f"),
                              ("released", "2nd thread, main's pool released", ".1f"),
                              ("ratio", "held / released", ".2f")]))
    return result


if __name__ == "__main__":
    main()

"""What a call of specserve's CPU operators costs through their C++ implementations (``platform/cpu/ops.cpp``) and
through their Python ones (``SPECSERVE_CPU_OPS=python``), as compiled graphs call them (``torch.ops.specserve.*``).

Each mode runs in its own process (the C++ implementations, once loaded, take every CPU call), the two alternating
``--rounds`` times; each process times ``--calls`` calls of each operator on SmolLM2-135M's shapes at one row (the
few-row bf16 and int8 linears of q/k/v fused 576 -> 960, the few-query attention of one decode row over 256 keys)
and prints its median per call in us. Printed: the medians over the rounds and native over python (median of the
rounds' ratios). Needs AVX512-BF16, a C++ compiler and PyTorch's headers.

    python benchmarks/bench_ops.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

MODES = ("native", "python")


def time_calls(calls: int, threads: int) -> dict[str, float]:
    """One process's per-call medians (us) of the three operators (5 batches of `calls`)."""
    from specserve.models.quantize import quantize_int8
    from specserve.platform.cpu import int8_gemm, native, small_gemm, tree_attention

    if not (small_gemm.available() and int8_gemm.available() and tree_attention.available()):
        raise SystemExit("the kernels do not run here (no AVX512-BF16 or no C++ compiler)")
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(960, 576, generator=gen) * 0.05
    x = torch.randn(1, 576, generator=gen).to(torch.bfloat16)
    packed = small_gemm.pack(w.to(torch.bfloat16))
    q, scales = quantize_int8(w)
    packed8 = int8_gemm.pack(q)
    k_buf, v_buf = (torch.randn(512, 3, 64, generator=gen).to(torch.bfloat16) for _ in range(2))  # SmolLM2: 3 KV
    qb = torch.randn(1, 1, 9, 64, generator=gen).to(torch.bfloat16)  # heads, 9 query heads of 64
    slots = torch.arange(256).view(1, 256)
    ops = {
        "small_gemm": lambda: small_gemm.small_gemm(x, packed, None, 0),
        "int8_gemm": lambda: int8_gemm.int8_gemm(x, packed8, scales, None),
        "tree_attention": lambda: tree_attention.tree_attention_op(qb, k_buf, v_buf, slots, None, 0.125),
    }
    out = {"native": native.native_ops()}
    with torch.inference_mode():
        for name, call in ops.items():
            out[name] = per_call_us(call, calls, warmup=200)
    return out


def per_call_us(fn, calls: int, warmup: int | None = None) -> float:
    """fn's median time per call in us over 5 batches of `calls` calls, after `warmup` calls (default calls // 10)."""
    for _ in range(max(calls // 10, 1) if warmup is None else warmup):
        fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(time_calls(args.calls, args.num_threads)))
        return
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            env = dict(os.environ, SPECSERVE_CPU_OPS=mode)
            cmd = [sys.executable, __file__, "--child", "--calls", str(args.calls), "--num-threads",
                   str(args.num_threads)]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            if res.pop("native") is not (mode == "native"):
                raise SystemExit(f"SPECSERVE_CPU_OPS={mode} did not take effect (PyTorch's headers missing?)")
            runs[mode].append(res)
    print(f"us per call, one row, {args.num_threads} threads, median of {args.rounds} rounds")
    print(f"{'operator':>16} {'native':>8} {'python':>8} {'native / python':>16}")
    for name in runs["native"][0]:
        med = {m: statistics.median(r[name] for r in runs[m]) for m in MODES}
        ratio = statistics.median(a[name] / b[name] for a, b in zip(runs["native"], runs["python"], strict=True))
        print(f"{name:>16} {med['native']:>8.2f} {med['python']:>8.2f} {ratio:>16.2f}")


if __name__ == "__main__":
    main()

"""Software prefetch in specserve's few-row CPU kernels (``small_gemm.cpp``, bf16; ``int8_gemm.cpp``, int8): each
kernel built with every ``--distances`` value of ``SPECSERVE_PREFETCH_BYTES`` (0 = no prefetch, the hardware
prefetchers alone; the kernels' default is 4096), all loaded at once and called pass by pass in turn.

A pass calls every linear of a SmolLM2-135M-shaped stack (``bench_int8.py``'s: 30 layers and the LM head, 270 MB
of bf16 or 134 MB of int8 streamed from memory, as a decode step does) at 1 and 4 rows. Printed per kernel and row
count: each distance's median pass in ms and its ratio to no prefetch (median of the pass-by-pass ratios, with
their range). ``--end-to-end N``: then N pairs of processes, one with both kernels built without prefetch and one
with their default distances (the bf16 kernel's asked for with SPECSERVE_SMALL_GEMM_PREFETCH, which its load-time
probe would otherwise choose), alternating, each decoding ``--max-new-tokens`` greedy tokens of one prompt 3 times
on ``--model-path`` (default: the bundled SmolLM2) in bf16 plain; printed: each process's median tokens/s and each
pair's ratio. Needs AVX512-BF16 and a C++ compiler.

    python benchmarks/bench_prefetch.py --reps 15 --end-to-end 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from bench_int8 import linears
from specserve.platform.cpu import int8_gemm, native, small_gemm

KERNELS = {"bf16": ("small_gemm.cpp", "small_gemm_bf16", small_gemm.ARGTYPES),
           "int8": ("int8_gemm.cpp", "int8_gemm_bf16", int8_gemm.ARGTYPES)}


def build(kind: str, distance: int):
    """The kernel of `kind` built with that prefetch distance -> its ctypes function."""
    source_name, symbol, argtypes = KERNELS[kind]
    return native.function(source_name, symbol, argtypes, (f"-DSPECSERVE_PREFETCH_BYTES={distance}",))


def one_pass(kind: str, fn, mats: list[dict], xs: dict[int, torch.Tensor], threads: int) -> float:
    """Seconds for one call of `fn` per linear."""
    start = time.perf_counter()
    for m in mats:
        x = xs[m["k"]]
        rows, k = x.shape
        if kind == "bf16":
            w = m["bf16"]
            n = w.shape[0] * small_gemm.COLS
            y = torch.empty(rows, n, dtype=torch.bfloat16)
            fn(x.data_ptr(), rows, k, k, w.data_ptr(), n, None, y.data_ptr(), n, threads, 0)  # the vector loop
        else:
            c = m["int8"]
            n = c.packed.shape[0] * int8_gemm.COLS
            y = torch.empty(rows, n, dtype=torch.bfloat16)
            fn(x.data_ptr(), rows, k, k, c.packed.data_ptr(), n, c.scales.data_ptr(), None, y.data_ptr(), n, threads)
    return time.perf_counter() - start


def decode_rate(model_path: str, new_tokens: int, threads: int, no_prefetch: bool) -> float:
    """Median tokens/s of 3 greedy generate calls, the kernels built without prefetch where asked (a fresh process:
    the build flags apply when the kernels are first built and loaded), the bf16 kernel's distance set to match
    (SPECSERVE_SMALL_GEMM_PREFETCH, which its load-time probe would otherwise choose)."""
    os.environ[small_gemm.PREFETCH_ENV] = "off" if no_prefetch else "on"
    if no_prefetch:
        native.FLAGS = [*native.FLAGS, "-DSPECSERVE_PREFETCH_BYTES=0"]
    from specserve import Engine

    engine = Engine(model_path=model_path, dtype="bfloat16", num_threads=threads, log_level="warning")
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    engine.generate(prompt, params)  # warm-up
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        engine.generate(prompt, params)
        rates.append(new_tokens / (time.perf_counter() - start))
    engine.shutdown()
    return statistics.median(rates)


def end_to_end(pairs: int, model_path: str, new_tokens: int, threads: int) -> None:
    def child(no_prefetch: bool) -> float:
        cmd = [sys.executable, __file__, "--child", "off" if no_prefetch else "on", "--model-path", model_path,
               "--max-new-tokens", str(new_tokens), "--num-threads", str(threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return float(out.strip().splitlines()[-1])

    print(f"{model_path}, bf16 plain, {new_tokens} greedy tokens a call, median of 3 calls a process")
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        rate = {no_prefetch: child(no_prefetch) for no_prefetch in order}
        print(f"pair {i + 1}: no prefetch {rate[True]:.1f} tok/s, prefetch {rate[False]:.1f} tok/s, "
              f"{rate[False] / rate[True]:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--distances", default="0,4096", help="comma-separated prefetch distances in bytes; 0 first")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--end-to-end", type=int, default=0, metavar="N", help="pairs of decoding processes (0: none)")
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(decode_rate(args.model_path, args.max_new_tokens, args.num_threads, args.child == "off"))
        return
    distances = [int(d) for d in args.distances.split(",")]
    if distances[0] != 0:
        raise SystemExit("--distances must start with 0 (the ratios are to no prefetch)")
    if not small_gemm.available() or not int8_gemm.available():
        raise SystemExit("the kernels do not run here (no AVX512-BF16 or no C++ compiler)")
    torch.set_num_threads(args.num_threads)
    mats = linears(args.layers)
    print(f"{args.layers} SmolLM2-135M-shaped layers + LM head, {args.num_threads} threads, {args.reps} passes each, "
          "alternating; ms per pass (median) and ratio to no prefetch (median, range)")
    with torch.inference_mode():
        fns = {(kind, d): build(kind, d) for kind in KERNELS for d in distances}
        for kind in KERNELS:
            for rows in (1, 4):
                xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {m["k"] for m in mats}}
                times: dict[int, list[float]] = {d: [] for d in distances}
                for _ in range(args.reps + 1):  # the first round warms up
                    for d in distances:
                        times[d].append(one_pass(kind, fns[kind, d], mats, xs, args.num_threads))
                base = times[0][1:]
                cells = []
                for d in distances:
                    ratios = [b / t for b, t in zip(base, times[d][1:], strict=True)]
                    cells.append(f"{d}: {statistics.median(times[d][1:]) * 1e3:.2f} ms "
                                 f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
                print(f"{kind} {rows} row{'s' if rows > 1 else ''}: " + ", ".join(cells))
    if args.end_to_end:
        end_to_end(args.end_to_end, args.model_path, args.max_new_tokens, args.num_threads)


if __name__ == "__main__":
    main()

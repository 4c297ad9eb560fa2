"""Few-query attention on CPU: specserve's kernel against the SDPA path it replaces, one layer's call at a time.

For each shape (heads / KV heads / head dim of a model, queries per request, keys per request), both paths attend
bf16 queries over keys and values read from a pool of POOL_SLOTS slots (each request's keys in consecutive slots)
through the SDPA backend's own ``_attend``, as an eager attention layer calls it: once with the CPU policy's rules
but the kernel off (each request's keys and values gathered from the pool, then SDPA: decode rows with a KV head's
query heads folded into one block, ``_attend_one_query``; trees of 4 or more requests folded likewise,
``_attend_folded``; else SDPA with ``enable_gqa``), once with the kernel (``specserve.platform.cpu.tree_attention``,
reading them by slot). A verify tree's mask is a chain of its drafted tokens over the prefix; a decode row sees
every key. The two alternate call by call, ``--reps`` rounds of ``--calls`` calls each; the script
prints each path's median per call and the ratio, with the rounds' spread, and the largest difference of outputs.

    python benchmarks/bench_attention.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.attention.sdpa import AttnMetadata, _attend
from specserve.platform.cpu import tree_attention
from specserve.platform.cpu.policy import CpuPolicy

POOL_SLOTS = 32768
MODELS = {"demo": (4, 2, 64), "smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}
SHAPES = [(1, 1, 128), (1, 1, 512), (1, 1, 2048), (1, 3, 200), (1, 8, 300), (1, 12, 200), (1, 12, 1000),
          (16, 1, 300), (16, 4, 300)]  # (requests, queries per request, keys per request)


class Rules(CpuPolicy):
    """The CPU policy's attention rules, with or without the kernel, without the rest of its set-up."""

    def __init__(self, kernel: bool) -> None:
        self.tree_attention = kernel


def attend(rules: Rules, q, k_buf, v_buf, md, scale):
    return _attend(q, k_buf, v_buf, md, scale, rules)


def case(heads: tuple[int, int, int], bsz: int, n_q: int, keys: int, gen: torch.Generator):
    n_heads, n_kv, dim = heads
    k_buf = torch.randn(POOL_SLOTS, n_kv, dim, generator=gen).bfloat16()
    v_buf = torch.randn(POOL_SLOTS, n_kv, dim, generator=gen).bfloat16()
    # each request's keys in consecutive slots from a random start, as a fresh pool hands them out
    starts = torch.randint(0, POOL_SLOTS - keys, (bsz, 1), generator=gen)
    slots = starts + torch.arange(keys).view(1, keys)
    q = torch.randn(bsz * n_q, n_heads, dim, generator=gen).bfloat16()  # [T, H, D]
    mask = None
    if n_q > 1:  # a chain of n_q drafted tokens after the prefix
        mask = torch.ones(bsz, 1, n_q, keys, dtype=torch.bool)
        mask[..., keys - n_q :] = torch.tril(torch.ones(n_q, n_q, dtype=torch.bool))
    md = AttnMetadata(bsz, n_q, slots, mask, False, None, None)
    return q, k_buf, v_buf, md, dim**-0.5


def per_call(fn, args, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    if tree_attention.kernel() is None:
        raise SystemExit("the kernel cannot run here (no AVX512-BF16 or no C++ compiler)")
    torch.set_num_threads(args.num_threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.num_threads} threads, {args.reps} rounds x {args.calls} calls, medians per call")
    print("| model (heads / KV heads / dim) | requests | queries | keys | SDPA path us | kernel us | speed-up "
          "(rounds) | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    with torch.inference_mode():
        for name in args.models.split(","):
            for bsz, n_q, keys in SHAPES:
                inputs = case(MODELS[name], bsz, n_q, keys, gen)
                off, on = (Rules(False), *inputs), (Rules(True), *inputs)
                diff = (attend(*off).float() - attend(*on).float()).abs().max()
                sdpa, kernel = [], []
                for _ in range(args.reps + 1):  # the first round warms up
                    sdpa.append(per_call(attend, off, args.calls))
                    kernel.append(per_call(attend, on, args.calls))
                sdpa, kernel = sdpa[1:], kernel[1:]
                ratios = sorted(s / k for s, k in zip(sdpa, kernel, strict=True))
                print(f"| {name} ({'/'.join(map(str, MODELS[name]))}) | {bsz} | {n_q} | {keys} "
                      f"| {statistics.median(sdpa) * 1e6:.1f} | {statistics.median(kernel) * 1e6:.1f} "
                      f"| {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | {diff:.4f} |")


if __name__ == "__main__":
    main()

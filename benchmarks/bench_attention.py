"""Few-query attention on CPU: specserve's kernel against the SDPA path it replaces, one layer's call at a time.

For each shape (heads / KV heads / head dim of a model, queries per request, keys per request), both paths attend
bf16 queries over keys and values read from a pool of POOL_SLOTS slots (each request's keys in consecutive slots),
as the engine's attention layer calls them: the SDPA path gathers each request's keys and values from the pool and calls
``F.scaled_dot_product_attention`` with the mask (GQA by ``enable_gqa``); the kernel reads them by slot
(``specserve.platform.cpu.tree_attention``). A verify tree's mask is its ancestors' (a chain) over the prefix; a
decode row sees every key. The two alternate call by call, ``--reps`` rounds of ``--calls`` calls each; the script
prints each path's median per call and the ratio, with the rounds' spread, and the largest difference of outputs.

    python benchmarks/bench_attention.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specserve.platform.cpu import tree_attention

POOL_SLOTS = 32768
MODELS = {"demo": (4, 2, 64), "smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}
SHAPES = [(1, 1, 128), (1, 1, 512), (1, 1, 2048), (1, 3, 200), (1, 8, 300), (1, 12, 200), (1, 12, 1000),
          (16, 1, 300), (16, 4, 300)]  # (requests, queries per request, keys per request)


def sdpa_path(qb, k_buf, v_buf, slots, mask, scale):
    bsz, _, n_heads, head_dim = qb.shape
    flat = slots.reshape(-1)
    kb = k_buf.index_select(0, flat).view(bsz, -1, k_buf.shape[1], head_dim)
    vb = v_buf.index_select(0, flat).view(bsz, -1, v_buf.shape[1], head_dim)
    return F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=mask,
                                          scale=scale, enable_gqa=kb.shape[2] != n_heads
                                          ).transpose(1, 2).reshape(-1, n_heads * head_dim)


def case(heads: tuple[int, int, int], bsz: int, n_q: int, keys: int, gen: torch.Generator):
    n_heads, n_kv, dim = heads
    k_buf = torch.randn(POOL_SLOTS, n_kv, dim, generator=gen).bfloat16()
    v_buf = torch.randn(POOL_SLOTS, n_kv, dim, generator=gen).bfloat16()
    # each request's keys in consecutive slots from a random start, as a fresh pool hands them out
    starts = torch.randint(0, POOL_SLOTS - keys, (bsz, 1), generator=gen)
    slots = starts + torch.arange(keys).view(1, keys)
    qb = torch.randn(bsz, n_q, n_heads, dim, generator=gen).bfloat16()
    mask = None
    if n_q > 1:  # a chain of n_q drafted tokens after the prefix
        mask = torch.ones(bsz, 1, n_q, keys, dtype=torch.bool)
        mask[..., keys - n_q :] = torch.tril(torch.ones(n_q, n_q, dtype=torch.bool))
    return qb, k_buf, v_buf, slots, mask, dim**-0.5


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
                diff = (sdpa_path(*inputs).float() - tree_attention.tree_attention(*inputs).float()).abs().max()
                sdpa, kernel = [], []
                for _ in range(args.reps + 1):  # the first round warms up
                    sdpa.append(per_call(sdpa_path, inputs, args.calls))
                    kernel.append(per_call(tree_attention.tree_attention, inputs, args.calls))
                sdpa, kernel = sdpa[1:], kernel[1:]
                ratios = sorted(s / k for s, k in zip(sdpa, kernel, strict=True))
                print(f"| {name} ({'/'.join(map(str, MODELS[name]))}) | {bsz} | {n_q} | {keys} "
                      f"| {statistics.median(sdpa) * 1e6:.1f} | {statistics.median(kernel) * 1e6:.1f} "
                      f"| {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | {diff:.4f} |")


if __name__ == "__main__":
    main()

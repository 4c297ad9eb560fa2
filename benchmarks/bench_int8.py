"""Weight-only int8 linears on CPU: specserve's int8 kernel against PyTorch's int8 matmul and the bf16 few-row kernel.

One pass calls every linear of a SmolLM2-135M-shaped stack (30 layers of q/k/v fused 576 -> 960, o 576 -> 576,
gate/up fused 576 -> 3072, down 1536 -> 576, then the LM head 576 -> 49152; random weights, so 134 MB of int8 and
270 MB of bf16 stream from memory as in a decode step) at 1, 4, 8 and 16 rows (``--rows``):
- ``int8``: specserve's kernel (``platform/cpu/int8_gemm.py``: its AVX512-BF16 one, else its AVX2 one) on its vector
  loop, as ``--torchao-config int8wo`` runs it in bf16 for one row;
- ``int8 tile``: the same kernel on the tile unit (where the CPU has AMX), as int8wo runs it from 2 rows there;
- ``torch int8``: ``torch._weight_int8pack_mm`` on the same int8 weights and scales (what runs without the kernel);
- ``bf16``: specserve's bf16 kernel on the unquantized weights, the one the engine runs here: the few-row kernel
  (``platform/cpu/small_gemm.py``) with AVX512-BF16 (on the tile unit from AMX_UNTIMED_FROM rows where it runs),
  else the AVX2 kernel (``platform/cpu/avx2_gemm.py``).
The passes alternate kind by kind, ``--reps`` times per row count; printed: each kind's fastest and median pass in
ms, and int8 over bf16 (median over median; the tile unit's where it runs). Needs AVX512-BF16, or AVX2 and FMA, and
a C++ compiler.

    python benchmarks/bench_int8.py --reps 15

``--end-to-end``: SmolLM2-135M-Instruct under ``--torchao-config int8wo`` (bf16), two plain engines in one process,
loaded with SPECSERVE_INT8_GEMM_AMX=off and the default, decoding the same batches of held-out prompts (greedy,
``--max-new-tokens``, EOS ignored) in turn, for each ``--batch-sizes`` entry; printed: each engine's tokens/s (its
median round) and auto over off, the median of the per-round ratios with their range. Needs a CPU with AMX.

    python benchmarks/bench_int8.py --end-to-end --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specserve.models.quantize import quantize_int8
from specserve.platform.cpu import avx2_gemm, int8_gemm, small_gemm

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] of a SmolLM2-135M layer's linears
LM_HEAD = (49152, 576)


def linears(layers: int) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for n, k in LAYER * layers + [LM_HEAD]:
        w = torch.randn(n, k, generator=gen) * 0.05
        q, s = quantize_int8(w)
        out.append(dict(k=k, q=q, scales=s.to(torch.bfloat16), int8=int8_gemm.Int8Copy(q, s, None),
                        bf16=small_gemm.pack(w.to(torch.bfloat16))))
    return out


def one_pass(kind: str, mats: list[dict], xs: dict[int, torch.Tensor]) -> float:
    bf16_tile = small_gemm.AMX_UNTIMED_FROM if small_gemm.amx_runs() else 0
    start = time.perf_counter()
    for m in mats:
        x = xs[m["k"]]
        if kind in ("int8", "int8 tile"):
            copy = m["int8"]
            int8_gemm.int8_mm(x, copy.packed, copy.scales, None, 1 if kind == "int8 tile" else 0)
        elif kind == "torch int8":
            torch._weight_int8pack_mm(x, m["q"], m["scales"])
        elif small_gemm.available():
            small_gemm.small_mm(x, m["bf16"], None, bf16_tile)
        else:
            avx2_gemm._avx2_mm(x, m["bf16"], None)  # the same packed layout
    return time.perf_counter() - start


def end_to_end(batch_sizes: list[int], rounds: int, max_new_tokens: int, threads: int) -> None:
    """Two int8wo SmolLM2 engines, the tile unit off and on (auto), the same batches in turn."""
    from specserve.bench.eval_acceptance import held_out_prompts_for
    from specserve.engine import Engine

    engines = {}
    for mode in ("off", "auto"):
        os.environ[int8_gemm.AMX_ENV] = mode  # read as each engine loads its int8 linears
        engines[mode] = Engine(model_path="smollm2", dtype="bfloat16", num_threads=threads, torchao_config="int8wo")
    os.environ.pop(int8_gemm.AMX_ENV)
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    prompts = held_out_prompts_for("smollm2", max(batch_sizes))
    print(f"SmolLM2-135M-Instruct, --torchao-config int8wo, {threads} threads, {max_new_tokens} new tokens a request, "
          f"{rounds} rounds; tok/s: median round")
    print(f"{'batch':>5} {'tile unit off':>14} {'auto':>10} {'auto / off (rounds)':>30}")
    try:
        for b in batch_sizes:
            batch = prompts[:b]
            rates: dict[str, list[float]] = {m: [] for m in engines}
            for e in engines.values():  # warm-up
                e.generate(batch, params)
            for _ in range(rounds):
                for mode, e in engines.items():
                    start = time.perf_counter()
                    outs = e.generate(batch, params)
                    rates[mode].append(sum(o["meta_info"]["completion_tokens"] for o in outs)
                                       / (time.perf_counter() - start))
            ratios = [a / o for a, o in zip(rates["auto"], rates["off"], strict=True)]
            spread = ", ".join(f"{r:.2f}" for r in ratios)
            print(f"{b:>5} {statistics.median(rates['off']):>14.1f} {statistics.median(rates['auto']):>10.1f} "
                  f"{statistics.median(ratios):>10.2f} ({spread})")
    finally:
        for e in engines.values():
            e.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rows", default="1,4,8,16", help="row counts of the kernel passes")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--end-to-end", action="store_true", help="int8wo engines with the tile unit off and on instead")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if not int8_gemm.available() or not (small_gemm.available() or avx2_gemm.available()):
        raise SystemExit("the kernels do not run here (neither AVX512-BF16 nor AVX2 and FMA, or no C++ compiler)")
    torch.set_num_threads(args.num_threads)
    if args.end_to_end:
        if not int8_gemm.amx_runs():
            raise SystemExit("--end-to-end compares the int8 kernel's tile-unit path, which does not run here")
        end_to_end([int(b) for b in args.batch_sizes.split(",")], args.rounds, args.max_new_tokens, args.num_threads)
        return
    mats = linears(args.layers)
    kinds = ("int8", *(("int8 tile",) if int8_gemm.amx_runs() else ()), "torch int8", "bf16")
    best = kinds[1] if int8_gemm.amx_runs() else "int8"
    print(f"{args.layers} SmolLM2-135M-shaped layers + LM head, {args.num_threads} threads, {args.reps} passes each; "
          "ms per pass: fastest / median")
    print(f"{'rows':>4} " + " ".join(f"{k:>16}" for k in kinds) + f" {best + ' / bf16':>16}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {m["k"] for m in mats}}
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.reps + 1):  # the first round warms up
                for kind in kinds:
                    times[kind].append(one_pass(kind, mats, xs))
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            cells = " ".join(f"{min(v[1:]) * 1e3:>7.2f} / {med[k] * 1e3:>6.2f}" for k, v in times.items())
            print(f"{rows:>4} {cells} {med[best] / med['bf16']:>16.2f}")


if __name__ == "__main__":
    main()

"""Weight-only int8 linears on CPU: specserve's int8 kernel against PyTorch's int8 matmul and the bf16 few-row kernel.

One pass calls every linear of a SmolLM2-135M-shaped stack (30 layers of q/k/v fused 576 -> 960, o 576 -> 576,
gate/up fused 576 -> 3072, down 1536 -> 576, then the LM head 576 -> 49152; random weights, so 134 MB of int8 and
270 MB of bf16 stream from memory as in a decode step) at 1, 4, 8 and 16 rows:
- ``int8``: specserve's kernel (``platform/cpu/int8_gemm.py``: its AVX512-BF16 one, else its AVX2 one), as
  ``--torchao-config int8wo`` runs it in bf16;
- ``torch int8``: ``torch._weight_int8pack_mm`` on the same int8 weights and scales (what runs without the kernel);
- ``bf16``: specserve's bf16 kernel on the unquantized weights, the one the engine runs here: the few-row kernel
  (``platform/cpu/small_gemm.py``) with AVX512-BF16, else the AVX2 kernel (``platform/cpu/avx2_gemm.py``).
The passes alternate kind by kind, ``--reps`` times per row count; printed: each kind's fastest and median pass in
ms, and int8 over bf16 (median over median). Needs AVX512-BF16, or AVX2 and FMA, and a C++ compiler.

    python benchmarks/bench_int8.py --reps 15
"""

from __future__ import annotations

import argparse
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
    start = time.perf_counter()
    for m in mats:
        x = xs[m["k"]]
        if kind == "int8":
            m["int8"].run(x)
        elif kind == "torch int8":
            torch._weight_int8pack_mm(x, m["q"], m["scales"])
        elif small_gemm.available():
            small_gemm.small_mm(x, m["bf16"], None)
        else:
            avx2_gemm._avx2_mm(x, m["bf16"], None)  # the same packed layout
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    if not int8_gemm.available() or not (small_gemm.available() or avx2_gemm.available()):
        raise SystemExit("the kernels do not run here (neither AVX512-BF16 nor AVX2 and FMA, or no C++ compiler)")
    torch.set_num_threads(args.num_threads)
    mats = linears(args.layers)
    kinds = ("int8", "torch int8", "bf16")
    print(f"{args.layers} SmolLM2-135M-shaped layers + LM head, {args.num_threads} threads, {args.reps} passes each; "
          "ms per pass: fastest / median")
    print(f"{'rows':>4} " + " ".join(f"{k:>16}" for k in kinds) + f" {'int8 / bf16':>12}")
    with torch.inference_mode():
        for rows in (1, 4, 8, 16):
            xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {m["k"] for m in mats}}
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.reps + 1):  # the first round warms up
                for kind in kinds:
                    times[kind].append(one_pass(kind, mats, xs))
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            cells = " ".join(f"{min(v[1:]) * 1e3:>7.2f} / {med[k] * 1e3:>6.2f}" for k, v in times.items())
            print(f"{rows:>4} {cells} {med['int8'] / med['bf16']:>12.2f}")


if __name__ == "__main__":
    main()

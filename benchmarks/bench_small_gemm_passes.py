"""How many rows one pass of specserve's few-row bf16 kernel (``small_gemm.cpp``) takes over a group of weight
columns: the kernel built with each ``--pass-rows`` value of ``SPECSERVE_SMALL_GEMM_PASS_ROWS`` (the default build's
is 6), all loaded at once and called pass by pass in turn. The first pass over a group streams
its weights from memory; each further pass re-reads them from the core's L2, so fewer, fuller passes cost less
where the weights do not sit in the caches.

A pass calls every linear of a stack streamed from memory as a decode or verify step does (``--model smollm2``:
SmolLM2-135M's 30 layers and its LM head, 256 MiB of bf16; ``demo``: the bundled code model's 12 layers and LM
head, 20 MiB), with ``--kind int8`` the int8 kernel (``int8_gemm.cpp``, ``SPECSERVE_INT8_GEMM_PASS_ROWS``) over the
same shapes quantized, at each of ``--rows``. Printed per row count: each build's median pass in ms, each build's
ratio to the first (median of the pass-by-pass ratios, with their range), and whether every build's outputs equal
the first's bit for bit. Needs AVX512-BF16 and a C++ compiler.

    python benchmarks/bench_small_gemm_passes.py --reps 15 [--model demo]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.models.quantize import quantize_int8
from specserve.platform.cpu import int8_gemm, native, small_gemm

SHAPES = {  # [out, in] of a layer's linears (qkv, o, gate_up, down), the layer count, and the LM head
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
    "demo": ([(512, 256), (256, 256), (1536, 256), (256, 768)], 12, (4096, 256)),
}


def build(pass_rows: int, kind: str = "bf16"):
    """The kernel of `kind` (bf16: ``small_gemm.cpp``; int8: ``int8_gemm.cpp``) built with passes of at most
    `pass_rows` rows -> its ctypes function."""
    if kind == "int8":
        return native.function("int8_gemm.cpp", "int8_gemm_bf16", int8_gemm.AMX_ARGTYPES,
                               (f"-DSPECSERVE_INT8_GEMM_PASS_ROWS={pass_rows}",))
    return native.function("small_gemm.cpp", "small_gemm_bf16", small_gemm.ARGTYPES,
                           (f"-DSPECSERVE_SMALL_GEMM_PASS_ROWS={pass_rows}",))


def weights(model: str, kind: str = "bf16") -> list:
    """The model-shaped stack's packed weights (random, seeded): bf16 packed, or int8 copies (``Int8Copy``)."""
    layer, count, head = SHAPES[model]
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in layer * count + [head]:
        w = torch.randn(n, k, generator=gen) * 0.05
        out.append(int8_gemm.Int8Copy(*quantize_int8(w), None) if kind == "int8" else
                   small_gemm.pack(w.to(torch.bfloat16)))
    return out


def run_pass(fn, mats: list, xs: dict[int, torch.Tensor], threads: int) -> tuple[float, list]:
    """Seconds for one call of `fn` per weight (the vector loop, no tile unit), and the outputs."""
    outs = []
    start = time.perf_counter()
    for w in mats:
        int8 = isinstance(w, int8_gemm.Int8Copy)
        packed = w.packed if int8 else w
        k = packed.shape[1] * 2
        x = xs[k]
        n = packed.shape[0] * (int8_gemm.COLS if int8 else small_gemm.COLS)
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        if int8:
            fn(x.data_ptr(), x.shape[0], k, k, packed.data_ptr(), n, w.scales.data_ptr(), None, y.data_ptr(), n,
               threads, 0)
        else:
            fn(x.data_ptr(), x.shape[0], k, k, packed.data_ptr(), n, None, y.data_ptr(), n, threads, 0)
        outs.append(y)
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--kind", choices=("bf16", "int8"), default="bf16", help="the bf16 or the int8 kernel")
    ap.add_argument("--pass-rows", default="4,6", help="builds to compare, the first the baseline of the ratios")
    ap.add_argument("--rows", default="1,4,6,8,9,12,13,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    builds = {int(p): build(int(p), args.kind) for p in args.pass_rows.split(",")}
    if None in builds.values():
        raise SystemExit("the few-row kernel does not run here (AVX512-BF16 and a C++ compiler needed)")
    base = next(iter(builds))
    mats = weights(args.model, args.kind)
    gen = torch.Generator().manual_seed(1)
    tensors = [w.packed if isinstance(w, int8_gemm.Int8Copy) else w for w in mats]
    mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    print(f"{args.model}: {mib:.0f} MiB of {args.kind} weights a pass, "
          f"{args.num_threads} threads; ratios to passes of {base} rows")
    print(f"{'rows':>4} " + " ".join(f"{f'{p} a pass ms':>13}" for p in builds) + " " +
          " ".join(f"{f'{p} / {base}':>20}" for p in builds if p != base) + f" {'equal':>5}")
    for rows in (int(r) for r in args.rows.split(",")):
        ks = {(w.packed if isinstance(w, int8_gemm.Int8Copy) else w).shape[1] * 2 for w in mats}
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in ks}
        outs = {p: run_pass(fn, mats, xs, args.num_threads)[1] for p, fn in builds.items()}  # warm-up too
        equal = all(torch.equal(a, b) for p in builds for a, b in zip(outs[base], outs[p], strict=True))
        times: dict[int, list[float]] = {p: [] for p in builds}
        for _ in range(args.reps):
            for p, fn in builds.items():
                times[p].append(run_pass(fn, mats, xs, args.num_threads)[0])
        cells = [f"{1e3 * statistics.median(times[p]):>13.2f}" for p in builds]
        for p in builds:
            if p != base:
                r = [a / b for a, b in zip(times[p], times[base], strict=True)]
                cells.append(f"{f'{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})':>20}")
        print(f"{rows:>4} " + " ".join(cells) + f" {'yes' if equal else 'NO':>5}")


if __name__ == "__main__":
    main()

"""The tile unit (AMX) in specserve's few-row bf16 kernel (``small_gemm.cpp``) against its vector loop.

Kernel: passes over every linear of a SmolLM2-135M-shaped stack (30 layers and the LM head, 270 MB of bf16 streamed
from memory, as a decode step does) and of the demo target's shape (12 layers, hidden 256, 23 MB), at 1-64 rows,
the kernel's two paths and oneDNN's packed kernel (what calls past the kernel's rows run) alternating pass by pass
in one process. Printed per model and row count: each one's median pass in ms, and the vector loop's and oneDNN's
time over the tile unit's (medians of the pass-by-pass ratios, with their range).

``--end-to-end``: then two engines in one process, loaded with ``SPECSERVE_SMALL_GEMM_AMX=off`` and ``auto`` (the
default: the load-time probe picks the rows that take the tile unit), decoding the same held-out prompts in turn,
prompt by prompt, for each ``--configs`` entry (model:algorithm:temperature; algorithm plain or EAGLE3 with the
model's bundled head). Printed: each engine's tokens/s, accept length and plain steps (batch-aware speculation), the
probe's verdict, and auto over off as the median of the per-round ratios. Needs a CPU with AMX and a C++ compiler.

    python benchmarks/bench_amx.py --reps 9 --end-to-end
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from bench_int8 import LAYER, LM_HEAD
from specserve.platform.cpu import small_gemm
from specserve.platform.cpu.packing import pack_linears_for_cpu

SHAPES = {  # (out, in) of a layer's linears (q/k/v as one, o, gate/up as one, down), layer count, the LM head
    "smollm2": (LAYER, 30, LM_HEAD),
    "demo": ([(768, 256), (256, 256), (1536, 256), (256, 768)], 12, (4096, 256)),
}
DEFAULT_CONFIGS = "demo:EAGLE3:0.7,demo:EAGLE3:0,smollm2:EAGLE3:0,smollm2:plain:0"


def stack(name: str) -> list:
    """The model's linears as the engine holds them in bf16 (``PackedLinear``s with the kernel's layout)."""
    layer, layers, head = SHAPES[name]
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(k, n, bias=False, dtype=torch.bfloat16) for n, k in layer * layers + [head]])
    pack_linears_for_cpu(seq, keep_small=True)
    return list(seq)


def one_pass(mats, xs: dict[int, torch.Tensor], path: str) -> float:
    start = time.perf_counter()
    for m in mats:
        x = xs[m.in_features]
        if path == "oneDNN":
            m.packed_call(x)
        else:
            small_gemm.small_mm(x, m.small.packed, None, 1 if path == "tile" else 0)
    return time.perf_counter() - start


def kernel_passes(reps: int, rows_list: list[int]) -> None:
    print(f"ms per pass (median of {reps}): vector loop / tile unit / oneDNN's packed kernel; vector over tile and "
          "oneDNN over tile (median of the pass-by-pass ratios, range)")
    with torch.inference_mode():
        for name in SHAPES:
            mats = stack(name)
            for rows in rows_list:
                xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {m.in_features for m in mats}}
                times: dict[str, list[float]] = {"vector": [], "tile": [], "oneDNN": []}
                for _ in range(reps + 1):  # the first round warms up
                    for path in times:
                        times[path].append(one_pass(mats, xs, path))
                med = {path: statistics.median(t[1:]) * 1e3 for path, t in times.items()}
                cells = []
                for other in ("vector", "oneDNN"):
                    ratios = [o / t for o, t in zip(times[other][1:], times["tile"][1:], strict=True)]
                    cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
                print(f"{name} {rows:2d} rows: {med['vector']:7.2f} / {med['tile']:7.2f} / {med['oneDNN']:7.2f} ms  "
                      + "  ".join(cells))


def load(model: str, algorithm: str, amx: str, threads: int):
    from specserve import Engine

    os.environ[small_gemm.AMX_ENV] = amx  # read by the probe while the engine loads
    kw = {}
    if algorithm != "plain":
        kw = {"speculative_algorithm": algorithm, "speculative_draft_model_path": f"{model}-eagle3"}
    return Engine(model_path=model, dtype="bfloat16", num_threads=threads, log_level="warning", **kw)


def end_to_end(configs: list[str], prompts_n: int, new_tokens: int, rounds: int, threads: int) -> None:
    from specserve.bench.eval_acceptance import held_out_prompts_for

    for config in configs:
        model, algorithm, temperature = config.split(":")
        engines = {amx: load(model, algorithm, amx, threads) for amx in ("off", "auto")}
        verdict = engines["auto"].get_server_info().get("cpu_small_gemm")
        prompts = held_out_prompts_for(model, prompts_n)
        params = {"max_new_tokens": new_tokens, "temperature": float(temperature), "ignore_eos": True}
        for e in engines.values():
            e.generate(prompts[0], {**params, "max_new_tokens": 8})  # warm-up
        tokens = {amx: 0 for amx in engines}
        spent = {amx: 0.0 for amx in engines}
        ratios = []
        for r in range(rounds):
            took = {amx: 0.0 for amx in engines}
            for i, prompt in enumerate(prompts):
                order = list(engines) if (i + r) % 2 == 0 else list(reversed(engines))
                for amx in order:
                    start = time.perf_counter()
                    out = engines[amx].generate(prompt, {**params, "seed": i})
                    took[amx] += time.perf_counter() - start
                    tokens[amx] += out["meta_info"]["completion_tokens"]
            for amx in engines:
                spent[amx] += took[amx]
            ratios.append(took["off"] / took["auto"])
        rate = {amx: tokens[amx] / spent[amx] for amx in engines}
        info = {amx: e.get_server_info() for amx, e in engines.items()}
        accept = {amx: f", accept {i['avg_spec_accept_length']:.2f} ({i['spec_plain_steps']} plain steps)"
                  if "avg_spec_accept_length" in i else "" for amx, i in info.items()}
        print(f"{model} {algorithm} temperature {temperature}: off {rate['off']:.1f} tok/s{accept['off']}, "
              f"auto {rate['auto']:.1f} tok/s{accept['auto']}; auto over off {statistics.median(ratios):.2f}x "
              f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}); probe {verdict}")
        for e in engines.values():
            e.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--rows", default="1,2,4,8,12,16,24,32,48,64")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--end-to-end", action="store_true")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not small_gemm.available() or not small_gemm.amx_runs():
        raise SystemExit("the tile unit does not run here (no AMX, no AVX512-BF16 or no C++ compiler)")
    torch.set_num_threads(args.num_threads)
    kernel_passes(args.reps, [int(r) for r in args.rows.split(",")])
    if args.end_to_end:
        end_to_end(args.configs.split(","), args.num_prompts, args.max_new_tokens, args.rounds, args.num_threads)


if __name__ == "__main__":
    main()

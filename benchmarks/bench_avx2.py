"""bf16 linears on a CPU without AVX512, three ways: what each changes, side by side in one run.

Where oneDNN cannot pack bf16 weights (an AVX2-only CPU), a bf16 linear runs on PyTorch's kernel (``pytorch``:
SPECSERVE_CPU_AVX2_GEMM=off), on specserve's AVX2 kernel (``avx2``, the default: ``Avx2Linear``) or on a float32 copy
for calls of several rows (``upcast``: the AVX2 kernel off, SPECSERVE_CPU_UPCAST=auto, ``UpcastLinear``; docs/guide.md,
"CPUs without AVX512"). This builds the engines each way: plain decoding and EAGLE-3 with the model's bundled head
(speculating at every step), in one process. Each round runs every engine in turn over the same greedy prompts, one
request at a time (``--batch 1``) or ``--batch`` at a time, after one uncounted warm-up round; printed per engine:
tokens/s (completion tokens over the round's wall time, prefill included; median over rounds), the ratio over
``pytorch``, round by round, EAGLE-3's accept length, and how many linears took each kernel. Where oneDNN packs this
CPU's bf16 weights neither kernel is used and every setting runs the same.

    python benchmarks/bench_avx2.py --rounds 3 [--model smollm2] [--batch 16] [--settings pytorch,avx2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

from specserve import Engine
from specserve.bench.eval_acceptance import held_out_prompts_for
from specserve.demo_models import SMOLLM2, bundled_drafter, demo_path
from specserve.platform.cpu import avx2_gemm, upcast_probe

MODELS = {"demo": demo_path("demo"), SMOLLM2: SMOLLM2}
# setting -> the variables the engine is loaded with (read while its weights are packed at load)
SETTINGS = {"pytorch": {avx2_gemm.ENV: "off", upcast_probe.ENV: "off"},
            "avx2": {avx2_gemm.ENV: "auto", upcast_probe.ENV: "off"},
            "upcast": {avx2_gemm.ENV: "off", upcast_probe.ENV: "auto"}}
BASE = "pytorch"  # the setting the ratios divide by


def engine(model: str, setting: str, eagle3: bool, threads: int | None) -> Engine:
    """An engine loaded with the variables of ``setting``."""
    kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=bundled_drafter(model),
              disable_speculative_auto_off=True) if eagle3 else {}
    with mock.patch.dict(os.environ, SETTINGS[setting]):  # restored (or removed) once the engine is loaded
        return Engine(model_path=MODELS[model], dtype="bfloat16", num_threads=threads, **kw)


def kernels(info: dict) -> str:
    """How many of an engine's linears took specserve's AVX2 kernel and which got float32 copies (server info)."""
    upcast = info.get("cpu_upcast_linears") or {}
    parts = [f"{info.get('cpu_avx2_gemm_linears', 0)} on the AVX2 kernel"]
    parts += [f"{name} copies from {d['min_rows']} rows" for name, d in upcast.items()]
    return "; ".join(parts)


def run(e: Engine, texts: list[str], batch: int, max_new: int) -> tuple[float, int, int]:
    """-> (seconds, completion tokens, verify steps) of the prompts, `batch` at a time."""
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    start, tokens, verify = time.perf_counter(), 0, 0
    for i in range(0, len(texts), batch):
        for o in e.generate(texts[i:i + batch], params):
            tokens += o["meta_info"]["completion_tokens"]
            verify += o["meta_info"].get("spec_verify_ct", 0)
    return time.perf_counter() - start, tokens, verify


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="demo")
    p.add_argument("--algos", default="plain,eagle3", help="plain and/or eagle3")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--settings", default=",".join(SETTINGS), help="of " + ", ".join(SETTINGS) + f" ({BASE} first)")
    args = p.parse_args(argv)
    algos, settings = args.algos.split(","), args.settings.split(",")
    if set(algos) - {"plain", "eagle3"}:
        p.error(f"--algos: expected plain and/or eagle3, got {args.algos}")
    if set(settings) - set(SETTINGS) or settings[0] != BASE:
        p.error(f"--settings: expected {BASE} then any of {', '.join(SETTINGS)}, got {args.settings}")
    engines = {(algo, s): engine(args.model, s, algo == "eagle3", args.num_threads) for algo in algos
               for s in settings}
    texts = held_out_prompts_for(MODELS[args.model], args.num_prompts)  # held-out code, or SmolLM2's chats
    tps: dict[tuple[str, str], list[float]] = {k: [] for k in engines}
    accept: dict[tuple[str, str], list[float]] = {k: [] for k in engines}
    for rnd in range(args.rounds + 1):
        for key, e in engines.items():
            secs, tokens, verify = run(e, texts, args.batch, args.max_new_tokens)
            if rnd > 0:  # round 0 warms up
                tps[key].append(tokens / secs)
                if verify:
                    accept[key].append(tokens / verify)
    infos = {key: kernels(e.get_server_info()) for key, e in engines.items()}
    for e in engines.values():
        e.shutdown()
    print(f"{args.model} (bf16), {len(texts)} prompts x {args.max_new_tokens} greedy tokens, batch {args.batch}; "
          f"median of {args.rounds} rounds (ratios round by round)")
    print(f"{'algo':>7} {'setting':>8} {'tok/s':>8} {'accept':>7} {'/ ' + BASE + ' (per round)':>30}")
    for (algo, setting), t in tps.items():
        acc = f"{statistics.median(accept[algo, setting]):.2f}" if accept[algo, setting] else "-"
        ratio = "-"
        if setting != BASE:
            per = [a / b for a, b in zip(t, tps[algo, BASE], strict=True)]
            ratio = f"{statistics.median(per):.2f} ({', '.join(f'{r:.2f}' for r in per)})"
        print(f"{algo:>7} {setting:>8} {statistics.median(t):>8.1f} {acc:>7} {ratio:>30}")
    for (algo, setting), info in infos.items():
        if setting != BASE:
            print(f"{algo} {setting}: {info}")


if __name__ == "__main__":
    main()

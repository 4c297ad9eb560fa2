"""Half-precision linears with float32 copies on a CPU without AVX512: what they change, side by side in one run.

Where oneDNN cannot pack bf16 weights (an AVX2-only CPU), each bf16 linear can keep a float32 copy for calls of
several rows (``UpcastLinear``, ``SPECSERVE_CPU_UPCAST``; docs/guide.md, "CPUs without AVX512"). This builds the
same engines with the copies (``auto``: the load-time probe decides from how many rows) and without (``off``):
plain decoding and EAGLE-3 with the model's bundled head (speculating at every step), in one process. Each round
runs every engine in turn over the same greedy prompts, one request at a time (``--batch 1``) or ``--batch`` at a
time, after one uncounted warm-up round; printed per engine: tokens/s (completion tokens over the round's wall time,
prefill included; median over rounds), the ratio with copies over without, round by round, EAGLE-3's accept length,
and the probe's verdict. Where oneDNN packs this CPU's bf16 weights no copy is made and both settings run the same.

    python benchmarks/bench_upcast.py --rounds 3 [--model smollm2] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from specserve import Engine
from specserve.bench.eval_acceptance import held_out_prompts_for
from specserve.demo_models import SMOLLM2, bundled_drafter, demo_path
from specserve.platform.cpu import upcast_probe

MODELS = {"demo": demo_path("demo"), SMOLLM2: SMOLLM2}
SETTINGS = ("off", "auto")  # SPECSERVE_CPU_UPCAST of the engines compared


def engine(model: str, setting: str, eagle3: bool, threads: int | None) -> Engine:
    """An engine loaded with SPECSERVE_CPU_UPCAST=setting (read while its weights are packed at load)."""
    kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=bundled_drafter(model),
              disable_speculative_auto_off=True) if eagle3 else {}
    before = os.environ.get(upcast_probe.ENV)
    os.environ[upcast_probe.ENV] = setting
    try:
        return Engine(model_path=MODELS[model], dtype="bfloat16", num_threads=threads, **kw)
    finally:
        if before is None:
            del os.environ[upcast_probe.ENV]
        else:
            os.environ[upcast_probe.ENV] = before


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
    args = p.parse_args(argv)
    algos = args.algos.split(",")
    if set(algos) - {"plain", "eagle3"}:
        p.error(f"--algos: expected plain and/or eagle3, got {args.algos}")
    engines = {(algo, s): engine(args.model, s, algo == "eagle3", args.num_threads) for algo in algos
               for s in SETTINGS}
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
    verdicts = {key: e.get_server_info().get("cpu_upcast_linears") for key, e in engines.items()}
    for e in engines.values():
        e.shutdown()
    print(f"{args.model} (bf16), {len(texts)} prompts x {args.max_new_tokens} greedy tokens, batch {args.batch}; "
          f"median of {args.rounds} rounds (ratios round by round)")
    print(f"{'algo':>7} {'copies':>7} {'tok/s':>8} {'accept':>7} {'copies / none (per round)':>30}")
    for (algo, setting), t in tps.items():
        acc = f"{statistics.median(accept[algo, setting]):.2f}" if accept[algo, setting] else "-"
        ratio = "-"
        if setting == "auto":
            per = [a / b for a, b in zip(t, tps[algo, "off"], strict=True)]
            ratio = f"{statistics.median(per):.2f} ({', '.join(f'{r:.2f}' for r in per)})"
        print(f"{algo:>7} {setting:>7} {statistics.median(t):>8.1f} {acc:>7} {ratio:>30}")
    for (algo, setting), v in verdicts.items():
        if setting == "auto":
            print(f"{algo}: " + ("no copies (oneDNN packs this CPU's half-precision weights)" if v is None else
                                 "; ".join(f"{name} from {d['min_rows']} rows" for name, d in v.items())))


if __name__ == "__main__":
    main()

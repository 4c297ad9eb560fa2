"""Speculative decoding on tiny models: accept length, tokens/s vs no speculation, and per-step overhead.

For each algorithm, a tiny target and a draft whose acceptance is known to be high are built locally (the test
constructions of ``specserve.test.tiny``: heads that mirror a one-layer target, the target itself as a
STANDALONE draft, a mirroring MiMo MTP layer, n-gram drafting on repetitive prompts). Real acceptance comes with
trained demo models; this script shows that the machinery is correct (greedy ids compared with plain decoding)
and what a speculative step costs on top of a plain one:

- tokens/s: plain vs speculative engine on the same target and prompts, runs alternating (A B A B), ratio =
  median of the per-round ratios, batch 1 and batch 16;
- verify cost: wall time of one TARGET_VERIFY forward over N tree nodes per request vs one plain DECODE forward,
  same batch size (mean per step, from instrumented forwards);
- draft cost: drafting (``propose``) + catching up (``after_verify``) per step vs the verify forward.

    python benchmarks/bench_spec.py [--reps 3] [--decode-tokens 64] [--only EAGLE,NGRAM]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from bench_core import measure_pair
from specserve.bench.harness import StepClock, flush_prefix_cache
from specserve.speculative.accept_stats import accept_length
from specserve.test.tiny import (
    build_tokenizer,
    make_eagle3_head_dir,
    make_eagle_head_dir,
    make_mimo_dir,
    make_model_dir,
)

CODE_PROMPTS = [
    "def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):",
    "The quick brown fox", "for i in range(10):\n    print(i)\n", "x = 1", "while True:\n    line = input()\n",
    "# heaps, bisection, fractions and statistics",
]
REPETITIVE = [
    "def f(x):\n    return x\ndef f(x):\n    return x\ndef f(", "a b c d e f a b c d e f a b c",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(", "x = 1\ny = 2\nx = 1\ny = 2\nx =",
]
TREE = {"speculative_num_steps": 4, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 5}


def build_setups(work: str) -> dict[str, tuple[str, dict, list[str]]]:
    """algorithm -> (target folder, engine kwargs, prompts)."""
    tok = os.path.join(work, "tokenizer")
    if not os.path.isdir(tok):
        build_tokenizer(tok)

    def model(name: str, **kw) -> str:
        path = os.path.join(work, name)
        return path if os.path.isdir(path) else make_model_dir(path, "llama", tokenizer_dir=tok, **kw)

    one = model("one-layer", num_hidden_layers=1, unit_embeddings=True)
    bigram = model("bigram", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)
    two = model("two-layer")
    mimo = os.path.join(work, "mimo")
    if not os.path.isdir(mimo):
        make_mimo_dir(mimo, kind="self", tokenizer_dir=tok)
    eagle = os.path.join(work, "eagle-self")
    if not os.path.isdir(eagle):
        make_eagle_head_dir(eagle, one, kind="self")
    eagle3 = os.path.join(work, "eagle3-self")
    if not os.path.isdir(eagle3):
        make_eagle3_head_dir(eagle3, bigram, kind="self")
    return {
        "EAGLE": (one, dict(speculative_algorithm="EAGLE", speculative_draft_model_path=eagle, **TREE), CODE_PROMPTS),
        "EAGLE3": (bigram, dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle3, **TREE),
                   CODE_PROMPTS),
        "STANDALONE": (two, dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=two, **TREE),
                       CODE_PROMPTS),
        "MTP": (mimo, dict(speculative_algorithm="EAGLE", **TREE), CODE_PROMPTS),
        "NGRAM": (two, dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8), REPETITIVE),
    }


def bench_algorithm(name: str, target: str, kw: dict, prompts: list[str], batch: int, args) -> dict:
    from specserve import Engine

    prompts = (prompts * (batch // len(prompts) + 1))[:batch]
    params = {"temperature": 0, "max_new_tokens": args.decode_tokens, "ignore_eos": True}
    common = dict(max_total_tokens=8192, log_level="warning", num_threads=args.threads)
    kw = {**kw, "disable_speculative_auto_off": True}  # the machinery's own cost: speculate on every step
    with Engine(model_path=target, **common) as plain, Engine(model_path=target, **common, **kw) as spec:
        clocks = StepClock(plain), StepClock(spec)
        state = {}

        def run(engine, key):
            def go():
                outs = engine.generate(prompts, params)
                state[key] = outs
                return [o["output_ids"] for o in outs], sum(o["meta_info"]["completion_tokens"] for o in outs)
            return go

        def setup():
            flush_prefix_cache(plain)
            flush_prefix_cache(spec)

        a, b, ratios = measure_pair(run(spec, "spec"), run(plain, "plain"), args.reps, f"{name} b{batch}", setup)
        outs = state["spec"]
        verify_ct = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
        row = {
            "algorithm": name, "batch": batch, "plain_tok_s": b.tokens_per_s, "spec_tok_s": a.tokens_per_s,
            "speedup": statistics.median(ratios), "accept_length": accept_length(
                [o["meta_info"] for o in outs]) if verify_ct else 0.0,
            "greedy_ids_equal": [o["output_ids"] for o in outs] == [o["output_ids"] for o in state["plain"]],
            "decode_ms": clocks[0].mean_ms("decode"), "verify_ms": clocks[1].mean_ms("target_verify"),
            "draft_ms": clocks[1].mean_ms("propose") + clocks[1].mean_ms("after_verify"),
        }
        row["verify_over_decode"] = row["verify_ms"] / row["decode_ms"]
        row["draft_over_verify"] = row["draft_ms"] / row["verify_ms"]
        return row


def format_table(rows: list[dict]) -> str:
    head = ("| algorithm | batch | accept len | plain tok/s | spec tok/s | speed-up | verify/decode forward | "
            "draft/verify | greedy ids equal |\n|---|---:|---:|---:|---:|---:|---:|---:|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['batch']} | {r['accept_length']:.2f} | {r['plain_tok_s']:.0f} | "
            f"{r['spec_tok_s']:.0f} | {r['speedup']:.2f}x | {r['verify_ms']:.2f} / {r['decode_ms']:.2f} ms = "
            f"{r['verify_over_decode']:.2f}x | {r['draft_ms']:.2f} / {r['verify_ms']:.2f} ms = "
            f"{r['draft_over_verify']:.2f}x | {r['greedy_ids_equal']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_spec.py", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="timed rounds per measurement (median ratio reported)")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--only", default=None, help="comma-separated algorithms (default: all)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work-dir", default="bench_out/spec_models", help="where the tiny models are cached")
    p.add_argument("--out", default="bench_out/bench_spec.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.work_dir, exist_ok=True)
    setups = build_setups(args.work_dir)
    names = args.only.split(",") if args.only else list(setups)
    rows = [bench_algorithm(n, *setups[n], int(b), args) for n in names for b in args.batches.split(",")]
    print(format_table(rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()

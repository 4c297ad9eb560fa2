"""EAGLE-3 heads and draft trees side by side: plain decoding and one engine per (head, tree), all loaded in one
process, every prompt through each engine in turn, rounds in alternating order; tokens/s, the ratio over plain decoding
per round, accept lengths and how many outputs equal plain decoding's.

    python benchmarks/bench_heads.py --model-path smollm2 \
        --configs "bundled=smollm2-eagle3:3,4,6;mine=/path/to/head:3,4,6;mine-446=/path/to/head:4,4,6"

A config is NAME=HEAD:STEPS,TOPK,DRAFT_TOKENS (HEAD: a folder or a bundled head's name); plain decoding always runs
first, as the baseline.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specserve import Engine
from specserve.bench.bench_compare import held_out_inputs, parse_tree, resolve_path, tree_kv_margin
from specserve.bench.bench_ngram import ours_prepare, ours_runner, run_set


def parse_configs(text: str) -> dict[str, tuple[str, tuple[int, int, int]]]:
    """"a=HEAD:3,4,6;b=HEAD:4,4,6" -> {name: (head, (steps, topk, draft tokens))}."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, _, spec = item.partition("=")
        head, _, tree = spec.rpartition(":")
        if not name or not head or name == "plain":
            raise SystemExit(f"--configs: {item!r} is not NAME=HEAD:STEPS,TOPK,DRAFT_TOKENS (NAME not 'plain')")
        try:
            out[name] = (head, parse_tree(tree))
        except ValueError:
            raise SystemExit(f"--configs: {item!r}: the tree is not STEPS,TOPK,DRAFT_TOKENS (three integers)") from None
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--configs", required=True, help="NAME=HEAD:STEPS,TOPK,DRAFT_TOKENS, separated by ';'")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=8, help="the first N held-out requests")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--always-speculate", action="store_true", help="speculate at every step (the batch-aware policy "
                   "off); by default the engines run as served")
    a = p.parse_args(argv)
    configs = parse_configs(a.configs)
    torch.set_num_threads(a.num_threads)
    target = resolve_path(a.model_path)
    prompts, warmup = held_out_inputs(a.model_path, a.num_prompts)
    kv = (max(len(x) for x in [*prompts, warmup]) + a.max_new_tokens
          + max(tree_kv_margin(tree) for _, tree in configs.values()))  # one request, the largest tree's scratch
    engines, runners, prepare = [], {}, {}
    try:
        for name, spec in [("plain", None), *configs.items()]:
            kw = {}
            if spec is not None:
                head, (steps, topk, tokens) = spec
                kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=resolve_path(head),
                          speculative_num_steps=steps, speculative_eagle_topk=topk,
                          speculative_num_draft_tokens=tokens, disable_speculative_auto_off=a.always_speculate)
            engine = Engine(model_path=target, dtype=a.dtype, num_threads=a.num_threads, max_total_tokens=kv,
                            log_level="warning", **kw)
            engines.append(engine)
            runners[name], prepare[name] = ours_runner(engine, a.max_new_tokens, a.temperature), ours_prepare(engine)
        tps: dict[str, list[float]] = {n: [] for n in runners}
        accept: dict[str, list[float]] = {n: [] for n in runners}
        outputs: dict[str, list[list[int]]] = {}
        for r in range(a.rounds):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            tallies = run_set({n: runners[n] for n in order}, prompts, warmup, prepare)
            for n, t in tallies.items():
                tps[n].append(t.tokens_per_s)
                accept[n].append(t.accept_length)
                outputs.setdefault(n, t.outputs)
            print(f"round {r + 1}: " + ", ".join(f"{n} {tallies[n].tokens_per_s:.1f} tok/s" for n in runners),
                  flush=True)
    finally:
        for engine in engines:
            engine.shutdown()
    print(f"{a.model_path}, {a.dtype}, {a.num_threads} threads, {len(prompts)} prompts x {a.max_new_tokens} tokens, "
          f"temperature {a.temperature}, {a.rounds} rounds")
    print(f"plain: {statistics.median(tps['plain']):.1f} tok/s")
    for n, (head, tree) in configs.items():
        ratios = [x / y for x, y in zip(tps[n], tps["plain"], strict=True)]
        equal = sum(o == b for o, b in zip(outputs[n], outputs["plain"], strict=True))
        print(f"{n} ({head}, {','.join(map(str, tree))}): {statistics.median(tps[n]):.1f} tok/s, over plain "
              f"{statistics.median(ratios):.3f} (rounds {', '.join(f'{x:.2f}' for x in ratios)}), accept length "
              f"{statistics.mean(accept[n]):.2f}, outputs equal to plain {equal}/{len(prompts)}")


if __name__ == "__main__":
    main()

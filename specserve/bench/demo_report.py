"""The demo family's acceptance table (the one in docs/benchmarks.md): ``specserve eval-acceptance`` for every algorithm
on the bundled models, in one run, as a markdown table.

    python -m specserve.bench.demo_report [--num-prompts 8] [--max-new-tokens 64] [--dtype auto] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys

from specserve.demo_models import TOKEN_MAP

# (row name, target, speculative flags, temperature)
CONFIGS = [
    ("EAGLE-3", "demo", ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "demo-eagle3"], 0.0),
    ("EAGLE-2", "demo", ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "demo-eagle"], 0.0),
    ("EAGLE-2 + FR-Spec", "demo", ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                                   "demo-eagle", "--speculative-token-map", TOKEN_MAP], 0.0),
    ("STANDALONE", "demo", ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                            "demo-draft"], 0.0),
    ("MTP (1 step)", "demo-mtp", ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1",
                                  "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"], 0.0),
    ("NGRAM", "demo", ["--speculative-algorithm", "NGRAM"], 0.0),
    ("EAGLE-3 (temperature 1)", "demo", ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                        "demo-eagle3"], 1.0),
]


def markdown(rows: list[tuple[str, dict]]) -> str:
    """rows of (name, eval-acceptance summary) -> a markdown table."""
    out = ["| algorithm | tree (steps/topk/tokens) | accept length | accept rate by position | plain tok/s | "
           "spec tok/s | speed-up | greedy equal |", "|---|---|---|---|---|---|---|---|"]
    for name, s in rows:
        tree = "-" if s["num_steps"] is None else f"{s['num_steps']}/{s['eagle_topk']}/{s['num_draft_tokens']}"
        rates = " ".join(f"{r:.2f}" for r in s["accept_rate_per_position"])
        match = "n/a" if s["greedy_match"] is None else f"{s['greedy_match']}/{s['num_prompts']}"
        out.append(f"| {name} | {tree} | {s['accept_length']:.2f} | {rates} | {s['plain_tokens_per_s']:.0f} | "
                   f"{s['spec_tokens_per_s']:.0f} | {s['speedup']:.2f}x | {match} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from specserve.args import server_args_from
    from specserve.bench.eval_acceptance import check_args, evaluate, parse_args

    p = argparse.ArgumentParser(prog="python -m specserve.bench.demo_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--only", default=None,
                   help="comma-separated row names to run (default: all), e.g. 'EAGLE-3 (temperature 1)'")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    rows = []
    for name, model, flags, temperature in CONFIGS:
        if ns.only and name not in ns.only.split(","):
            continue
        argv_eval = ["--model-path", model, *flags, "--prompts", "held-out", "--num-prompts", str(ns.num_prompts),
                     "--max-new-tokens", str(ns.max_new_tokens), "--temperature", str(temperature),
                     "--dtype", ns.dtype]
        if ns.num_threads:
            argv_eval += ["--num-threads", str(ns.num_threads)]
        ens = parse_args(argv_eval)
        args = server_args_from(ens)
        check_args(ens, args)
        summary = evaluate(ens, args)
        print(f"{name}: accept length {summary['accept_length']:.2f}, speed-up {summary['speedup']:.2f}x",
              file=sys.stderr)
        rows.append((name, summary))
    print(markdown(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump([{"name": n, **s} for n, s in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

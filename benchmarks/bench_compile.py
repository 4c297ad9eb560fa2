"""torch.compile vs eager on the same model and prompts, side by side in one run (``--enable-torch-compile``).

Two engines per configuration (eager and compiled) are loaded in this process and warmed up (the compiled one
builds its graphs then: the compile time is reported separately); then every prompt runs on each engine in turn
(A B A B), batch 1, greedy, fixed token counts. Reported: tokens/s of each, the ratio, greedy equality of the
compiled outputs with the eager ones, and the graphs / seconds torch.compile took.

``--background``: the compiled engine builds its graphs on a background thread (``--torch-compile-in-background``):
it takes requests at once, and the prompts run through it untimed, eager until their graphs are built, until a
pass builds no new graph; reported besides: seconds from its start to ready and to its graphs built, and its
tokens/s over those untimed passes (decoding while the graphs are built or a child process fills the cache, the
waits between passes left out).

    python benchmarks/bench_compile.py [--model-path demo] [--configs plain,eagle3] [--dtype float32] [--background]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from specserve.bench.bench_ngram import equal_count, ours_prepare, ours_runner, run_set
from specserve.bench.report import format_table

CONFIGS = {"plain": {}, "eagle3": {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "demo-eagle3"}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_compile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="demo")
    p.add_argument("--eagle3-path", default="demo-eagle3", help="EAGLE-3 head of the eagle3 configuration")
    p.add_argument("--configs", default="plain,eagle3", help="comma list of: plain, eagle3")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--background", action="store_true",
                   help="the compiled engine builds its graphs while it serves (--torch-compile-in-background)")
    a = p.parse_args(argv)
    bad = [c for c in a.configs.split(",") if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {', '.join(bad)} (choose from {', '.join(CONFIGS)})")
    return a


def bench_config(name: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from specserve import Engine

    kw = dict(CONFIGS[name])
    if "speculative_draft_model_path" in kw:
        kw["speculative_draft_model_path"] = args.eagle3_path
    common = dict(model_path=args.model_path, dtype=args.dtype, num_threads=args.num_threads, log_level="warning",
                  max_total_tokens=4096, **kw)
    eager = Engine(**common)
    start = time.perf_counter()
    compiled = Engine(**common, enable_torch_compile=True, torch_compile_in_background=args.background)
    ready_s = time.perf_counter() - start
    try:
        n = args.max_new_tokens
        runners = {"eager": ours_runner(eager, n), "compiled": ours_runner(compiled, n)}
        prepare = {"eager": ours_prepare(eager), "compiled": ours_prepare(compiled)}
        building = build_graphs(compiled, runners["compiled"], prompts) if args.background else None
        built_s = time.perf_counter() - start
        for p in prompts[:2]:  # compile the shapes of a run (first static, then dynamic) before timing
            runners["compiled"](p)
        tallies = run_set(runners, prompts, prompts[0], prepare, desc=name)
        info = compiled.get_server_info()
    finally:
        eager.shutdown()
        compiled.shutdown()
    e, c = tallies["eager"], tallies["compiled"]
    return {"config": name, "eager_tok_s": e.tokens_per_s, "compiled_tok_s": c.tokens_per_s,
            "ratio": c.tokens_per_s / e.tokens_per_s if e.tokens_per_s else float("nan"),
            "equal": f"{equal_count(c.outputs, e.outputs)}/{len(prompts)}",
            "compile_graphs": info["torch_compile_graphs"], "compile_s": info["torch_compile_seconds"],
            "ready_s": ready_s, "built_s": built_s, "building_tok_s": building}


def build_graphs(engine, run, prompts: list[list[int]]) -> float:
    """--background: every prompt through `run` (untimed) until a pass builds no new graph
    (``harness.build_background_graphs``). -> tokens/s over those passes (decoding while the graphs are built or a
    child process fills the cache; the waits for them between passes left out)."""
    from specserve.bench.harness import build_background_graphs

    tokens, seconds = 0, 0.0

    def run_pass() -> None:
        nonlocal tokens, seconds
        start = time.perf_counter()
        for p in prompts:
            tokens += len(run(p)[0])
        seconds += time.perf_counter() - start

    build_background_graphs(engine, run_pass)
    return tokens / seconds


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from transformers import AutoTokenizer

    from specserve.bench.bench_compare import resolve_path
    from specserve.bench.eval_acceptance import held_out_prompts_for

    texts = held_out_prompts_for(args.model_path, args.num_prompts)  # SmolLM2's chat requests or held-out code
    args.model_path, args.eagle3_path = resolve_path(args.model_path), resolve_path(args.eagle3_path)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    prompts = [tok.encode(p) for p in texts]
    rows = [bench_config(name, args, prompts) for name in args.configs.split(",")]
    print(format_table(rows, [("config", "config", None), ("eager_tok_s", "eager tok/s", ".1f"),
                              ("compiled_tok_s", "compiled tok/s", ".1f"), ("ratio", "compiled / eager", ".2f"),
                              ("equal", "greedy equal", None), ("compile_graphs", "graphs", None),
                              ("compile_s", "compile s", ".1f"), ("ready_s", "ready s", ".1f"),
                              ("built_s", "graphs built s", ".1f"), ("building_tok_s", "tok/s while building", ".1f")]))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

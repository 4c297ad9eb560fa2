"""Tensor parallelism on this machine: tokens/s of one engine, and what its collectives cost a forward.

One in-process engine per run (``--tp-size``; torch.distributed holds one tensor-parallel group per process, and a
second engine in the same process would share its cores and OpenMP pools with the measured one), plain or, with
``--eagle3``, EAGLE-3 with the model's bundled head. It generates the same greedy requests ``--rounds`` times after
one uncounted warm-up round, ``--batch`` at a time, and prints tokens/s (median over rounds) and, from the server
info's counters over the counted rounds, per forward of the target (prefill chunks, decode and verify steps): the
all-reduces, their wall time, the gathers of the logits, the messages to the followers (a drafter's calls of the
target's embedding or LM head included), and their share of the wall time. Compare ``--tp-size 1`` and ``2`` by
alternating runs (on a shared machine, several of each); ``--print-ids`` prints the outputs for an equality check.

    python benchmarks/bench_tp.py --tp-size 2 --rounds 3 [--eagle3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from specserve import Engine
from specserve.demo_models import SMOLLM2, bundled_drafter, demo_path

MODELS = {"demo": dict(model_path=demo_path("demo"), dtype="bfloat16"),
          SMOLLM2: dict(model_path=SMOLLM2, dtype="bfloat16")}
PROMPTS = ["Explain what a hash map is.", "Write a haiku about the sea.", "List three uses of copper.",
           "def quicksort(xs):"]
COUNTERS = ("tp_all_reduces", "tp_all_reduce_seconds", "tp_gathers", "tp_gather_seconds", "tp_messages",
            "tp_message_seconds")


def engine(model: str, tp: int, eagle3: bool, load_format: str = "auto") -> Engine:
    target = MODELS.get(model, dict(model_path=model, load_format=load_format))
    kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=bundled_drafter(model),
              disable_speculative_auto_off=True) if eagle3 else {}
    return Engine(tp_size=tp, **target, **kw)


def forwards(info: dict) -> int:
    """Target forwards so far: prefill steps plus decode / verify steps."""
    return info["num_prefill_steps"] + info["num_decode_steps"]


def run(e: Engine, batch: int, max_new: int) -> tuple[float, int, list]:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    start, outs = time.perf_counter(), []
    for i in range(0, len(PROMPTS), batch):
        outs += e.generate(PROMPTS[i:i + batch], params)
    return time.perf_counter() - start, sum(o["meta_info"]["completion_tokens"] for o in outs), \
        [o["output_ids"] for o in outs]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help="demo (bf16; the default), smollm2 (bf16: its 9 heads do not split "
                   "over 2 ranks) or an HF folder")
    p.add_argument("--load-format", default="auto", help="dummy: random weights from an HF folder's config.json "
                   "(a larger model's shapes; each rank draws its own shard)")
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--eagle3", action="store_true", help="EAGLE-3 with the model's bundled head instead of plain")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--print-ids", action="store_true")
    args = p.parse_args(argv)
    e = engine(args.model, args.tp_size, args.eagle3, args.load_format)
    tps, wall = [], 0.0
    run(e, args.batch, args.max_new_tokens)  # warm-up
    before = e.get_server_info()
    for _ in range(args.rounds):
        secs, toks, ids = run(e, args.batch, args.max_new_tokens)
        tps.append(toks / secs)
        wall += secs
    after = e.get_server_info()
    e.shutdown()
    n = forwards(after) - forwards(before)
    algo = "eagle3" if args.eagle3 else "plain"
    print(f"{args.model} {algo}, tp {args.tp_size}, batch {args.batch}, {len(PROMPTS)} prompts x {args.max_new_tokens} "
          f"tokens, greedy; median of {args.rounds} rounds")
    print(f"tok/s {statistics.median(tps):.1f} (rounds {', '.join(f'{t:.1f}' for t in tps)}); {n} target forwards")
    if args.tp_size > 1:
        d = {c: after[c] - before[c] for c in COUNTERS}
        comm = d["tp_all_reduce_seconds"] + d["tp_gather_seconds"] + d["tp_message_seconds"]
        print(f"per forward: {d['tp_all_reduces'] / n:.1f} all-reduces, {1e3 * d['tp_all_reduce_seconds'] / n:.2f} ms; "
              f"{d['tp_gathers'] / n:.1f} gathers, {1e3 * d['tp_gather_seconds'] / n:.2f} ms; "
              f"{d['tp_messages'] / n:.1f} messages, {1e3 * d['tp_message_seconds'] / n:.2f} ms; "
              f"share of the wall time {comm / wall:.2f}")
    if args.print_ids:
        print("ids", ids)


if __name__ == "__main__":
    main()

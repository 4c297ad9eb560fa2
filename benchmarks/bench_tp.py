"""Tensor parallelism on this machine: what the collectives cost a decode step and a verify step.

In-process engines on the same model: one process (``--tp-size 1``, all the CPUs) and ``--tp-size 2`` (each rank
pinned to half of them), plain and, with ``--eagle3``, EAGLE-3. Every round generates the same greedy requests on
each engine in turn (after one uncounted warm-up round), one request at a time (``--batch 1``) or all at once. Per
engine: tokens/s (median over rounds, ratios round by round), and from the server info's counters over the counted
rounds, per forward of the target (prefill chunks, decode and verify steps): all-reduces, their wall time, the
gathers of the logits, the broadcasts of each batch to the followers (a drafter's calls of the target's embedding or
LM head included), and their share of the wall time. Outputs
are checked equal across engines (greedy; float32 keeps them exact, bf16 may differ at near ties).

The one-process engine is built first, before rank 0 pins this process's thread to its share of the CPUs, so it
keeps them all.

    python benchmarks/bench_tp.py --model smollm2 --rounds 3 --eagle3
"""

from __future__ import annotations

import argparse
import statistics
import time

from specserve import Engine
from specserve.demo_models import SMOLLM2, bundled_eagle3, demo_path

MODELS = {"demo": dict(model_path=demo_path("demo"), dtype="bfloat16"),
          SMOLLM2: dict(model_path=SMOLLM2, dtype="bfloat16")}
PROMPTS = ["Explain what a hash map is.", "Write a haiku about the sea.", "List three uses of copper.",
           "def quicksort(xs):"]
COUNTERS = ("tp_all_reduces", "tp_all_reduce_seconds", "tp_gathers", "tp_gather_seconds", "tp_messages",
            "tp_message_seconds")


def engines(model: str, eagle3: bool) -> dict[tuple[int, str], Engine]:
    target = MODELS.get(model, dict(model_path=model))
    algos = {"plain": {}}
    if eagle3:
        algos["eagle3"] = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=bundled_eagle3(model),
                               disable_speculative_auto_off=True)
    return {(tp, name): Engine(tp_size=tp, **target, **kw) for tp in (1, 2) for name, kw in algos.items()}


def forwards(info: dict) -> int:
    """Target forwards so far: prefill steps plus decode / verify steps."""
    return info["num_prefill_steps"] + info["num_decode_steps"]


def run(engine: Engine, batch: int, max_new: int) -> tuple[float, int, list]:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    start, outs = time.perf_counter(), []
    for i in range(0, len(PROMPTS), batch):
        outs += engine.generate(PROMPTS[i:i + batch], params)
    return time.perf_counter() - start, sum(o["meta_info"]["completion_tokens"] for o in outs), \
        [o["output_ids"] for o in outs]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=SMOLLM2, help="smollm2 (bf16), demo (bf16) or an HF folder")
    p.add_argument("--eagle3", action="store_true", help="also EAGLE-3 with the model's bundled head")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    eng = engines(args.model, args.eagle3)
    tps: dict = {k: [] for k in eng}
    wall = dict.fromkeys(eng, 0.0)  # seconds of the counted rounds
    before, after, ids = {}, {}, {}
    for rnd in range(args.rounds + 1):
        for key, e in eng.items():
            if rnd == 1:
                before[key] = e.get_server_info()
            secs, toks, ids[key] = run(e, args.batch, args.max_new_tokens)
            if rnd:
                tps[key].append(toks / secs)
                wall[key] += secs
    for key, e in eng.items():
        after[key] = e.get_server_info()
        e.shutdown()
    base = tps[1, "plain"]
    print(f"{args.model}, batch {args.batch}, {len(PROMPTS)} prompts x {args.max_new_tokens} tokens, greedy; median of "
          f"{args.rounds} rounds")
    print(f"{'tp':>3} {'algo':>7} {'tok/s':>7} {'vs tp1 plain':>13} {'same ids':>9} {'forwards':>9} "
          f"{'reduce/fwd':>11} {'reduce ms/fwd':>14} {'gather ms/fwd':>14} {'bcast ms/fwd':>13} {'comm share':>11}")
    for key in eng:
        tp, algo = key
        a, b = after[key], before[key]
        n = forwards(a) - forwards(b)
        ratio = statistics.median(x / y for x, y in zip(tps[key], base, strict=True))
        same = str(ids[key] == ids[1, algo])
        row = f"{tp:>3} {algo:>7} {statistics.median(tps[key]):>7.1f} {ratio:>13.2f} {same:>9} {n:>9}"
        if tp > 1:
            d = {c: a[c] - b[c] for c in COUNTERS}
            comm = d["tp_all_reduce_seconds"] + d["tp_gather_seconds"] + d["tp_message_seconds"]
            row += (f" {d['tp_all_reduces'] / n:>11.1f} {1e3 * d['tp_all_reduce_seconds'] / n:>14.2f} "
                    f"{1e3 * d['tp_gather_seconds'] / n:>14.2f} {1e3 * d['tp_message_seconds'] / n:>13.2f} "
                    f"{comm / wall[key]:>11.2f}")
        print(row)


if __name__ == "__main__":
    main()

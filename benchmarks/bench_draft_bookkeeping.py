"""An EAGLE-2 draft's candidate bookkeeping on CPU, per draft: ``EagleCandidates`` on numpy views (its CPU path)
against the same class on torch ops, interleaved round by round, and the two trees checked equal.

One draft = the root's top-K, then per further level the stop test and the expansion of K x K children, then the
rerank into a tree of N nodes (the drafter's calls, without the draft network). Random probabilities with ties.

Printed: one row per (batch, tree), microseconds per draft as numpy / torch (median of 5 batches of calls) for
each round, and the ratio of the medians.

    python benchmarks/bench_draft_bookkeeping.py
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from bench_ops import per_call_us
from specserve.speculative.tree import EagleCandidates


def draft(inputs: dict, host: bool):
    """One draft's bookkeeping over ``inputs`` (``make_inputs``) -> its DraftTree."""
    cands = EagleCandidates(inputs["root_p"], inputs["root_ids"], host=host)
    for probs, ids in inputs["levels"]:
        cands.can_stop(inputs["n"] - 1)
        cands.add_level(probs, ids)
    return cands.select(inputs["roots"], inputs["n"], distinct=True)


def make_inputs(batch: int, steps: int, topk: int, n: int, gen: torch.Generator) -> dict:
    """Draft-like inputs: probabilities from a few dyadic values (ties), distinct children per branch."""
    values = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def probs(*shape):
        return values[torch.randint(0, len(values), (batch, *shape), generator=gen)].sort(-1, descending=True)[0]

    def ids(*shape):
        return torch.rand(batch, *shape[:-1], 4096, generator=gen).topk(shape[-1], dim=-1).indices

    return {"root_p": probs(topk), "root_ids": ids(topk), "roots": torch.arange(batch),
            "levels": [(probs(topk, topk), ids(topk, topk)) for _ in range(steps - 1)], "n": n}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--trees", default="8,3,12;5,4,8;3,1,4", help="steps,topk,num_draft_tokens; ...")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=300, help="drafts per timed batch of calls")
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in map(int, args.batches.split(",")):
        for tree in args.trees.split(";"):
            steps, topk, n = map(int, tree.split(","))
            inputs = make_inputs(batch, steps, topk, n, gen)
            host_tree, torch_tree = draft(inputs, True), draft(inputs, False)
            for field in ("tokens", "parents", "depth", "mask", "num_nodes"):
                assert torch.equal(getattr(host_tree, field), getattr(torch_tree, field)), field
            on_host, on_torch = functools.partial(draft, inputs, True), functools.partial(draft, inputs, False)
            rounds = [(per_call_us(on_host, args.calls), per_call_us(on_torch, args.calls))
                      for _ in range(args.rounds)]
            ratio = statistics.median(h for h, _ in rounds) / statistics.median(t for _, t in rounds)
            rows.append({"batch": batch, "tree": (steps, topk, n), "rounds": rounds, "ratio": ratio})
            print(f"batch {batch:>3} tree {steps}/{topk}/{n:<3} | "
                  + " | ".join(f"{h:.0f} / {t:.0f}" for h, t in rounds) + f" | numpy / torch {ratio:.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()

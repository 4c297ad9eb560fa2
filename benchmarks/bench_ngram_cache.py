"""Per-call cost of the NGRAM draft cache (``specserve.speculative.ngram_cache``) at realistic sizes, CPU only.

Synthetic text: token ids from a Zipf-like distribution over ``--vocab`` ids; a prompt is fresh runs of
tokens, half of them followed by a copy of an earlier span of the same prompt. The cache is first filled to
``--capacity`` nodes with such prompts, so every later insert also pays for evictions. Then, for each
scenario (see ``SCENARIOS``), a batch of ``--batch`` new prompts is inserted and ``--steps`` decode steps
are timed: each request appends k tokens (fresh, or continuing a copy of its own earlier text) and calls
``insert(seq, num_new=k)`` (what a request does after a verify), then the batch calls ``batch_match``.
Reported: microseconds per call and per batch step (median of ``--reps`` rounds), the prompt insert cost,
the mean draft size, and the Python heap bytes per trie node (tracemalloc, separate fill).

    python benchmarks/bench_ngram_cache.py
    python benchmarks/bench_ngram_cache.py --capacity 1000000 --match-type PROB
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

from specserve.speculative.ngram_cache import NgramCache


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_ngram_cache.py", description=__doc__.split("\n")[0])
    p.add_argument("--capacity", type=int, default=300_000, help="trie nodes (filled before timing)")
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200, help="decode steps per timed round")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--branch-length", type=int, default=18)
    p.add_argument("--max-window", type=int, default=12)
    p.add_argument("--num-draft-tokens", type=int, default=12, help="N; the tree gets N - 1 nodes")
    p.add_argument("--match-type", choices=("BFS", "PROB", "both"), default="both")
    p.add_argument("--memory-nodes", type=int, default=50_000, help="trie size of the memory measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this process's CPU time (steadier than wall time on a shared machine)")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    return p.parse_args(argv)


# scenario -> (tokens appended per request per step, fraction of steps whose tokens are copied from the
# request's own text rather than fresh)
SCENARIOS = {
    "open-ended (1 fresh token/step)": (1, 0.0),
    "mixed (3 tokens/step, half copied)": (3, 0.5),
    "repetitive (4 copied tokens/step)": (4, 1.0),  # code editing: the output repeats the prompt
}


class TextSource:
    """Zipf-like tokens with copied spans, so the trie sees realistic repetition."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.cum_weights = list(itertools.accumulate(1.0 / (r + 1) for r in range(vocab)))
        self.ids = list(range(vocab))

    def fresh(self, n: int) -> list[int]:
        return self.rng.choices(self.ids, cum_weights=self.cum_weights, k=n)

    def prompt(self, n: int) -> list[int]:
        """``n`` tokens: fresh runs of 4-16 tokens, half of them followed by a copy of 8-32 earlier tokens."""
        out: list[int] = []
        while len(out) < n:
            out.extend(self.fresh(self.rng.randint(4, 16)))
            if len(out) > 64 and self.rng.random() < 0.5:
                start = self.rng.randrange(len(out) - 32)
                out.extend(out[start : start + self.rng.randint(8, 32)])
        return out[:n]

    def step(self, seq: list[int], k: int, copy_frac: float, cursor: int) -> tuple[list[int], int]:
        """``k`` next tokens and the new copy cursor: with probability ``copy_frac`` a copy of ``seq`` that
        continues at ``cursor`` (restarting at a random position one time in 8, or when -1), else fresh."""
        if self.rng.random() >= copy_frac:
            return self.fresh(k), -1
        if cursor < 0 or cursor + k >= len(seq) or self.rng.random() < 1 / 8:
            cursor = self.rng.randrange(len(seq) - k)
        return seq[cursor : cursor + k], cursor + k


def time_steps(cache: NgramCache, src: TextSource, seqs: list[list[int]], steps: int, k: int, copy_frac: float,
               now: Callable[[], float]) -> dict:
    ins = mat = 0.0
    drafted = 0
    cursors = [-1] * len(seqs)
    for _ in range(steps):
        for i, s in enumerate(seqs):
            new, cursors[i] = src.step(s, k, copy_frac, cursors[i])
            s.extend(new)
        t0 = now()
        for s in seqs:
            cache.insert(s, num_new=k)
        t1 = now()
        trees = cache.batch_match(seqs)
        t2 = now()
        ins += t1 - t0
        mat += t2 - t1
        drafted += sum(len(tokens) for tokens, _ in trees)
    calls = steps * len(seqs)
    return {
        "insert_step_us": ins * 1e6 / calls,
        "match_us": mat * 1e6 / calls,
        "batch_step_us": (ins + mat) * 1e6 / steps,
        "mean_draft_nodes": drafted / calls,
    }


def clock(args: argparse.Namespace) -> Callable[[], float]:
    return time.process_time if args.clock == "cpu" else time.perf_counter


def filled_cache(args: argparse.Namespace, src: TextSource, match_type: str) -> tuple[NgramCache, float]:
    """A cache filled to capacity with prompts; also returns the median us of the last prompt inserts."""
    now = clock(args)
    cache = NgramCache(
        capacity=args.capacity, branch_length=args.branch_length, max_window=args.max_window,
        match_type=match_type, max_draft_nodes=args.num_draft_tokens - 1,
    )
    prompt_us = []
    while cache.num_nodes < args.capacity or len(prompt_us) < 20:  # the last prompts already evict
        prompt = src.prompt(args.prompt_len)
        t0 = now()
        cache.insert(prompt)
        prompt_us.append((now() - t0) * 1e6)
    return cache, statistics.median(prompt_us[-20:])


def bytes_per_node(args: argparse.Namespace) -> float:
    """Python heap bytes per trie node (tracemalloc over a fill to ``--memory-nodes`` nodes)."""
    nodes = args.memory_nodes
    src = TextSource(args.vocab, args.seed + 1)
    tracemalloc.start()
    cache = NgramCache(capacity=nodes, branch_length=args.branch_length, max_window=args.max_window)
    while cache.num_nodes < nodes:
        cache.insert(src.prompt(args.prompt_len))
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return used / cache.num_nodes


def bench_one(args: argparse.Namespace, match_type: str) -> dict:
    src = TextSource(args.vocab, args.seed)
    cache, prompt_us = filled_cache(args, src, match_type)
    result = {"match_type": match_type, "insert_prompt_us": prompt_us, "nodes": cache.num_nodes}
    for name, (k, copy_frac) in SCENARIOS.items():
        rounds = []
        for _ in range(args.reps):
            seqs = [src.prompt(args.prompt_len) for _ in range(args.batch)]
            for s in seqs:
                cache.insert(s)
            rounds.append(time_steps(cache, src, seqs, args.steps, k, copy_frac, clock(args)))
        result[name] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    types = ("BFS", "PROB") if args.match_type == "both" else (args.match_type,)
    print(f"capacity={args.capacity} branch_length={args.branch_length} max_window={args.max_window} "
          f"N={args.num_draft_tokens} batch={args.batch} prompt_len={args.prompt_len} vocab={args.vocab} "
          f"clock={args.clock}")
    memory = bytes_per_node(args)
    print(f"memory: {memory:.0f} bytes per trie node (Python heap, tracemalloc)")
    results = []
    for match_type in types:
        r = bench_one(args, match_type)
        results.append(r)
        print(f"{match_type}: insert(prompt of {args.prompt_len}) {r['insert_prompt_us']:.0f} us "
              f"({r['insert_prompt_us'] / args.prompt_len:.1f} us/token), cache full ({r['nodes']} nodes)")
        for name in SCENARIOS:
            x = r[name]
            print(f"  {name:36s} insert {x['insert_step_us']:6.1f} us | match {x['match_us']:6.1f} us | "
                  f"batch-{args.batch} step (inserts + batch_match) {x['batch_step_us']:6.0f} us | "
                  f"draft nodes {x['mean_draft_nodes']:.1f}")
    report = {"python": platform.python_version(), "args": vars(args), "bytes_per_node": memory, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

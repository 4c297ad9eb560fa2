"""Grammar engines side by side on this CPU: what a structured-output request costs outside the model.

For each backend (llguidance, xgrammar) and each schema of the JSON extraction workload (``specserve.bench.schemas``),
with the demo model's tokenizer (or ``--tokenizer``):
- load: a fresh backend's set-up for the tokenizer (once per process, at the first grammar);
- compile: its compile of the schema (no cache), and the first mask of a fresh matcher (where a backend builds its
  tables lazily);
- mask: the time to compute one next-token bitmask, over every position of the schema's example output (tokenized),
  and the time to accept a token;
- tree: one draft tree's masks (``jump_forward`` without room to append: 12 nodes, the example's next tokens with a
  wrong sibling at each level, which it drops), the work a speculative verify step adds per constrained request.
Backends alternate schema by schema, ``--reps`` times; medians are printed, with the ratio xgrammar / llguidance.

    python benchmarks/bench_grammar.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer

from specserve.bench.schemas import SCHEMA_CASES
from specserve.demo_models import demo_path
from specserve.grammar import GrammarSpec, new_bitmask
from specserve.grammar.backend import grammar_backend_class
from specserve.grammar.masks import jump_forward

TREE_LEVELS = 6  # a chain of the example's tokens with one wrong sibling per level: 12 nodes


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(name: str, tokenizer, case) -> dict[str, float]:
    """One schema on a fresh backend (nothing cached) -> seconds per operation."""
    backend = grammar_backend_class(name)(tokenizer, len(tokenizer))
    spec = GrammarSpec.from_field("json_schema", json.dumps(case.schema))
    out: dict[str, float] = {}
    out["load_ms"] = timed(lambda: backend.compile(GrammarSpec.from_field("regex", "a"))) * 1e3  # its tokenizer
    compiled = None

    def compile_() -> None:
        nonlocal compiled
        compiled = backend.compile(spec)

    out["compile_ms"] = timed(compile_) * 1e3
    m = backend.matcher(compiled)
    bitmask = new_bitmask(1, backend.vocab_size)
    out["first_mask_ms"] = timed(lambda: m.fill(bitmask, 0)) * 1e3
    ids = tokenizer.encode(json.dumps(case.example), add_special_tokens=False)
    masks, accepts = [], []
    for t in ids:
        masks.append(timed(lambda: m.fill(bitmask, 0)))
        accepts.append(timed(lambda t=t: m.accept(t)))
    out["mask_us"] = statistics.median(masks) * 1e6
    out["mask_mean_us"] = statistics.mean(masks) * 1e6
    out["accept_us"] = statistics.median(accepts) * 1e6
    # a tree at a mid-output state
    fresh = backend.matcher(compiled)
    half = len(ids) // 2
    for t in ids[:half]:
        fresh.accept(t)
    wrong = tokenizer.encode("Z", add_special_tokens=False)[0]
    tokens, parents, node = [ids[half - 1]], [-1], 0
    for k in range(half, min(half + TREE_LEVELS, len(ids))):
        tokens += [ids[k], wrong]
        parents += [node, node]
        node = len(tokens) - 2
    out["tree_ms"] = timed(lambda: jump_forward(fresh, tokens, parents, set(), 0, backend.vocab_size)) * 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=demo_path("demo"), help="a HF tokenizer folder (default: the demo's)")
    p.add_argument("--backends", default="llguidance,xgrammar")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    names = args.backends.split(",")
    results: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for _ in range(args.reps):
        for case in SCHEMA_CASES:
            for name in names:  # alternate backends schema by schema
                for key, value in measure(name, tokenizer, case).items():
                    results[name].setdefault(key, []).append(value)
    print(f"tokenizer: {args.tokenizer} ({len(tokenizer)} tokens); {len(SCHEMA_CASES)} schemas x {args.reps} reps")
    keys = list(results[names[0]])
    print(f"{'median':<16}" + "".join(f"{n:>14}" for n in names) + ("   ratio" if len(names) == 2 else ""))
    for key in keys:
        meds = [statistics.median(results[n][key]) for n in names]
        ratio = f"   {meds[1] / meds[0]:.2f}" if len(names) == 2 and meds[0] else ""
        print(f"{key:<16}" + "".join(f"{m:>14.3f}" for m in meds) + ratio)


if __name__ == "__main__":
    main()

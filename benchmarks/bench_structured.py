"""Structured outputs: what a grammar costs plain decoding, and what EAGLE-3 gains under one.

The JSON extraction workload (``specserve.bench.schemas``: 20 schemas with nested objects, enums and arrays, a
prompt asking for each) runs greedy on in-process engines, plain and EAGLE-3, each with the grammar engines of
``--backends``. ``--model demo`` (default): the code family's target with ``demo-eagle3``, the prompts as they are;
``--model smollm2``: SmolLM2-135M-Instruct in bf16 with ``smollm2-eagle3``, each prompt a chat request whose system
turn gives the schema. Per engine:
- constrained: ``json_schema`` = the case's schema (the output ends when the JSON does, or at ``--max-new-tokens``);
- free: right after, the same prompts without a grammar, each generating as many tokens as its constrained run did
  (``ignore_eos``), so both runs have the same batch shapes over time: the unconstrained baseline.
Each group of prompts (one, or ``--batch``) runs on every engine in turn, constrained then free, before the next
group: what is compared runs within a second or so, so a neighbour's load on a shared machine hits both alike.
At batch 1 (one request at a time) and at ``--batch`` (that many at once). EAGLE-3 speculates at every step
(``disable_speculative_auto_off``) and runs three ways: as served (grammar-aware drafting and jump-forward, the
tokens a grammar forces appended to the draft tree), without jump-forward (``--disable-grammar-jump-forward``) and,
as other engines do it, drafting blind to the grammar with only verification masking it (``nojf`` plus
``--disable-grammar-aware-drafting``); the last two constrained only. All three produce the same outputs, so their
accept lengths compare on the same text. Plain decoding jumps over the tokens a grammar forces (appends them without
a forward of their own); ``plain-nojf`` is the plain engine without that (``--disable-grammar-jump-forward``: every
token its own forward, so only the grammar's own work sets it apart from free decoding), ``plain-masked`` the plain
engine with check-first sampling off (every constrained token's mask built before it is drawn); the same outputs.
Tokens/s is completion tokens over the round's summed wall time, the median over ``--rounds`` (after one uncounted
warm-up round), with ratios taken round by round. EAGLE-3 rows add the accept length (completion tokens per verify
step), the same without the grammar-forced tokens ("drafted"), and the forced tokens accepted per verify step.
"g. share" is the share of the constrained run's wall time that the engine's grammar work took on its scheduler
thread (``grammar_mask_seconds`` of the server info: the masks of sampling, verify trees and drafting, check-first
sampling's token checks and jump-forward's; not a redrawn row's argmax), the median over rounds: the grammar's own
cost, which a neighbour's load on a shared machine moves far less than it moves two tokens/s figures taken seconds
apart.

    python benchmarks/bench_structured.py --rounds 3 [--model smollm2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specserve import Engine
from specserve.bench.bench_compare import parse_tree
from specserve.bench.schemas import SCHEMA_CASES
from specserve.demo_models import SMOLLM2, bundled_drafter, demo_path

# EAGLE-3's variants: engine options on top of EAGLE-3's (all three give the same outputs)
VARIANTS = {"eagle3": {}, "eagle3-nojf": dict(disable_grammar_jump_forward=True),
            "eagle3-blind": dict(disable_grammar_jump_forward=True, disable_grammar_aware_drafting=True)}
# plain decoding's variant on the same engine (bf16 engines in one process may round apart, so a second engine
# would not give the same outputs): every constrained token's mask built before drawing it
PLAIN_VARIANTS = ("plain-masked", "plain-nojf")
MODELS = {"demo": dict(model_path=demo_path("demo")), SMOLLM2: dict(model_path=SMOLLM2, dtype="bfloat16")}


def engines(model: str, backends: list[str], algos: list[str], threads: int | None, compact: bool,
            tree: tuple[int, int, int] | None = None) -> dict[tuple[str, str], Engine]:
    out = {}
    target, head = MODELS[model], bundled_drafter(model)
    for backend in backends:
        common = dict(grammar_backend=backend, num_threads=threads, constrained_json_disable_any_whitespace=compact,
                      **target)
        out["plain", backend] = Engine(**common)  # always: the baseline of every row
        for algo in algos:
            if algo in PLAIN_VARIANTS:
                out[algo, backend] = out["plain", backend]
        # every step speculative: batch-aware speculation's timing-based plain steps would make the figures vary
        spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                    disable_speculative_auto_off=True, **common)
        if tree is not None:
            spec.update(speculative_num_steps=tree[0], speculative_eagle_topk=tree[1],
                        speculative_num_draft_tokens=tree[2])
        for algo in algos:
            if algo in VARIANTS:
                out[algo, backend] = Engine(**VARIANTS[algo], **spec)
    return out


def params(case, constrained: bool, max_new: int) -> dict:
    p = {"temperature": 0, "max_new_tokens": max_new}
    if constrained:
        p["json_schema"] = json.dumps(case.schema)
    else:
        p["ignore_eos"] = True
    return p


def prompts(engine: Engine, model: str) -> list[str]:
    """Each case's prompt: as it is for the code model; for a chat model, a chat request with the schema in its
    system turn."""
    if model == "demo":
        return [c.prompt for c in SCHEMA_CASES]
    system = "Reply with one JSON object that matches this JSON schema: {}"
    return [engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system.format(json.dumps(c.schema))}, {"role": "user", "content": c.prompt}],
        tokenize=False, add_generation_prompt=True) for c in SCHEMA_CASES]


def grammar_seconds(engine: Engine) -> float:
    """The seconds the engine's grammar work (masks, checks, forced tokens) has taken on its scheduler so far."""
    return engine.get_server_info()["grammar_mask_seconds"]


def run(engine: Engine, texts: list[str], group: range, lengths: list[int] | None, max_new: int
        ) -> tuple[float, list[int], int, int, float]:
    """The cases of `group` (their prompts `texts`) at once; constrained when `lengths` is None, else free with those
    output lengths (one per case of the group) -> (seconds, completion tokens per case, verify steps, grammar-forced
    tokens accepted, seconds of grammar work)."""
    ps = [params(SCHEMA_CASES[k], lengths is None, max_new if lengths is None else lengths[i])
          for i, k in enumerate(group)]
    grammar_before = grammar_seconds(engine)
    start = time.perf_counter()
    outs = engine.generate([texts[k] for k in group], ps)
    secs = time.perf_counter() - start
    grammar = grammar_seconds(engine) - grammar_before
    tokens, verify, forced = [], 0, 0
    for o in outs:
        tokens.append(o["meta_info"]["completion_tokens"])
        verify += o["meta_info"].get("spec_verify_ct", 0)
        forced += o["meta_info"].get("spec_forced_tokens", 0)
        if lengths is None and o["meta_info"]["finish_reason"]["type"] == "stop":
            json.loads(o["text"])  # a finished constrained output is JSON
    return secs, tokens, verify, forced, grammar


def _plain_variant(outputs, algo: str) -> None:
    """The plain engine's output processor set for ``algo`` (plain or one of PLAIN_VARIANTS)."""
    outputs.check_first_grammar = algo != "plain-masked"
    outputs.jump_forward_grammar = algo != "plain-nojf"


def run_round(eng: dict[tuple[str, str], Engine], texts: list[str], batch: int, max_new: int
              ) -> dict[tuple[str, str, bool], list]:
    """Every case, `batch` at a time; each group of cases runs on every engine in turn, constrained then free with the
    same output lengths (the same batch shapes over time), so the configurations compared see the same machine
    within a second or so of each other -> {(algo, backend, constrained): [seconds, tokens, verify steps, forced]}."""
    totals: dict[tuple[str, str, bool], list] = {}
    for i in range(0, len(texts), batch):
        group = range(i, min(i + batch, len(texts)))
        for (algo, backend), engine in eng.items():
            if algo.startswith("plain"):  # check-first sampling and jump-forward on, but for their variants
                engine.loop.call(lambda s, a=algo: _plain_variant(s.outputs, a))
            con = run(engine, texts, group, None, max_new)
            runs = {True: con}
            if algo in ("plain", "eagle3"):  # without a grammar, the variants change nothing
                runs[False] = run(engine, texts, group, con[1], max_new)
            for constrained, (secs, toks, ver, forced, grammar) in runs.items():
                t = totals.setdefault((algo, backend, constrained), [0.0, 0, 0, 0, 0.0])
                for i, x in enumerate((secs, sum(toks), ver, forced, grammar)):
                    t[i] += x
    return totals


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="demo",
                   help="demo: the code family; smollm2: SmolLM2-135M-Instruct (bf16) with its bundled head")
    p.add_argument("--backends", default="llguidance,xgrammar")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batch-1", action=argparse.BooleanOptionalAction, default=True,
                   help="also run one request at a time (--no-batch-1: only --batch)")
    p.add_argument("--algos", default="plain,eagle3,eagle3-nojf,eagle3-blind",
                   help="what runs: plain (always), plain-masked (every mask built before drawing: check-first "
                        "sampling off), plain-nojf (no jump-forward) and EAGLE-3's variants (eagle3, eagle3-nojf, "
                        "eagle3-blind)")
    p.add_argument("--num-prompts", type=int, default=len(SCHEMA_CASES), help="the first N of the 20 cases")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--constrained-json-disable-any-whitespace", action="store_true",
                   help="JSON without whitespace beyond single spaces after , and : (the server flag)")
    p.add_argument("--eagle3-tree", default=None, metavar="S,K,N",
                   help="EAGLE-3's draft tree (steps, top-k, draft tokens); default: the head's own")
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    algos = ["plain", *(a for a in args.algos.split(",") if a != "plain")]
    unknown = set(algos) - {"plain", *PLAIN_VARIANTS, *VARIANTS}
    if unknown:
        p.error(f"--algos: unknown {', '.join(sorted(unknown))}; "
                f"choose from plain, {', '.join([*PLAIN_VARIANTS, *VARIANTS])}")
    try:
        tree = None if args.eagle3_tree is None else parse_tree(args.eagle3_tree)
    except ValueError:
        p.error("--eagle3-tree: three integers S,K,N")
    eng = engines(args.model, backends, algos, args.num_threads, args.constrained_json_disable_any_whitespace, tree)
    texts = prompts(next(iter(eng.values())), args.model)[:args.num_prompts]
    rows: dict[tuple, dict[str, list]] = {}
    for rnd in range(args.rounds + 1):
        for batch in ((1, args.batch) if args.batch_1 else (args.batch,)):
            totals = run_round(eng, texts, batch, args.max_new_tokens)
            if rnd == 0:
                continue  # warm-up
            for (algo, backend, constrained), (secs, toks, ver, forced, grammar) in totals.items():
                r = rows.setdefault((batch, algo, backend, constrained),
                                    {"tps": [], "accept": [], "drafted": [], "forced": [], "share": []})
                r["tps"].append(toks / secs)
                r["share"].append(grammar / secs)
                if ver:
                    r["accept"].append(toks / ver)
                    r["drafted"].append((toks - forced) / ver)
                    r["forced"].append(forced / ver)
    checks = {key: e.get_server_info() for key, e in eng.items() if key[0] not in PLAIN_VARIANTS}
    for e in set(eng.values()):
        e.shutdown()
    space = "compact JSON" if args.constrained_json_disable_any_whitespace else "JSON whitespace up to 24 chars"
    print(f"{args.model} (bf16), {len(texts)} JSON-schema prompts, greedy, max {args.max_new_tokens} new tokens, "
          f"{space}; median of {args.rounds} rounds (ratio: round by round)")
    print(f"{'batch':>5} {'algo':>12} {'grammar':>11} {'free tok/s':>11} {'tok/s':>9} {'vs free':>8} "
          f"{'vs plain':>9} {'g. share':>8} {'accept free':>12} {'accept':>7} {'drafted':>8} {'forced':>7}")
    for (batch, algo, backend, constrained), r in rows.items():
        if not constrained:
            continue
        free = rows.get((batch, "plain" if algo in PLAIN_VARIANTS else algo, backend, False))  # plain, eagle3 only
        plain = rows[batch, "plain", backend, True]["tps"]
        vs_plain = statistics.median(a / b for a, b in zip(r["tps"], plain, strict=True))

        def med(x: dict | None, key: str, fmt: str = ".2f") -> str:
            return format(statistics.median(x[key]), fmt) if x is not None and x[key] else "-"

        vs_free = "-" if free is None else \
            f"{statistics.median(a / b for a, b in zip(r['tps'], free['tps'], strict=True)):.2f}"
        print(f"{batch:>5} {algo:>12} {backend:>11} {med(free, 'tps', '.1f'):>11} {med(r, 'tps', '.1f'):>9} "
              f"{vs_free:>8} {vs_plain:>9.2f} {med(r, 'share', '.1%'):>8} {med(free, 'accept'):>12} "
              f"{med(r, 'accept'):>7} {med(r, 'drafted'):>8} {med(r, 'forced'):>7}")
    for (algo, backend), info in checks.items():
        if info.get("grammar_checked_tokens"):
            print(f"{algo} {backend}: {info['grammar_check_refusals']} of {info['grammar_checked_tokens']} tokens "
                  f"drawn check-first were refused (then the forced token, or a draw under the mask)")
        if info.get("grammar_jump_forward_tokens"):
            print(f"{algo} {backend}: {info['grammar_jump_forward_tokens']} tokens appended by jump-forward (no "
                  f"forward of their own)")

if __name__ == "__main__":
    main()

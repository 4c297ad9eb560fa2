"""``specserve bench-speculative``: sweep the draft tree shape and the batch size with the offline Engine.

    specserve bench-speculative                                   # the default: SmolLM2 + its EAGLE-3 head
    specserve bench-speculative --model-path TARGET --speculative-algorithm EAGLE \\
        --speculative-draft-model-path DRAFT --batch-size 1,4,16 --steps 1,3,5 --topk 1,2,4 \\
        --num-draft-tokens 4,8,16 --num-prompts 8 --max-new-tokens 64 --reps 1 [--out-dir DIR]
    specserve bench-speculative --steps 6 --topk 4 --num-draft-tokens 16 \\
        --stop-threshold 0,0.02 --score-temperature 1,0.6           # our two tree-shaping flags swept too
    specserve bench-speculative --temperature 0.7 --coupled-drafting on,off      # sampled, coupled drafting or not
    specserve bench-speculative --draft-dtype float32,bfloat16         # the draft model's dtype

Every (``--speculative-num-steps``, ``--speculative-eagle-topk``, ``--speculative-num-draft-tokens``) combination of
the grid goes through ``ServerArgs.validate``: the ones it rejects are skipped with its message, and the ones it
normalizes into an earlier one (topk 1 forces draft tokens = steps + 1) are skipped as duplicates. The plain engine
(the same server flags, no speculation) is always measured too. ``--stop-threshold`` and ``--score-temperature`` add
``--speculative-draft-stop-threshold`` and ``--speculative-draft-score-temperature`` to the grid, and
``--coupled-drafting on,off`` the coupling of sampled requests' drafts (``--disable-speculative-coupled-drafting``
for off) (EAGLE-family trees; given once as server flags instead, they hold for every point), and ``--draft-dtype``
the dtypes of the draft model (``--speculative-draft-dtype``; methods with a separate draft model). One Engine is built
per configuration, warmed up once, and runs every batch size; a batch of size b is b prompts submitted in one
``generate`` call, ``ignore_eos`` so each request makes exactly ``--max-new-tokens`` tokens. Per batch size the
prompts (the target family's held-out ones, cycled: ``held_out_prompts_for``) are ``max(--num-prompts, b)`` rounded
up to a multiple of b; the prefix cache is flushed before each of the ``--reps`` passes over them. With
``--interleave`` every engine is loaded at once and each generate call (one batch of prompts) runs on every
configuration in turn before the next (A B C A B C): the machine's drift then reaches every configuration alike, at
the cost of memory for all the engines.

Figures per (batch size, configuration):

- ``tokens_per_s``: completion tokens / wall time of the generate calls (prefill included), median of the reps;
- ``speedup``: tokens_per_s / the plain engine's at the same batch size, measured in the same run;
- ``accept_length``: completion tokens / verify steps (``meta_info``: the prefill's token counts, as in SGLang),
  leaving out tokens of plain steps (``--batch-aware``: the engine's batch-aware speculation ran them);
- ``step_ms``: wall time spent inside the scheduler's decode steps / their number (every rep): for a speculative
  engine one step is drafting + the verify forward + acceptance; prefill steps are not in it. ``verify_ms`` and
  ``draft_ms`` split it (verify forward; ``propose`` + ``after_verify``);
- ``slowest_steps``: per generate call, the decode steps of its slowest request over its requests' mean (verify
  steps plus plain steps; the median over calls): a batch of requests that start together ends with its slowest,
  so a speculative engine pays for the spread of acceptance across requests (1.0 when every request takes the same
  number of steps, as in plain decoding of equal lengths).

The best configuration per batch size is the one with the highest tokens/s, the plain engine included.
Written to ``--out-dir``: ``results.jsonl`` (one row per measurement), ``results.md`` (the table),
``summary.json`` (best per batch size, skipped configurations), ``tokens_per_s.png`` and ``speedup.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from specserve.config import ConfigError, ServerArgs
from specserve.speculative.accept_stats import accept_length
from specserve.speculative.simulate import ACC_LEN_ENV, simulate_env_value

COMMAND = "bench-speculative"
SIMULATE_ENV = ACC_LEN_ENV  # the simulation variables a run records (SPECSERVE_ first)
TABLE_COLUMNS = (
    ("batch_size", "batch", None), ("config", "config", None), ("accept_length", "accept len", ".2f"),
    ("draft_forwards_per_tree", "draft fwd/tree", ".2f"), ("step_ms", "decode step ms", ".2f"),
    ("slowest_steps", "slowest/mean steps", ".2f"), ("tokens_per_s", "tok/s", ".1f"), ("speedup", "speed-up", ".2f"),
    ("best_mark", "best", None),
)


@dataclass(frozen=True)
class TreeShape:
    """A point of the grid after validation; all None = the plain engine (no speculation)."""

    steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    stop_threshold: float | None = None  # None: not swept (the server flag's value)
    score_temperature: float | None = None
    coupled: bool | None = None  # coupled drafting of sampled requests; None: not swept
    draft_dtype: str | None = None  # --speculative-draft-dtype; None: not swept

    @property
    def is_baseline(self) -> bool:
        return self.steps is None and self.num_draft_tokens is None

    @property
    def label(self) -> str:
        if self.is_baseline:
            return "baseline"
        if self.steps is None:  # NGRAM: only the node budget matters
            return f"draft {self.num_draft_tokens}"
        label = f"steps {self.steps} topk {self.topk} draft {self.num_draft_tokens}"
        if self.stop_threshold is not None:
            label += f" thr {self.stop_threshold:g}"
        if self.score_temperature is not None:
            label += f" T {self.score_temperature:g}"
        if self.coupled is not None:
            label += " coupled" if self.coupled else " uncoupled"
        if self.draft_dtype is not None:
            label += f" {self.draft_dtype}"
        return label


BASELINE = TreeShape()


# ---------------------------------------------------------------------------------------------- options
def parse_int_list(text: str, flag: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (order kept, duplicates dropped); ConfigError naming the flag otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} takes comma-separated integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def parse_float_list(text: str | None, flag: str, ok: Callable[[float], bool], bounds: str) -> list[float | None]:
    """'0,0.02' -> [0.0, 0.02] (order kept, duplicates dropped), each passing `ok`; None (the flag not given)
    -> [None]. ConfigError naming the flag and `bounds` otherwise."""
    if text is None:
        return [None]
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values or not all(ok(v) for v in values):
        raise ConfigError(f"{flag} takes comma-separated numbers in {bounds}, got {text!r}")
    return list(dict.fromkeys(values))


def parse_choice_list(text: str | None, flag: str, choices: tuple[str, ...]) -> list[str | None]:
    """'a, b,a' -> ['a', 'b'] (order kept, duplicates dropped), each one of `choices`; None (the flag not given)
    -> [None]. ConfigError naming the flag otherwise."""
    if text is None:
        return [None]
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words or any(w not in choices for w in words):
        raise ConfigError(f"{flag} takes a comma list of {' / '.join(choices)}, got {text!r}")
    return list(dict.fromkeys(words))


def parse_on_off_list(text: str | None, flag: str) -> list[bool | None]:
    """'on,off' -> [True, False] (order kept, duplicates dropped); None (the flag not given) -> [None]."""
    return [None if w is None else w == "on" for w in parse_choice_list(text, flag, ("on", "off"))]


def parse_dtype_list(text: str | None) -> list[str | None]:
    """--draft-dtype 'float32,bfloat16' -> ['float32', 'bfloat16']; None -> [None]."""
    from specserve.config import DTYPES

    return parse_choice_list(text, "--draft-dtype", DTYPES)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from specserve.args import add_server_args

    p = argparse.ArgumentParser(prog=f"specserve {COMMAND}", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("sweep")
    g.add_argument("--batch-size", default="1,4,16", help="batch sizes, comma list (default: 1,4,16)")
    g.add_argument("--steps", default="1,3,5", help="--speculative-num-steps values (default: 1,3,5)")
    g.add_argument("--topk", default="1,2,4", help="--speculative-eagle-topk values (default: 1,2,4)")
    g.add_argument("--num-draft-tokens", default="4,8,16",
                   help="--speculative-num-draft-tokens values (default: 4,8,16)")
    g.add_argument("--stop-threshold", default=None,
                   help="--speculative-draft-stop-threshold values, comma list in [0, 1) (default: not swept)")
    g.add_argument("--score-temperature", default=None,
                   help="--speculative-draft-score-temperature values, comma list in (0, 10] (default: not swept)")
    g.add_argument("--coupled-drafting", default=None,
                   help="on,off: sampled requests' drafts ranked with their verification's noise or not "
                        "(--disable-speculative-coupled-drafting; default: not swept)")
    g.add_argument("--draft-dtype", default=None,
                   help="comma list of --speculative-draft-dtype values to sweep, e.g. float32,bfloat16 (default: "
                        "not swept)")
    g.add_argument("--num-prompts", type=int, default=8,
                   help="held-out prompts per batch size (at least the batch size; they cycle; default: 8)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--reps", type=int, default=1, help="timed passes per measurement (median tok/s; default: 1)")
    g.add_argument("--out-dir", default=None, help=f"default: bench_results/{COMMAND}-<timestamp>")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--batch-aware", action="store_true",
                   help="keep the engine's batch-aware speculation (tree shrinking and auto-off) as served; "
                        "default: measure each swept tree as given, on every step")
    g.add_argument("--interleave", action="store_true",
                   help="load every configuration's engine at once and alternate them batch by batch (fairer on a busy "
                        "machine: drift reaches every configuration alike; needs memory for all the engines)")
    add_server_args(p)
    p.set_defaults(log_level="warning")  # engine progress lines would break the progress bar
    return p.parse_args(argv)


def check_args(ns: argparse.Namespace) -> dict[str, list]:
    """The grid lists; ConfigError naming the bad flag."""
    from specserve.config import MAX_SCORE_TEMPERATURE

    for name in ("num_prompts", "max_new_tokens", "reps"):
        if getattr(ns, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {ns.temperature}")
    return {"batch_sizes": parse_int_list(ns.batch_size, "--batch-size"), "steps": parse_int_list(ns.steps, "--steps"),
            "topk": parse_int_list(ns.topk, "--topk"),
            "num_draft_tokens": parse_int_list(ns.num_draft_tokens, "--num-draft-tokens"),
            "stop_threshold": parse_float_list(ns.stop_threshold, "--stop-threshold", lambda v: 0 <= v < 1,
                                               "[0, 1)"),
            "score_temperature": parse_float_list(ns.score_temperature, "--score-temperature",
                                                  lambda v: 0 < v <= MAX_SCORE_TEMPERATURE,
                                                  f"(0, {MAX_SCORE_TEMPERATURE:g}]"),
            "coupled": parse_on_off_list(ns.coupled_drafting, "--coupled-drafting"),
            "draft_dtype": parse_dtype_list(ns.draft_dtype)}


def base_args(ns: argparse.Namespace) -> ServerArgs:
    """Server arguments from the flags; no --model-path = the default model with its EAGLE-3 head (use_demo)."""
    from specserve.args import server_args_from, use_demo

    if ns.model_path is None:
        use_demo(ns)
    if ns.speculative_algorithm is None:
        raise ConfigError("--speculative-algorithm is required with --model-path (the sweep compares it with plain "
                          "decoding)")
    tree = {"speculative_num_steps": None, "speculative_eagle_topk": None, "speculative_num_draft_tokens": None}
    return server_args_from(argparse.Namespace(**{**vars(ns), **tree}))  # the grid sets the tree shape


# ---------------------------------------------------------------------------------------------- grid
def expand_grid(base: ServerArgs, steps: list[int], topks: list[int], tokens: list[int],
                thresholds: list[float | None] = (None,), temperatures: list[float | None] = (None,),
                coupled: list[bool | None] = (None,), dtypes: list[str | None] = (None,)
                ) -> tuple[list[tuple[TreeShape, ServerArgs]], list[dict]]:
    """Validated (shape, server args) per distinct grid point, in grid order, and the skipped points with why.
    A None threshold / temperature / coupling / draft dtype keeps `base`'s value and is left out of the label."""
    configs: list[tuple[TreeShape, ServerArgs]] = []
    skipped: list[dict] = []
    seen: dict[TreeShape, str] = {}
    ngram = base.speculative_algorithm == "NGRAM"
    for s, k, n, thr, temp, cpl, dt in itertools.product(steps, topks, tokens, thresholds, temperatures, coupled,
                                                         dtypes):
        asked = {"steps": s, "topk": k, "num_draft_tokens": n, "stop_threshold": thr, "score_temperature": temp,
                 "coupled": cpl, "draft_dtype": dt}
        asked_label = TreeShape(s, k, n, thr, temp, cpl, dt).label
        try:
            args = dataclasses.replace(
                base, speculative_num_steps=None if ngram else s, speculative_eagle_topk=None if ngram else k,
                speculative_num_draft_tokens=n,
                speculative_draft_stop_threshold=base.speculative_draft_stop_threshold if thr is None else thr,
                speculative_draft_score_temperature=base.speculative_draft_score_temperature if temp is None else temp,
                disable_speculative_coupled_drafting=(base.disable_speculative_coupled_drafting if cpl is None
                                                      else not cpl),
                speculative_draft_dtype=base.speculative_draft_dtype if dt is None else dt,
            ).validate()
        except ConfigError as e:
            skipped.append({**asked, "reason": str(e)})
            continue
        # NGRAM has no draft probabilities: none of these flags shapes its tree
        shape = TreeShape(args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens,
                          None if ngram else thr, None if ngram else temp, None if ngram else cpl,
                          None if ngram else dt)
        if shape in seen:
            skipped.append({**asked, "reason": f"validation makes it {shape.label}, already measured "
                                               f"(from {seen[shape]})"})
            continue
        seen[shape] = asked_label
        configs.append((shape, args))
    return configs, skipped


def prompts_for_batch(pool: list[str], batch_size: int, num_prompts: int) -> list[str]:
    """max(num_prompts, batch_size) rounded up to a multiple of batch_size, cycling through the pool."""
    count = math.ceil(max(num_prompts, batch_size) / batch_size) * batch_size
    return [pool[i % len(pool)] for i in range(count)]


# ---------------------------------------------------------------------------------------------- measuring
def measure_batch(engine, clock, prompts: list[str], batch_size: int, params: dict, reps: int) -> dict:
    """Time `reps` passes over `prompts` in generate calls of batch_size (prefix cache flushed before each)."""
    mark = start_batch(engine, clock)
    passes = [measure_pass(engine, prompts, batch_size, params) for _ in range(reps)]
    return summarize(engine, clock, mark, passes, batch_size)


def start_batch(engine, clock) -> tuple[int, int]:
    """Start a batch size's measurement: the step clock emptied; the draft counters so far (for summarize)."""
    clock.reset()
    return _draft_counts(engine)


def measure_pass(engine, prompts: list[str], batch_size: int, params: dict) -> tuple[float, list[dict]]:
    """One pass over `prompts` in generate calls of batch_size after a prefix-cache flush: (seconds inside the
    generate calls, every request's meta_info)."""
    flush(engine)
    seconds, metas = 0.0, []
    for chunk in chunks(prompts, batch_size):
        chunk_seconds, chunk_metas = timed_generate(engine, chunk, params)
        seconds += chunk_seconds
        metas += chunk_metas
    return seconds, metas


def chunks(prompts: list[str], batch_size: int) -> list[list[str]]:
    return [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]


def timed_generate(engine, prompts: list[str], params: dict) -> tuple[float, list[dict]]:
    """One generate call (a batch): (its wall seconds, every request's meta_info)."""
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, [o["meta_info"] for o in outs]


def flush(engine) -> None:
    from specserve.bench.harness import flush_prefix_cache

    flush_prefix_cache(engine)


def slowest_steps(metas: list[dict], batch_size: int) -> float | None:
    """Requests' meta_info in generate calls of batch_size (in order; the last call may be shorter) -> the median over
    calls of (decode steps of the call's slowest request / its requests' mean), a request's steps being its verify
    steps plus its plain steps; None when no request speculated."""
    if not any(m.get("spec_verify_ct") for m in metas):
        return None
    ratios = []
    for i in range(0, len(metas), batch_size):
        steps = [m["spec_verify_ct"] + m.get("spec_plain_tokens", 0) for m in metas[i : i + batch_size]]
        if sum(steps):
            ratios.append(max(steps) / statistics.mean(steps))
    return statistics.median(ratios)


def summarize(engine, clock, mark: tuple[int, int], passes: list[tuple[float, list[dict]]], batch_size: int) -> dict:
    """A batch size's figures from its passes (each from measure_pass, in generate calls of batch_size) since
    start_batch returned `mark`."""
    reps = len(passes)
    rates = [sum(m["completion_tokens"] for m in metas) / seconds for seconds, metas in passes]
    metas = [m for _, pass_metas in passes for m in pass_metas]
    tokens = sum(m["completion_tokens"] for m in metas)
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    plain_tokens = sum(m.get("spec_plain_tokens", 0) for m in metas)
    steps = len(clock.times.get("decode_step", []))
    trees, forwards = (now - before for now, before in zip(_draft_counts(engine), mark, strict=True))
    return {
        "completion_tokens": tokens // reps, "tokens_per_s": statistics.median(rates), "decode_steps": steps // reps,
        "verify_steps": verify // reps if verify else None,
        "accept_length": accept_length(metas) if verify else None,
        "plain_step_tokens": plain_tokens // reps,
        "slowest_steps": slowest_steps(metas, batch_size),
        "step_ms": clock.mean_ms("decode_step"),
        "verify_ms": _or_none(clock.mean_ms("target_verify")),
        "draft_ms": _or_none(clock.mean_ms("propose") + clock.mean_ms("after_verify")),
        # draft-level forwards per tree drafted beyond its first level (up to steps - 1; fewer where drafting
        # stopped early: --speculative-draft-stop-threshold, or deeper levels that cannot change the tree)
        "draft_forwards_per_tree": forwards / trees if trees else None,
    }


def _draft_counts(engine) -> tuple[int, int]:
    """(EAGLE-family trees drafted beyond their first level, their draft forwards) so far; (0, 0) otherwise."""
    info = engine.get_server_info()
    return info.get("spec_draft_trees", 0), info.get("spec_draft_forwards", 0)


def _or_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def step_clock(engine):
    """StepClock (forwards by mode, the drafter's hooks) plus the scheduler's whole decode step."""
    from specserve.bench.harness import StepClock

    clock = StepClock(engine)
    clock._wrap(engine.scheduler, "_run_decode", lambda: "decode_step")
    return clock


def run_config(shape: TreeShape, args: ServerArgs, batches: dict[int, list[str]], params: dict, reps: int,
               batch_aware: bool = False
               ) -> list[dict]:
    """One engine for the configuration: warm up once, then every batch size. Rows without speed-up yet."""
    engine, clock = load_engine(args, params, batch_aware)
    try:
        return [{**row_head(shape, args, b, prompts), **measure_batch(engine, clock, prompts, b, params, reps)}
                for b, prompts in batches.items()]
    finally:
        engine.shutdown()
        del engine, clock
        gc.collect()  # the step clock's reference cycles: free this engine's KV pool before the next loads


def run_interleaved(todo: list[tuple[TreeShape, ServerArgs]], batches: dict[int, list[str]], params: dict,
                    reps: int, batch_aware: bool = False, progress=None) -> tuple[list[dict], list[dict]]:
    """Every configuration's engine loaded at once. Per batch size and rep, each generate call (one batch of
    prompts) runs on every configuration in turn before the next batch (A B C A B C), so the machine's drift
    reaches them all alike. -> (rows without speed-up, configurations skipped at load time)."""
    loaded, skipped = [], []
    try:
        for shape, args in todo:
            try:
                loaded.append((shape, args, *load_engine(args, params, batch_aware)))
            except ConfigError as e:  # a check the engine makes at load time (e.g. against the draft model)
                skipped.append(skip_row(shape, e))
        rows = []
        for b, prompts in batches.items():
            marks = [start_batch(engine, clock) for _, _, engine, clock in loaded]
            passes: list[list] = [[] for _ in loaded]
            for _ in range(reps):
                for _, _, engine, _ in loaded:
                    flush(engine)
                this_rep = [(0.0, []) for _ in loaded]  # per configuration: (seconds, metas) of this pass
                for chunk in chunks(prompts, b):
                    for i, (_, _, engine, _) in enumerate(loaded):
                        seconds, metas = timed_generate(engine, chunk, params)
                        this_rep[i] = (this_rep[i][0] + seconds, this_rep[i][1] + metas)
                for i, one_pass in enumerate(this_rep):
                    passes[i].append(one_pass)
                if progress is not None:
                    progress.update(len(loaded))
            rows += [{**row_head(shape, args, b, prompts), **summarize(engine, clock, mark, done, b)}
                     for (shape, args, engine, clock), mark, done in zip(loaded, marks, passes, strict=True)]
        return rows, skipped
    finally:
        for _, _, engine, _ in loaded:
            engine.shutdown()


def load_engine(args: ServerArgs, params: dict, batch_aware: bool):
    """(engine, its step clock) for one configuration, warmed up. Without batch_aware the swept tree runs as
    given: no shrinking or auto-off."""
    from specserve.bench.eval_acceptance import WARMUP_PROMPT, WARMUP_TOKENS
    from specserve.engine import Engine

    if args.speculative_algorithm and not batch_aware:
        args = dataclasses.replace(args, speculative_batch_token_budget=0, disable_speculative_auto_off=True)
    engine = Engine(**dataclasses.asdict(args))
    try:
        clock = step_clock(engine)
        engine.generate(WARMUP_PROMPT, {**params, "max_new_tokens": WARMUP_TOKENS})
    except BaseException:
        engine.shutdown()
        raise
    return engine, clock


def row_head(shape: TreeShape, args: ServerArgs, batch_size: int, prompts: list[str]) -> dict:
    """The configuration's columns of a result row."""
    spec = args.speculative_algorithm is not None
    return {"config": shape.label, "algorithm": args.speculative_algorithm,
            "draft_model_path": args.speculative_draft_model_path, "steps": shape.steps, "topk": shape.topk,
            "num_draft_tokens": shape.num_draft_tokens,
            "stop_threshold": args.speculative_draft_stop_threshold if spec else None,
            "score_temperature": args.speculative_draft_score_temperature if spec else None,
            "coupled_drafting": not args.disable_speculative_coupled_drafting if spec else None,
            "draft_dtype": args.speculative_draft_dtype if spec else None,
            "batch_size": batch_size, "num_prompts": len(prompts)}


def skip_row(shape: TreeShape, error: ConfigError) -> dict:
    print(f"skip {shape.label}: {error}", file=sys.stderr)
    return {**dataclasses.asdict(shape), "reason": str(error)}


# ---------------------------------------------------------------------------------------------- results
def add_speedups(rows: list[dict]) -> list[dict]:
    """speedup (vs the baseline row of the same batch size), best (highest tok/s per batch size, baseline
    included) and best_mark ('*' on the best row) on a copy of each row."""
    base = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["config"] == BASELINE.label}
    best = best_per_batch(rows)
    out = []
    for r in rows:
        ref = base.get(r["batch_size"])
        is_best = best[r["batch_size"]] is r
        out.append({**r, "speedup": r["tokens_per_s"] / ref if ref else None, "best": is_best,
                    "best_mark": "*" if is_best else ""})
    return out


def best_per_batch(rows: list[dict]) -> dict[int, dict]:
    """batch size -> the row with the highest tokens_per_s (the first one on ties)."""
    best: dict[int, dict] = {}
    for r in rows:
        cur = best.get(r["batch_size"])
        if cur is None or r["tokens_per_s"] > cur["tokens_per_s"]:
            best[r["batch_size"]] = r
    return best


def best_lines(rows: list[dict]) -> list[str]:
    """One sentence per batch size naming the winner (rows with speedup, as from add_speedups)."""
    lines = []
    for b, r in sorted(best_per_batch(rows).items()):
        if r["config"] == BASELINE.label:
            lines.append(f"batch {b}: best = baseline ({r['tokens_per_s']:.1f} tok/s): no speculative "
                         "configuration beats plain decoding")
        else:
            lines.append(f"batch {b}: best = {r['config']} ({r['tokens_per_s']:.1f} tok/s, {r['speedup']:.2f}x "
                         f"baseline, accept length {r['accept_length']:.2f})")
    return lines


def format_rows(rows: list[dict]) -> str:
    """The markdown table of the rows (after add_speedups)."""
    from specserve.bench.report import format_table

    return format_table(rows, TABLE_COLUMNS)


def plot_series(rows: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """config label -> (batch sizes, values of `key`), configurations in row order."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        xs, ys = series.setdefault(r["config"], ([], []))
        xs.append(r["batch_size"])
        ys.append(r[key])
    return series


def write_outputs(rows: list[dict], skipped: list[dict], setup: dict, out_dir: str) -> list[str]:
    from specserve.bench.report import plot_lines, write_jsonl

    os.makedirs(out_dir, exist_ok=True)
    paths = [write_jsonl([{k: v for k, v in r.items() if k != "best_mark"} for r in rows],
                         os.path.join(out_dir, "results.jsonl"))]
    md = os.path.join(out_dir, "results.md")
    with open(md, "w") as f:
        f.write(format_rows(rows) + "\n")
    paths.append(md)
    summary = {**setup, "best": {str(b): r["config"] for b, r in best_per_batch(rows).items()},
               "skipped": skipped}
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    paths.append(path)
    title = f"{setup['algorithm']} on {os.path.basename(setup['model_path'].rstrip('/'))}"
    logx = len({r["batch_size"] for r in rows}) > 2
    paths.append(plot_lines(plot_series(rows, "tokens_per_s"), os.path.join(out_dir, "tokens_per_s.png"),
                            title=f"{title}: output tokens/s", xlabel="batch size", ylabel="tokens/s", logx=logx))
    paths.append(plot_lines(plot_series(rows, "speedup"), os.path.join(out_dir, "speedup.png"),
                            title=f"{title}: speed-up vs plain decoding", xlabel="batch size",
                            ylabel="speed-up (x)", logx=logx))
    return paths


def simulate_acc_len() -> str | None:
    """The value of SPECSERVE_SIMULATE_ACC_LEN (or its twin SGLANG_SIMULATE_ACC_LEN) when set."""
    return simulate_env_value()


# ---------------------------------------------------------------------------------------------- command
def sweep(ns: argparse.Namespace, grid: dict[str, list[int]], args: ServerArgs) -> tuple[list[dict], list[dict]]:
    """Measure the baseline and every valid grid point; returns (rows with speed-ups, skipped points)."""
    from tqdm import tqdm

    from specserve.bench.eval_acceptance import held_out_prompts_for, plain_args

    configs, skipped = expand_grid(args, grid["steps"], grid["topk"], grid["num_draft_tokens"],
                                   grid["stop_threshold"], grid["score_temperature"], grid["coupled"],
                                   grid["draft_dtype"])
    for s in skipped:
        shape = TreeShape(s["steps"], s["topk"], s["num_draft_tokens"], s["stop_threshold"], s["score_temperature"],
                          s["coupled"], s["draft_dtype"])
        print(f"skip {shape.label}: {s['reason']}", file=sys.stderr)
    pool = held_out_prompts_for(args.model_path, max(ns.num_prompts, *grid["batch_sizes"]))
    batches = {b: prompts_for_batch(pool, b, ns.num_prompts) for b in grid["batch_sizes"]}
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "ignore_eos": True}
    todo = [(BASELINE, plain_args(args)), *configs]
    if ns.interleave:
        with tqdm(total=len(todo) * len(batches) * ns.reps, desc=COMMAND, unit="pass", disable=ns.no_progress) as bar:
            rows, load_skipped = run_interleaved(todo, batches, params, ns.reps, ns.batch_aware, bar)
        skipped += load_skipped
    else:
        rows = []
        for shape, cfg_args in tqdm(todo, desc=COMMAND, unit="config", disable=ns.no_progress):
            try:
                rows += run_config(shape, cfg_args, batches, params, ns.reps, ns.batch_aware)
            except ConfigError as e:  # a check the engine makes at load time (e.g. against the draft model)
                skipped.append(skip_row(shape, e))
    rows.sort(key=lambda r: r["batch_size"])  # stable: per batch size, the baseline then the grid order
    import torch

    common = {"model_path": args.model_path, "max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature,
              "reps": ns.reps, "dtype": args.dtype, "num_threads": torch.get_num_threads(),
              "simulate_acc_len": simulate_acc_len(), "interleave": ns.interleave}
    return [{**r, **common} for r in add_speedups(rows)], skipped


def main(argv: list[str]) -> int:
    from specserve.bench.report import report_missing_extra
    from specserve.models.loader import ModelLoadError

    try:
        ns = parse_args(argv)
    except SystemExit as e:  # argparse printed the message naming the flag
        return int(e.code or 0)
    if report_missing_extra("specserve bench-speculative", "matplotlib"):
        return 2
    try:
        grid = check_args(ns)
        args = base_args(ns)
        rows, skipped = sweep(ns, grid, args)
    except (ConfigError, ModelLoadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = ns.out_dir or os.path.join("bench_results", f"{COMMAND}-{time.strftime('%Y%m%d-%H%M%S')}")
    setup = {"command": " ".join(["specserve", COMMAND, *argv]), "algorithm": args.speculative_algorithm,
             "model_path": args.model_path, "draft_model_path": args.speculative_draft_model_path,
             "batch_sizes": grid["batch_sizes"], "max_new_tokens": ns.max_new_tokens,
             "temperature": ns.temperature, "reps": ns.reps, "simulate_acc_len": simulate_acc_len(),
             "interleave": ns.interleave}
    paths = write_outputs(rows, skipped, setup, out_dir)
    print(format_rows(rows))
    print()
    print("\n".join(best_lines(rows)))
    if skipped:
        print(f"skipped {len(skipped)} grid point(s) (see summary.json)")
    print("wrote: " + ", ".join(paths))
    return 0

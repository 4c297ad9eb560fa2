"""NGRAM speculative decoding vs transformers' prompt lookup decoding, side by side in one run (CPU, batch 1).

Four engines on the same target and the same prompt token ids, greedy (temperature 0), a fixed number of new
tokens per prompt (specserve ``ignore_eos``; transformers ``eos_token_id=None``, so neither stops early):

(a) specserve plain, (b) specserve ``--speculative-algorithm NGRAM`` with every other ngram flag at its default
(``--speculative-num-draft-tokens`` = the max match window, 12; BFS tree; branch length 18), (c) transformers
``generate``, (d) transformers ``generate(prompt_lookup_num_tokens=N)`` (``--lookup-tokens``, default 10).

Two prompt sets: "repetitive" (a held-out standard-library function given once, then its first line again,
so the ideal continuation is a copy of the prompt; the small demo model copies only the first few tokens,
then writes its own, often self-repeating, code: the JSON reports how many characters it copied) and
"open-ended" (``held_out_prompts``: code ending at a ``def`` line). Each prompt runs through the four engines
in turn (a, b, c, d, so drift of a shared machine hits all alike); tokens/s = generated tokens / summed wall
time of the generate calls (prefill included). Every engine is warmed up first; specserve's prefix cache is
flushed (untimed) before each prompt. NGRAM's trie is shared by all requests of one engine (as in SGLang), so later
prompts of a set may also draft from earlier ones; each set gets fresh engines (an empty trie).

    python -m specserve.bench.bench_ngram [--dtype float32|bfloat16] [--num-prompts 8] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

SETS = ("repetitive", "open-ended")
ENGINES = ("ours_plain", "ours_ngram", "hf_plain", "hf_lookup")
WARMUP_TEXT = "def warm_up(x):\n    return x + 1\n\ndef warm_up(x):"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEF_START = re.compile(r"^def \w+\(.*\):[ \t]*$")


# ---------------------------------------------------------------------------------------------- options
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specserve.bench.bench_ngram", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="demo", help="target (default: the code family's target)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="both engines (float32 default: bf16 verification can flip near-ties)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lookup-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    p.add_argument("--min-func-chars", type=int, default=200, help="repetitive set: shortest function copied")
    p.add_argument("--max-func-chars", type=int, default=900, help="repetitive set: longest function copied")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--always-speculate", action="store_true",
                   help="NGRAM speculates on every step (--disable-speculative-auto-off); default: the engine's "
                        "batch-aware policy, which runs plain steps where speculation measures slower")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_new_tokens", "lookup_tokens", "num_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _log(msg: str) -> None:
    print(f"[bench_ngram] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- prompts
def top_level_functions(text: str) -> list[str]:
    """Source of each module-level ``def`` whose signature fits one line: the def line and its indented body
    (blank lines inside kept, trailing blank lines dropped)."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not DEF_START.match(line):
            continue
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][:1] in (" ", "\t")):
            end += 1
        out.append("\n".join(lines[i:end]).rstrip())
    return out


def repeat_prompt(func: str) -> str:
    """A function, then its first line again: the ideal answer copies the function's body."""
    return f"{func}\n\n\n{func.splitlines()[0]}"


def copied_chars(prompt: str, text: str) -> int:
    """How many leading characters of `text` repeat the body that follows the prompt's last line earlier in the
    prompt (its first occurrence); 0 when that line occurs only once."""
    head, _, last = prompt.rpartition("\n")
    start = head.find(last)
    if start < 0:
        return 0
    body = head[start + len(last):]
    return next((i for i, (a, b) in enumerate(zip(body, text, strict=False)) if a != b), min(len(body), len(text)))


def pick_spread(items: list, n: int) -> list:
    """n items spread evenly over the list (all of them when it holds at most n)."""
    step = max(1, len(items) // n)
    return items[::step][:n]


def repetitive_prompts(n: int, min_chars: int, max_chars: int) -> list[str]:
    from specserve.train.corpus import read_text, stdlib_files

    funcs = [f for path in stdlib_files(held_out=True) for f in top_level_functions(read_text(path) or "")
             if min_chars <= len(f) <= max_chars]
    if not funcs:
        raise RuntimeError("no held-out function fits the length bounds")
    return [repeat_prompt(f) for f in pick_spread(funcs, n)]


def prompt_sets(args: argparse.Namespace) -> dict[str, list[str]]:
    from specserve.train.corpus import held_out_prompts

    return {"repetitive": repetitive_prompts(args.num_prompts, args.min_func_chars, args.max_func_chars),
            "open-ended": held_out_prompts(args.num_prompts)}


# ---------------------------------------------------------------------------------------------- engines
@dataclass
class Tally:
    """One engine's timed pass over one prompt set."""

    seconds: float = 0.0
    tokens: int = 0
    verify_steps: int = 0  # specserve NGRAM only
    plain_tokens: int = 0  # specserve: tokens of plain steps batch-aware speculation ran (not in the accept length)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
                "verify_steps": self.verify_steps, "plain_tokens": self.plain_tokens}

    @property
    def accept_length(self) -> float:
        return (self.tokens - self.plain_tokens) / self.verify_steps if self.verify_steps else 0.0


RunFn = Callable[[list[int]], tuple[list[int], int, int]]  # prompt ids -> (generated ids, verify steps, plain tokens)


def ours_runner(engine, max_new_tokens: int, temperature: float = 0.0) -> RunFn:
    """specserve on one prompt; sampled (temperature > 0) with a seed taken from the prompt's ids, so every engine
    given the same prompt generates the same tokens (plain and speculative decoding alike)."""
    params = {"temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": True}

    def run(ids: list[int]) -> tuple[list[int], int, int]:
        seeded = {**params, "seed": zlib.crc32(str(ids).encode())} if temperature > 0 else params
        out = engine.generate(input_ids=ids, sampling_params=seeded)
        meta = out["meta_info"]
        return out["output_ids"], meta.get("spec_verify_ct", 0), meta.get("spec_plain_tokens", 0)

    return run


def ours_prepare(engine) -> Callable[[], None]:
    """The untimed step before each specserve run: flush the prefix cache, so every prompt is prefilled in full
    (as in transformers)."""
    from specserve.bench.harness import flush_prefix_cache

    return lambda: flush_prefix_cache(engine)


def hf_runner(model, pad_id: int, max_new_tokens: int, lookup_tokens: int | None = None,
              assistant=None, temperature: float = 0.0) -> RunFn:
    """transformers ``generate`` on one prompt, greedy or sampled (temperature > 0): plain, prompt lookup
    (``lookup_tokens``) or assisted generation (``assistant``: a draft LM with the target's tokenizer)."""
    extra: dict = {"do_sample": False}
    if temperature > 0:
        extra = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    if lookup_tokens is not None:
        extra["prompt_lookup_num_tokens"] = lookup_tokens
    if assistant is not None:
        extra["assistant_model"] = assistant

    def run(ids: list[int]) -> tuple[list[int], int, int]:
        x = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, L]
        with torch.inference_mode():
            out = model.generate(  # [1, L + max_new_tokens]; eos_token_id=None: never stops early
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                eos_token_id=None, pad_token_id=pad_id, **extra)
        return out[0, x.shape[1]:].tolist(), 0, 0

    return run


def timed(run: RunFn, ids: list[int], tally: Tally, prepare: Callable[[], None] | None = None) -> None:
    """prepare() (untimed), then one timed run added to the tally."""
    if prepare is not None:
        prepare()
    start = time.perf_counter()
    out, verify, plain_tokens = run(ids)
    tally.seconds += time.perf_counter() - start
    tally.tokens += len(out)
    tally.verify_steps += verify
    tally.plain_tokens += plain_tokens
    tally.outputs.append(out)


def run_set(runners: dict[str, RunFn], prompts: list[list[int]], warmup: list[int],
            prepare: dict[str, Callable[[], None]] | None = None, desc: str | None = None) -> dict[str, Tally]:
    """Warm every engine up, then each prompt through the engines in turn (a, b, c, d, a, b, ...), each run
    preceded by its engine's untimed prepare step if it has one; a progress bar over the prompts when desc."""
    prepare = prepare or {}
    for run in runners.values():
        run(warmup)
    tallies = {name: Tally() for name in runners}
    for ids in tqdm(prompts, desc=desc, disable=desc is None, leave=False):
        for name, run in runners.items():
            timed(run, ids, tallies[name], prepare.get(name))
    return tallies


# ---------------------------------------------------------------------------------------------- figures
def equal_count(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def summarize_set(name: str, tallies: dict[str, Tally], texts: list[str], copied: list[int] | None) -> dict:
    """The figures of one prompt set (JSON-ready)."""
    t = {k: tallies[k] for k in ENGINES}
    tps = {k: v.tokens_per_s for k, v in t.items()}
    ngram = t["ours_ngram"]
    return {
        "set": name, "num_prompts": len(texts),
        "engines": {k: v.to_json() for k, v in t.items()},
        "tokens_per_s": tps,
        "speedup_ngram_over_ours_plain": tps["ours_ngram"] / tps["ours_plain"],
        "speedup_hf_lookup_over_hf_plain": tps["hf_lookup"] / tps["hf_plain"],
        "ngram_over_hf_lookup": tps["ours_ngram"] / tps["hf_lookup"],
        "ours_plain_over_hf_plain": tps["ours_plain"] / tps["hf_plain"],
        "ngram_accept_length": ngram.accept_length,
        "ngram_equals_ours_plain": equal_count(ngram.outputs, t["ours_plain"].outputs),
        "hf_lookup_equals_hf_plain": equal_count(t["hf_lookup"].outputs, t["hf_plain"].outputs),
        "ours_plain_equals_hf_plain": equal_count(t["ours_plain"].outputs, t["hf_plain"].outputs),
        "copied_chars": copied,
    }


def format_table(report: dict) -> str:
    """Readable table of the report's sets (pure)."""
    s = report["setup"]
    lines = [
        f"NGRAM vs transformers prompt lookup: {s['model_path']}, {s['dtype']}, batch 1, temperature 0, "
        f"{s['max_new_tokens']} new tokens/prompt, {s['num_threads']} threads",
        f"ours NGRAM: default ngram flags (num_draft_tokens {s['ngram_num_draft_tokens']}, match "
        f"{s['ngram_match_type']}, windows {s['ngram_min_window']}-{s['ngram_max_window']}, branch length "
        f"{s['ngram_branch_length']}); HF: prompt_lookup_num_tokens={s['lookup_tokens']}",
        "",
        f"{'set':<12}{'n':>3}{'ours plain':>12}{'ours NGRAM':>12}{'HF plain':>10}{'HF lookup':>11}"
        f"{'NGRAM/plain':>13}{'HFlook/HF':>11}{'NGRAM/HFlook':>14}{'accept len':>12}{'NGRAM==plain':>14}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in report["sets"]:
        tps = r["tokens_per_s"]
        lines.append(
            f"{r['set']:<12}{r['num_prompts']:>3}{tps['ours_plain']:>12.1f}{tps['ours_ngram']:>12.1f}"
            f"{tps['hf_plain']:>10.1f}{tps['hf_lookup']:>11.1f}{r['speedup_ngram_over_ours_plain']:>12.2f}x"
            f"{r['speedup_hf_lookup_over_hf_plain']:>10.2f}x{r['ngram_over_hf_lookup']:>13.2f}x"
            f"{r['ngram_accept_length']:>12.2f}{r['ngram_equals_ours_plain']:>9}/{r['num_prompts']:<4}")
    lines.append("tokens/s = generated tokens / summed wall time of the generate calls (prefill included)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def load_engines(args: argparse.Namespace, threads: int):
    """-> (ours plain, ours NGRAM, HF model, HF pad id)."""
    from specserve import Engine
    from specserve.bench.harness import load_hf

    common = dict(model_path=args.model_path, dtype=args.dtype, log_level="warning", num_threads=threads)
    plain = Engine(**common)
    ngram = Engine(**common, speculative_algorithm="NGRAM", disable_speculative_auto_off=args.always_speculate)
    hf_model, pad_id = load_hf(plain.scheduler.runner.model_dir, args.dtype)
    return plain, ngram, hf_model, pad_id


def setup_info(args: argparse.Namespace, ngram_engine, threads: int) -> dict:
    a = ngram_engine.server_args
    return {"model_path": a.model_path, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "lookup_tokens": args.lookup_tokens, "num_threads": threads,
            "ngram_num_draft_tokens": a.speculative_num_draft_tokens,
            "ngram_match_type": a.speculative_ngram_match_type,
            "ngram_min_window": a.speculative_ngram_min_match_window_size,
            "ngram_max_window": a.speculative_ngram_max_match_window_size,
            "ngram_branch_length": a.speculative_ngram_branch_length}


def bench_set(name: str, texts: list[str], args: argparse.Namespace, threads: int) -> tuple[dict, dict]:
    """Fresh engines (so NGRAM's trie starts empty), one interleaved pass over the set -> (summary, setup)."""
    _log(f"{name}: {len(texts)} prompts x 4 engines ...")
    plain, ngram, hf_model, pad_id = load_engines(args, threads)
    try:
        encode = plain.tokenizer.encode
        prompts = [encode(t, add_special_tokens=True) for t in texts]
        runners = {"ours_plain": ours_runner(plain, args.max_new_tokens),
                   "ours_ngram": ours_runner(ngram, args.max_new_tokens),
                   "hf_plain": hf_runner(hf_model, pad_id, args.max_new_tokens, None),
                   "hf_lookup": hf_runner(hf_model, pad_id, args.max_new_tokens, args.lookup_tokens)}
        prepare = {"ours_plain": ours_prepare(plain), "ours_ngram": ours_prepare(ngram)}
        tallies = run_set(runners, prompts, encode(WARMUP_TEXT, add_special_tokens=True), prepare, desc=name)
        copied = None
        if name == "repetitive":
            outs = [plain.tokenizer.decode(o, skip_special_tokens=True) for o in tallies["ours_plain"].outputs]
            copied = [copied_chars(t, o) for t, o in zip(texts, outs, strict=True)]
        return summarize_set(name, tallies, texts, copied), setup_info(args, ngram, threads)
    finally:
        plain.shutdown()
        ngram.shutdown()


def main(argv: list[str] | None = None) -> dict:
    import transformers

    from specserve.bench.harness import all_cores, write_json

    args = parse_args(argv)
    threads = args.num_threads or all_cores()
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    report: dict = {"sets": []}
    for name, texts in prompt_sets(args).items():
        summary, report["setup"] = bench_set(name, texts, args, threads)
        report["sets"].append(summary)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()

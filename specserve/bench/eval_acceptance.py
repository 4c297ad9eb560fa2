"""``specserve eval-acceptance``: how well a draft is accepted by a target, and what it buys, in one run.

    specserve eval-acceptance --model-path TARGET --speculative-algorithm EAGLE \\
        --speculative-draft-model-path DRAFT --speculative-num-steps 3 --speculative-eagle-topk 1 \\
        --speculative-num-draft-tokens 4 --prompts held-out --num-prompts 16 --max-new-tokens 64 [--json OUT]

The same prompts go through a plain Engine first (the same server flags with every ``--speculative-*`` flag at
its default), then through the speculative one; each engine is warmed up on a fixed short prompt, its prefix
cache flushed, and timed over all prompts, ``--batch-size`` prompts per ``generate`` call. Printed: accept length
(generated tokens / verify steps), the acceptance rate per draft position (verify steps that accepted at least k
drafted tokens / verify steps; see ``specserve.speculative.accept_stats``), tokens/s of both engines (completion tokens
/ wall time of the generate calls, prefill included), their ratio, and at temperature 0 how many prompts got
the same text as plain decoding (all of them, for a lossless engine).

``--prompts held-out`` takes the target family's held-out prompts: for SmolLM2 (``--model-path smollm2``) the chat
requests its heads' training data left out (``smollm2-held-out.jsonl``, in its chat template); for the code family
``specserve.train.corpus.held_out_prompts`` (code from standard-library modules that training never sees).
``--prompts FILE`` reads one prompt per line, or a ``.jsonl`` file with a "prompt" or "text" string per record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass

from specserve.config import ConfigError, ServerArgs
from specserve.speculative.accept_stats import accept_length, position_rates, sum_counts

HELD_OUT = "held-out"
DEFAULT_HELD_OUT_PROMPTS = 16
WARMUP_PROMPT = "def warm_up(x):"
WARMUP_TOKENS = 4


@dataclass
class RunResult:
    """One engine's timed pass over the prompts."""

    texts: list[str]
    metas: list[dict]  # meta_info per prompt
    seconds: float  # wall time of the generate calls
    info: dict = dataclasses.field(default_factory=dict)  # the engine's get_server_info() after the run

    @property
    def completion_tokens(self) -> int:
        return sum(m["completion_tokens"] for m in self.metas)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------- prompts
def load_prompts(source: str, num_prompts: int | None = None, model_path: str | None = None) -> list[str]:
    """``held-out`` -> the held-out prompts of the target's family (16 unless num_prompts): for SmolLM2 the chat
    requests its training data left out, rendered with its chat template; otherwise held-out code. Else a prompt
    file (first num_prompts)."""
    if source == HELD_OUT:
        return held_out_prompts_for(model_path, num_prompts or DEFAULT_HELD_OUT_PROMPTS)
    prompts = read_prompt_file(source)
    if not prompts:
        raise ValueError(f"--prompts: {source} holds no prompt")
    return prompts[:num_prompts] if num_prompts else prompts


def held_out_prompts_for(model_path: str | None, n: int) -> list[str]:
    """The held-out evaluation prompts of a target's family: SmolLM2's held-out chat requests in its chat template,
    else held-out code (``train.corpus.held_out_prompts``)."""
    from specserve.demo_models import is_smollm2, smollm2_held_out_prompts

    if model_path is not None and is_smollm2(model_path):
        return smollm2_held_out_prompts(n)
    from specserve.train.corpus import held_out_prompts

    return held_out_prompts(n)


def read_prompt_file(path: str) -> list[str]:
    """Non-empty lines of a text file, or the "prompt" / "text" field of each record of a ``.jsonl`` file."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\r\n") for line in f]
    if not path.endswith(".jsonl"):
        return [line for line in lines if line.strip()]
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = json.loads(line)
        text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"--prompts: {path} line {n}: expected a JSON object with a \"prompt\" or \"text\" string")
        prompts.append(text)
    return prompts


# ---------------------------------------------------------------------------------------------- runs
def plain_args(args: ServerArgs) -> ServerArgs:
    """The same server arguments with every speculative flag at its default (no speculation)."""
    spec = {f.name: f.default for f in dataclasses.fields(ServerArgs) if f.name.startswith("speculative_")}
    return dataclasses.replace(args, **spec)


def run_engine(args: ServerArgs, prompts: list[str], params: dict, batch_size: int) -> RunResult:
    """Load an engine, warm it up, flush its prefix cache, then time `prompts` in groups of batch_size."""
    from specserve.bench.harness import flush_prefix_cache
    from specserve.engine import Engine

    with Engine(**dataclasses.asdict(args)) as engine:
        engine.generate(WARMUP_PROMPT, {**params, "max_new_tokens": WARMUP_TOKENS})
        flush_prefix_cache(engine)
        outs, seconds = [], 0.0
        for i in range(0, len(prompts), batch_size):
            start = time.perf_counter()
            outs += engine.generate(prompts[i : i + batch_size], params)
            seconds += time.perf_counter() - start
        info = engine.get_server_info()
    return RunResult([o["text"] for o in outs], [o["meta_info"] for o in outs], seconds, info)


# ---------------------------------------------------------------------------------------------- report
def summarize(plain: RunResult, spec: RunResult, setup: dict) -> dict:
    """The figures of one evaluation (JSON-ready): setup fields, acceptance, speed, greedy agreement."""
    verify = sum(m.get("spec_verify_ct", 0) for m in spec.metas)
    counts = sum_counts([m.get("spec_accept_per_position", []) for m in spec.metas])
    greedy = setup.get("temperature", 0.0) == 0.0
    return {
        **setup,
        "num_prompts": len(spec.texts),
        "verify_steps": verify,
        "accept_length": accept_length(spec.metas),
        "accepted_per_position": counts,
        "accept_rate_per_position": position_rates(counts, verify),
        "plain_tokens": plain.completion_tokens,
        "plain_seconds": plain.seconds,
        "plain_tokens_per_s": plain.tokens_per_s,
        "spec_tokens": spec.completion_tokens,
        "spec_seconds": spec.seconds,
        "spec_tokens_per_s": spec.tokens_per_s,
        "speedup": spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
        "greedy_match": sum(a == b for a, b in zip(plain.texts, spec.texts, strict=True)) if greedy else None,
    }


def format_table(s: dict) -> str:
    """A readable report of summarize()'s dict."""
    match = "n/a (sampled)" if s["greedy_match"] is None else f"{s['greedy_match']}/{s['num_prompts']}"
    lines = [
        f"speculative decoding: {s['algorithm']}  (steps {s['num_steps']}, topk {s['eagle_topk']}, "
        f"draft tokens {s['num_draft_tokens']})",
        f"prompts: {s['prompts']} x {s['num_prompts']}, batch {s['batch_size']}, max new tokens "
        f"{s['max_new_tokens']}, temperature {s['temperature']}",
        "",
        f"{'':<22}{'plain':>12}{'speculative':>14}",
        f"{'tokens':<22}{s['plain_tokens']:>12}{s['spec_tokens']:>14}",
        f"{'time (s)':<22}{s['plain_seconds']:>12.2f}{s['spec_seconds']:>14.2f}",
        f"{'tokens/s':<22}{s['plain_tokens_per_s']:>12.1f}{s['spec_tokens_per_s']:>14.1f}",
        f"{'speed-up':<22}{'':>12}{s['speedup']:>13.2f}x",
        f"{'verify steps':<22}{'':>12}{s['verify_steps']:>14}",
        f"{'accept length':<22}{'':>12}{s['accept_length']:>14.2f}",
        f"{'greedy outputs equal':<22}{'':>12}{match:>14}",
        "",
        "accept rate per draft position (verify steps that accepted >= k drafted tokens / verify steps):",
        f"{'position':<10}" + "".join(f"{k:>7}" for k in range(1, len(s["accept_rate_per_position"]) + 1)),
        f"{'rate':<10}" + "".join(f"{r:>7.3f}" for r in s["accept_rate_per_position"]),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- command
def parse_args(argv: list[str]) -> argparse.Namespace:
    from specserve.args import add_server_args

    p = argparse.ArgumentParser(prog="specserve eval-acceptance",
                                description="Acceptance and speed of speculative decoding vs plain decoding.")
    g = p.add_argument_group("evaluation")
    g.add_argument("--prompts", default=HELD_OUT, help="'held-out' (the target family's held-out prompts: chat "
                   "requests for SmolLM2, code otherwise) or a file: one prompt per line, or .jsonl with a "
                   "\"prompt\"/\"text\" field (default: held-out)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts to use (default: {DEFAULT_HELD_OUT_PROMPTS} held-out ones, or the whole file)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (default: 1)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens per prompt")
    g.add_argument("--json", default=None, metavar="OUT", help="also write the figures to this JSON file")
    add_server_args(p)
    return p.parse_args(argv)


def check_args(ns: argparse.Namespace, args: ServerArgs) -> None:
    if args.model_path is None:
        raise ConfigError("--model-path is required")
    if args.speculative_algorithm is None:
        raise ConfigError("--speculative-algorithm is required (the run compares it with plain decoding)")
    for name in ("num_prompts", "max_new_tokens", "batch_size"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ns.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {ns.temperature}")


def evaluate(ns: argparse.Namespace, args: ServerArgs) -> dict:
    prompts = load_prompts(ns.prompts, ns.num_prompts, args.model_path)
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "ignore_eos": ns.ignore_eos}
    plain = run_engine(plain_args(args), prompts, params, ns.batch_size)
    # acceptance is measured on speculative steps only: batch-aware auto-off would run a poor draft's steps plain
    spec = run_engine(dataclasses.replace(args, disable_speculative_auto_off=True), prompts, params, ns.batch_size)
    setup = {"model_path": args.model_path, "algorithm": args.speculative_algorithm,
             "draft_model_path": args.speculative_draft_model_path,
             "num_steps": spec.info.get("speculative_num_steps", args.speculative_num_steps),
             "eagle_topk": spec.info.get("speculative_eagle_topk", args.speculative_eagle_topk),
             "num_draft_tokens": spec.info.get("speculative_num_draft_tokens", args.speculative_num_draft_tokens),
             "dtype": args.dtype,
             "prompts": ns.prompts, "batch_size": ns.batch_size, "max_new_tokens": ns.max_new_tokens,
             "temperature": ns.temperature, "ignore_eos": ns.ignore_eos}
    return summarize(plain, spec, setup)


def main(argv: list[str]) -> int:
    from specserve.args import server_args_from
    from specserve.models.loader import ModelLoadError

    ns = parse_args(argv)
    try:
        args = server_args_from(ns)
        check_args(ns, args)
        summary = evaluate(ns, args)
    except (ConfigError, ValueError, OSError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(summary))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0

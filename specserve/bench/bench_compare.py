"""``specserve bench-compare``: specserve vs transformers and llama.cpp on the same model and prompts, side by side
in one run.

    specserve bench-compare [--model-path demo] [--draft-model-path DRAFT] [--eagle3-path HEAD]
        [--eagle-path HEAD] [--eagle-token-map FILE|none]
        [--num-prompts 8] [--max-new-tokens 128] [--dtype float32] [--lookup-tokens 10]
        [--only plain,llamacpp,assisted,eagle,eagle3,standalone,lookup,ngram] [--num-threads N] [--out-dir DIR]
        [--eagle3-tree S,K,N] [--draft-stop-threshold P] [--rounds R] [--llamacpp-gguf FILE]
        [--torchao-config int8wo|int4wo-<group> | --quantization gguf]

Batch 1, greedy (temperature 0) unless ``--temperature`` samples, exactly ``--max-new-tokens`` per prompt on both
sides (specserve ``ignore_eos``; transformers ``eos_token_id=None``, so neither stops early nor masks EOS), the same
prompt token ids, the same dtype and thread count for both engines. Configurations, in the order each prompt runs
through them (so drift of a shared machine hits all alike), each compared with its counterpart:

    transformers plain generate                      <- specserve plain decoding
    transformers assisted generation (the draft LM)  <- specserve EAGLE-2 and EAGLE-3 (their heads; EAGLE-2 with the
                                                        FR-Spec map of a bundled head) and specserve STANDALONE (the
                                                        same draft LM); transformers cannot run an EAGLE head
    transformers prompt lookup (N tokens)            <- specserve NGRAM
    specserve plain decoding                         <- specserve plain decoding and EAGLE-3 of the target quantized
                                                        by --torchao-config, or of the GGUF file's own 4-bit blocks
                                                        (--quantization gguf) (rows quant, eagle3-quant; their greedy
                                                        agreement with our unquantized plain decoding is reported)

and every row with llama.cpp's plain decoding of the same model at 16-bit weights (``bench.llamacpp``: the target's
GGUF file dequantized to F16), the CPU anchor; llama.cpp on the GGUF file itself (its own quantization) runs too.
The llama.cpp rows need a GGUF target (or ``--llamacpp-gguf``) and the ``llama-cpp-python`` package; by default
they are left out, with a note, where either is missing.

Our speculative flags stay at the engine's defaults unless ``--eagle3-tree`` / ``--draft-stop-threshold`` set them
(the resolved tree is printed); transformers' assisted
generation keeps its defaults too. Every engine is warmed up first; specserve's prefix cache is flushed (untimed)
before each prompt. tokens/s = generated tokens / summed wall time of the generate calls (prefill included).
With ``--rounds R`` the whole prompt set runs R times (each round as above); tokens/s is over all rounds, and each
ratio is the median of the R per-round ratios, which are listed too: on a shared machine one slow round then
moves the figure less, and the spread shows how far a single round can be trusted.
Written to ``--out-dir``: ``results.jsonl`` (one row per configuration), ``table.md`` and ``speedup.png`` (the
speed-up ratios).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from specserve.bench.report import format_table, plot_bars, report_missing_extra, write_jsonl
from specserve.demo_models import bundled_drafter

SELECTABLE = ("plain", "llamacpp", "assisted", "eagle", "eagle3", "standalone", "lookup", "ngram", "quant",
              "eagle3-quant")
QUANT_SELECT = ("quant", "eagle3-quant")  # the rows with --torchao-config's quantized target (need that flag)
DTYPES = ("float32", "bfloat16")
WARMUP_TEXT = "def warm_up(x):\n    return x + 1\n\ndef warm_up(x):"
KV_MARGIN = 64  # KV slots beyond prompt + new tokens: room for a verify step's draft tokens (at least)


@dataclass(frozen=True)
class Config:
    """One measured configuration: its engine, what --only calls it, and which rows its ratios refer to."""

    name: str
    engine: str  # "specserve" | "transformers"
    label: str
    select: str  # its --only name
    versus: str | None = None  # the transformers configuration it is compared with
    plain: str | None = None  # the same engine's plain decoding (for the speculative ones)


CONFIGS = (
    Config("hf_plain", "transformers", "HF plain", "plain"),
    Config("ours_plain", "specserve", "ours plain", "plain", versus="hf_plain"),
    Config("llamacpp_f16", "llama.cpp", "llama.cpp 16-bit", "llamacpp"),
    Config("llamacpp_quant", "llama.cpp", "llama.cpp quantized", "llamacpp"),
    Config("hf_assisted", "transformers", "HF assisted", "assisted", plain="hf_plain"),
    Config("ours_eagle", "specserve", "ours EAGLE-2", "eagle", versus="hf_assisted", plain="ours_plain"),
    Config("ours_eagle3", "specserve", "ours EAGLE-3", "eagle3", versus="hf_assisted", plain="ours_plain"),
    Config("ours_standalone", "specserve", "ours STANDALONE", "standalone", versus="hf_assisted", plain="ours_plain"),
    Config("hf_lookup", "transformers", "HF lookup", "lookup", plain="hf_plain"),
    Config("ours_ngram", "specserve", "ours NGRAM", "ngram", versus="hf_lookup", plain="ours_plain"),
    # --torchao-config: plain decoding of the quantized target against the unquantized one, and EAGLE-3 over it
    Config("ours_quant", "specserve", "ours plain, quantized", "quant", plain="ours_plain"),
    Config("ours_eagle3_quant", "specserve", "ours EAGLE-3, quantized", "eagle3-quant", plain="ours_quant"),
)
BY_NAME = {c.name: c for c in CONFIGS}
ENGINE_ALGORITHM = {"ours_plain": None, "ours_eagle": "EAGLE", "ours_eagle3": "EAGLE3", "ours_standalone": "STANDALONE",
                    "ours_ngram": "NGRAM", "ours_quant": None, "ours_eagle3_quant": "EAGLE3"}
QUANTIZED = {"ours_quant", "ours_eagle3_quant"}

TABLE_COLUMNS = (
    ("label", "config", None), ("tokens", "tokens", None), ("seconds", "time (s)", ".2f"),
    ("tokens_per_s", "tok/s", ".1f"), ("ratio_vs_plain", "vs own plain", ".2f"),
    ("versus_label", "compared with", None), ("ratio_vs_versus", "vs transformers", ".2f"),
    ("ratio_vs_llamacpp", "vs llama.cpp 16-bit", ".2f"), ("accept_length", "accept len", ".2f"),
    ("equal", "equal to HF plain", None), ("equal_ours", "equal to ours plain", None),
)
LLAMACPP_ANCHOR = "llamacpp_f16"
LLAMACPP_CONFIGS = {"llamacpp_f16", "llamacpp_quant"}
ROUND_COLUMNS = (("plain_rounds", "vs own plain, each round", None), ("versus_rounds", "vs transformers, each round",
                                                                     None),
                 ("llamacpp_rounds", "vs llama.cpp 16-bit, each round", None))


# ---------------------------------------------------------------------------------------------- options
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # -> exit status 2 with the message (argparse's own messages name the flag)
        self.print_usage(sys.stderr)
        raise _BadFlag(message)


class _BadFlag(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specserve bench-compare", description=__doc__.split("\n")[0].split(": ", 1)[-1])
    p.add_argument("--model-path", default="demo", help="target (default: the code family's target)")
    p.add_argument("--draft-model-path", default=None,
                   help="draft LM for transformers' assisted generation and our STANDALONE (same tokenizer; default: "
                        "the bundled draft of the target: smollm2-draft for smollm2, else demo-draft)")
    p.add_argument("--eagle3-path", default=None,
                   help="EAGLE-3 head for our EAGLE3 (default: the bundled head of the target: smollm2-eagle3 for "
                        "smollm2, else demo-eagle3)")
    p.add_argument("--eagle-path", default=None,
                   help="EAGLE-2 head for our EAGLE (default: the bundled head of the target: smollm2-eagle for "
                        "smollm2, else demo-eagle)")
    p.add_argument("--eagle-token-map", default=None, metavar="FILE",
                   help="FR-Spec map for our EAGLE (--speculative-token-map; default: the bundled head's own map, "
                        "none for another head; 'none': the head's full vocabulary)")
    p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts (held_out_prompts)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="generated per prompt on both sides")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="both engines (always the same)")
    p.add_argument("--lookup-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    p.add_argument("--only", default=None,
                   help=f"comma list of configurations to run, from {','.join(SELECTABLE)} (default: all; llamacpp "
                        "only where it can run)")
    p.add_argument("--llamacpp-gguf", default=None, metavar="FILE",
                   help="the GGUF file llama.cpp runs (and, dequantized to F16, its 16-bit row); default: the "
                        "target's own GGUF file")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for both (default: torch's)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="our engines compile their decode/verify/draft forwards (graphs are built in the warm-up)")
    p.add_argument("--torch-compile-in-background", action="store_true",
                   help="our engines build their graphs on a background thread (--torch-compile-in-background); "
                        "before the timed rounds each runs the prompts untimed until a pass builds no new graph")
    p.add_argument("--torchao-config", default="", metavar="NAME",
                   help="int8wo or int4wo-<group>: adds the rows quant (our plain decoding of the quantized target, "
                        "against the unquantized one, with its greedy agreement) and eagle3-quant (EAGLE-3 over it)")
    p.add_argument("--quantization", default=None, choices=["gguf"],
                   help="gguf: the rows quant and eagle3-quant run the GGUF target's own 4-bit blocks (the engine's "
                        "--quantization gguf) instead of a --torchao-config quantization")
    p.add_argument("--eagle3-tree", default=None, metavar="S,K,N",
                   help="our EAGLE-3 tree: --speculative-num-steps, --speculative-eagle-topk, "
                        "--speculative-num-draft-tokens (default: the engine's resolution: the bundled heads' tuned "
                        "trees, 5,4,8 for another head on a Llama target)")
    p.add_argument("--draft-stop-threshold", type=float, default=0.0,
                   help="--speculative-draft-stop-threshold of our EAGLE-3 and STANDALONE (default 0: off)")
    p.add_argument("--draft-score-temperature", type=float, default=1.0,
                   help="--speculative-draft-score-temperature of our EAGLE-3 and STANDALONE (default 1: the draft's "
                        "own probabilities)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (default 0: greedy). Our engines give each prompt the same seed, "
                        "so plain and speculative decoding generate the same tokens; transformers samples with "
                        "do_sample; llama.cpp rows are greedy only and are left out")
    p.add_argument("--always-speculate", action="store_true",
                   help="our speculative engines speculate on every step (--disable-speculative-auto-off); default: "
                        "the engine's batch-aware policy, which runs plain steps where speculation measures slower")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole prompt set this many times; ratios are the median of the per-round ratios")
    p.add_argument("--out-dir", default=None, help="default: bench_results/bench-compare-<timestamp>")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parsed and checked flags (raises _BadFlag naming the flag); args.only becomes the selected configs."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_new_tokens", "lookup_tokens", "num_threads", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.torchao_config:
        from specserve.models.quantize import parse_torchao_config

        try:
            args.torchao_config = parse_torchao_config(args.torchao_config).name
        except ValueError as e:
            p.error(str(e))
    args.llamacpp_optional = args.only is None
    args.eagle3_path = args.eagle3_path or bundled_drafter(args.model_path, "eagle3")
    args.draft_model_path = args.draft_model_path or bundled_drafter(args.model_path, "draft")
    args.eagle_path, args.eagle_token_map = eagle_head_and_map(args.model_path, args.eagle_path, args.eagle_token_map)
    if args.torchao_config and args.quantization:
        p.error("--quantization gguf and --torchao-config both quantize the rows quant / eagle3-quant: pass one")
    quantized = bool(args.torchao_config or args.quantization)
    default = [n for n in SELECTABLE if quantized or n not in QUANT_SELECT]  # quantized rows: with a flag
    try:
        args.only = selected_configs(args.only or ",".join(default))
    except ValueError as e:
        p.error(f"--only: {e}")
    if any(c.name in QUANTIZED for c in args.only) and not quantized:
        p.error("--only quant / eagle3-quant need --torchao-config (int8wo, int4wo-<group>) or --quantization gguf")
    if args.eagle3_tree is not None:
        try:
            args.eagle3_tree = parse_tree(args.eagle3_tree)
        except ValueError:
            p.error("--eagle3-tree takes three comma-separated integers S,K,N (e.g. 6,4,16)")
    if args.out_dir is None:
        args.out_dir = f"bench_results/bench-compare-{time.strftime('%Y%m%d-%H%M%S')}"
    return args


def selected_configs(only: str) -> list[Config]:
    """'plain,ngram' -> the configurations those names select, in run order (plain = both plain ones)."""
    names = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(names - set(SELECTABLE))
    if unknown or not names:
        raise ValueError(f"unknown name(s) {unknown}; choose from {','.join(SELECTABLE)}")
    return [c for c in CONFIGS if c.select in names]


def _log(msg: str) -> None:
    print(f"[bench-compare] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- rows
def merge_rounds(rounds: list[dict]) -> dict:
    """Per-round tallies (name -> bench_ngram.Tally) -> one tally per name summed over the rounds, with the first
    round's outputs (greedy: every round generates the same ids)."""
    from specserve.bench.bench_ngram import Tally

    merged = {}
    for name in rounds[0]:
        parts = [r[name] for r in rounds]
        merged[name] = Tally(seconds=sum(t.seconds for t in parts), tokens=sum(t.tokens for t in parts),
                             verify_steps=sum(t.verify_steps for t in parts),
                             plain_tokens=sum(t.plain_tokens for t in parts), outputs=parts[0].outputs)
    return merged


def config_rows(rounds: list[dict], setup: dict) -> list[dict]:
    """One JSON-ready row per measured configuration (rounds: one dict name -> bench_ngram.Tally per round), with
    its ratios and its greedy agreement with transformers plain (sampled: a speculative row's agreement with our plain
    decoding, which had the same seeds)."""
    from specserve.bench.harness import compare_ids

    tallies = merge_rounds(rounds)
    asked = setup["common"]["max_new_tokens"]
    rows = []
    for c in CONFIGS:
        if c.name not in tallies:
            continue
        t = tallies[c.name]
        if t.tokens != len(t.outputs) * asked * len(rounds):
            _log(f"warning: {c.name} generated {t.tokens} tokens, not {asked} per prompt")
        spec = c.engine == "specserve" and c.plain is not None
        row = {"config": c.name, "label": c.label, "engine": c.engine, **setup["common"], **setup.get(c.name, {}),
               "num_prompts": len(t.outputs), "tokens": t.tokens, "seconds": t.seconds,
               "tokens_per_s": t.tokens_per_s,
               "verify_steps": t.verify_steps if spec else None,
               "accept_length": (t.accept_length if t.verify_steps else None) if spec else None,
               "equal_to_hf_plain": None, "first_mismatch_vs_hf_plain": None}
        sampled = setup["common"].get("temperature", 0.0) > 0
        if spec and sampled and "ours_plain" in tallies:  # same seeds: the same tokens as our plain decoding
            row["equal_to_ours_plain"] = compare_ids(t.outputs, tallies["ours_plain"].outputs)["rows_equal"]
        if c.name in QUANTIZED and not sampled and "ours_plain" in tallies:  # the quantized model's greedy agreement
            agree = compare_ids(t.outputs, tallies["ours_plain"].outputs)
            row["equal_to_ours_plain"] = agree["rows_equal"]
            row["first_mismatch_vs_ours_plain"] = agree["first_mismatch"]
        if c.name != "hf_plain" and "hf_plain" in tallies and not sampled:
            agree = compare_ids(t.outputs, tallies["hf_plain"].outputs)
            row["equal_to_hf_plain"] = agree["rows_equal"]
            row["first_mismatch_vs_hf_plain"] = agree["first_mismatch"]
        rows.append(row)
    add_ratios(rows)
    if len(rounds) > 1:
        add_round_ratios(rows, [{name: t.tokens_per_s for name, t in r.items()} for r in rounds])
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Fill each row's ratios from the rows' own tokens_per_s: ratio_vs_versus (vs its transformers counterpart)
    and ratio_vs_plain (vs the same engine's plain decoding); None where that row was not measured."""
    tps = {r["config"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        c = BY_NAME[r["config"]]
        r["versus"] = c.versus
        r["versus_label"] = BY_NAME[c.versus].label if c.versus else None
        r["ratio_vs_versus"] = _ratio(tps, c.name, c.versus)
        r["plain_ref"] = c.plain
        r["ratio_vs_plain"] = _ratio(tps, c.name, c.plain)
        r["ratio_vs_llamacpp"] = _ratio(tps, c.name, llamacpp_anchor(c.name))
    return rows


def llamacpp_anchor(name: str) -> str | None:
    """The config every row's llama.cpp ratio divides by (None for that config itself)."""
    return None if name == LLAMACPP_ANCHOR else LLAMACPP_ANCHOR


def add_round_ratios(rows: list[dict], round_tps: list[dict[str, float]]) -> list[dict]:
    """Several rounds: each ratio becomes the median of its per-round ratios (round_tps: one dict config ->
    tokens/s per round), which are kept in ratio_vs_plain_rounds / ratio_vs_versus_rounds / ratio_vs_llamacpp_rounds."""
    for r in rows:
        for key, den in (("ratio_vs_plain", r["plain_ref"]), ("ratio_vs_versus", r["versus"]),
                         ("ratio_vs_llamacpp", llamacpp_anchor(r["config"]))):
            per_round = [_ratio(tps, r["config"], den) for tps in round_tps]
            if None in per_round:
                continue
            r[key + "_rounds"] = per_round
            r[key] = statistics.median(per_round)
    return rows


def _ratio(tps: dict[str, float], num: str, den: str | None) -> float | None:
    if den is None or den not in tps or not tps[den]:
        return None
    return tps[num] / tps[den]


def speedup_bars(rows: list[dict]) -> tuple[list[str], list[float]]:
    """The bar chart's (labels, ratios): ours vs transformers first, then each engine's speculative vs plain."""
    label = {r["config"]: r["label"] for r in rows}
    versus = [(f"{r['label']} / {label[r['versus']]}", r["ratio_vs_versus"]) for r in rows
              if r["ratio_vs_versus"] is not None]
    own = [(f"{r['label']} / {label[r['plain_ref']]}", r["ratio_vs_plain"]) for r in rows
           if r["ratio_vs_plain"] is not None]
    anchor = [(f"{r['label']} / {label[LLAMACPP_ANCHOR]}", r["ratio_vs_llamacpp"]) for r in rows
              if BY_NAME[r["config"]].engine == "specserve" and r.get("ratio_vs_llamacpp") is not None]
    pairs = versus + anchor + own
    return [p[0] for p in pairs], [p[1] for p in pairs]


def setup_lines(rows: list[dict]) -> list[str]:
    """Header lines: the shared setup and each speculative configuration's resolved parameters."""
    if not rows:
        return []
    r0 = rows[0]
    lines = [f"specserve vs transformers and llama.cpp: target {r0['model_path']}, {r0['dtype']} (specserve and "
             f"transformers), batch 1, temperature {r0.get('temperature', 0):g}, {r0['max_new_tokens']} new tokens x "
             f"{r0['num_prompts']} held-out prompts"
             + (f" x {r0['rounds']} rounds" if r0.get("rounds", 1) > 1 else "") + f", {r0['num_threads']} threads"]
    for r in rows:
        if r.get("speculative_num_steps") is not None:
            lines.append(f"{r['label']}: steps {r['speculative_num_steps']}, topk {r['speculative_eagle_topk']}, "
                         f"draft tokens {r['speculative_num_draft_tokens']} ({r.get('tree_source', 'engine defaults')})"
                         + (f", draft stop threshold {r['speculative_draft_stop_threshold']}"
                            if r.get("speculative_draft_stop_threshold") else "")
                         + (f", draft score temperature {r['speculative_draft_score_temperature']}"
                            if r.get("speculative_draft_score_temperature", 1.0) != 1.0 else "")
                         + (f", draft {r['draft_path']}" if r.get("draft_path") else "")
                         + (f", token map {r['speculative_token_map']}" if r.get("speculative_token_map") else "")
                         + (f" in {r['draft_dtype']}" if r.get("draft_dtype") else ""))
        if r.get("one_row_kernel") is not None:
            k = r["one_row_kernel"]
            lines.append(f"{r['label']}: one-row linears on the {k['kernel']} kernel"
                         + (f" (probe: gemv {k['gemv_ms']} ms, packed {k['packed_ms']} ms a pass)"
                            if k.get("source") == "probe" else f" ({k['source']})"))
        if r.get("draft_fp32_rows") is not None:
            d = r["draft_fp32_rows"]
            lines.append(f"{r['label']}: float32 draft linears in float32 up to {d['fp32_max_rows']} rows, packed bf16 "
                         "above" + (" (probe)" if d.get("source") == "probe" else f" ({d['source']})"))
        if r.get("hf_num_assistant_tokens") is not None:
            lines.append(f"{r['label']}: num_assistant_tokens {r['hf_num_assistant_tokens']} "
                         f"({r['hf_num_assistant_tokens_schedule']}), confidence threshold "
                         f"{r['hf_assistant_confidence_threshold']} (transformers defaults), draft {r['draft_path']}")
        if r.get("gguf_file") is not None:
            lines.append(f"{r['label']}: {r['gguf_file']} ({r['gguf_type']}), llama-cpp-python {r['llamacpp_version']}")
        if r.get("lookup_tokens") is not None:
            lines.append(f"{r['label']}: prompt_lookup_num_tokens={r['lookup_tokens']}")
    return lines


def render(rows: list[dict]) -> str:
    """The printed/written report: setup lines, the table, how tok/s is measured."""
    shown = [{**r, "equal": None if r["equal_to_hf_plain"] is None else f"{r['equal_to_hf_plain']}/{r['num_prompts']}",
              "equal_ours": None if r.get("first_mismatch_vs_ours_plain") is None
              else f"{r['equal_to_ours_plain']}/{r['num_prompts']}",
              "plain_rounds": _listed(r.get("ratio_vs_plain_rounds")),
              "versus_rounds": _listed(r.get("ratio_vs_versus_rounds")),
              "llamacpp_rounds": _listed(r.get("ratio_vs_llamacpp_rounds"))} for r in rows]
    rounds = any(r.get(f"ratio_vs_{k}_rounds") for r in rows for k in ("plain", "versus", "llamacpp"))
    note = ("tok/s = generated tokens / summed wall time of the generate calls (prefill included"
            + ("; all rounds); ratios = the median of the rounds' ratios" if rounds else ")")
            + "; accept len = tokens / verify steps; equal = prompts whose greedy ids equal transformers plain")
    columns = TABLE_COLUMNS + (ROUND_COLUMNS if rounds else ())
    return "\n".join([*setup_lines(rows), "", format_table(shown, columns), "", note])


def _listed(values: list[float] | None) -> str | None:
    return None if not values else ", ".join(f"{v:.2f}" for v in values)


# ---------------------------------------------------------------------------------------------- engines
@dataclass
class Loaded:
    runners: dict = field(default_factory=dict)  # config name -> RunFn
    prepare: dict = field(default_factory=dict)  # config name -> untimed step before each run
    setup: dict = field(default_factory=dict)  # "common" -> fields of every row; config name -> that row's fields
    engines: list = field(default_factory=list)  # specserve Engines to shut down
    closers: list = field(default_factory=list)  # other engines' close functions


def resolve_path(path: str) -> str:
    """A demo name or hub id -> a local folder (as specserve resolves it)."""
    from specserve.demo_models import resolve_demo
    from specserve.models.loader import resolve_model_path

    return resolve_model_path(resolve_demo(path))


def load_all(args: argparse.Namespace, threads: int, kv_tokens: int, loaded: Loaded) -> None:
    """The selected engines on one device into `loaded`: specserve Engines (KV cache of kv_tokens) and
    transformers models, same dtype and threads."""
    from specserve import Engine
    from specserve.bench.bench_ngram import hf_runner, ours_prepare, ours_runner
    from specserve.bench.harness import load_hf
    from specserve.scheduler.model_runner import resolve_device

    device = resolve_device("auto")
    names = {c.name for c in args.only}
    target = resolve_path(args.model_path)
    draft = resolve_path(args.draft_model_path) if names & {"hf_assisted", "ours_standalone"} else None
    head = resolve_path(args.eagle3_path) if names & {"ours_eagle3", "ours_eagle3_quant"} else None
    head2 = resolve_path(args.eagle_path) if "ours_eagle" in names else None
    loaded.setup["common"] = {"model_path": args.model_path, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                              "num_threads": threads, "device": str(device), "rounds": args.rounds,
                              "temperature": args.temperature}
    n = args.max_new_tokens
    drafts = {"ours_eagle": head2, "ours_eagle3": head, "ours_eagle3_quant": head, "ours_standalone": draft}  # folders
    given = {"ours_eagle": args.eagle_path, "ours_eagle3": args.eagle3_path, "ours_eagle3_quant": args.eagle3_path,
             "ours_standalone": args.draft_model_path}  # the rows keep the given names
    for name, algorithm in ENGINE_ALGORITHM.items():
        if name not in names:
            continue
        _log(f"loading {BY_NAME[name].label} ...")
        kw = {"speculative_algorithm": algorithm, "speculative_draft_model_path": drafts.get(name),
              "disable_speculative_auto_off": args.always_speculate} if algorithm else {}
        if algorithm == "EAGLE" and args.eagle_token_map:
            kw["speculative_token_map"] = args.eagle_token_map
        if algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
            kw["speculative_draft_stop_threshold"] = args.draft_stop_threshold
            kw["speculative_draft_score_temperature"] = args.draft_score_temperature
        tree_given = algorithm == "EAGLE3" and args.eagle3_tree is not None
        if tree_given:
            kw.update(zip(("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"),
                          args.eagle3_tree, strict=True))
        if name in QUANTIZED and args.quantization:
            kw["quantization"] = args.quantization
        elif name in QUANTIZED:
            kw["torchao_config"] = args.torchao_config
        engine = Engine(model_path=target, dtype=args.dtype, device=str(device), num_threads=threads,
                        max_total_tokens=kv_tokens, log_level="warning",
                        enable_torch_compile=args.enable_torch_compile,
                        torch_compile_in_background=args.torch_compile_in_background, **kw)
        loaded.engines.append(engine)
        loaded.runners[name], loaded.prepare[name] = ours_runner(engine, n, args.temperature), ours_prepare(engine)
        info = engine.get_server_info()
        loaded.setup[name] = {**spec_setup(info, given.get(name)), **kernel_setup(info)}
        if tree_given:
            loaded.setup[name]["tree_source"] = "--eagle3-tree"
    if names & LLAMACPP_CONFIGS:
        load_llamacpp(args, threads, kv_tokens, loaded)
    if names & {"hf_plain", "hf_assisted", "hf_lookup"}:
        _log("loading transformers models ...")
        model, pad_id = load_hf(target, args.dtype)
        model.to(device)
        if "hf_plain" in names:
            loaded.runners["hf_plain"] = hf_runner(model, pad_id, n, temperature=args.temperature)
        if "hf_lookup" in names:
            loaded.runners["hf_lookup"] = hf_runner(model, pad_id, n, lookup_tokens=args.lookup_tokens,
                                                    temperature=args.temperature)
            loaded.setup["hf_lookup"] = {"lookup_tokens": args.lookup_tokens}
        if "hf_assisted" in names:
            assistant = load_hf(draft, args.dtype)[0].to(device)
            loaded.runners["hf_assisted"] = hf_runner(model, pad_id, n, assistant=assistant,
                                                      temperature=args.temperature)
            loaded.setup["hf_assisted"] = assisted_setup(assistant, args.draft_model_path)
    loaded.runners = {c.name: loaded.runners[c.name] for c in CONFIGS if c.name in loaded.runners}  # run order


def check_llamacpp(args: argparse.Namespace) -> None:
    """Selected llama.cpp rows that cannot run (no llama-cpp-python, no GGUF file): left out with a note when the
    selection was the default, else a ConfigError saying why."""
    from specserve.bench import llamacpp
    from specserve.config import ConfigError

    if not {c.name for c in args.only} & LLAMACPP_CONFIGS:
        return
    problem = None if llamacpp.available() else f"llama-cpp-python is not installed: {llamacpp.INSTALL}"
    if args.temperature > 0:
        problem = "its rows are greedy only (--temperature > 0)"
    if problem is None:
        try:
            args.llamacpp_files = llamacpp.gguf_files(args.model_path, args.llamacpp_gguf)
        except ValueError as e:
            problem = str(e)
    if problem is None:
        return
    if not args.llamacpp_optional:
        raise ConfigError(f"--only llamacpp: {problem}")
    _log(f"leaving the llama.cpp rows out: {problem}")
    args.only = [c for c in args.only if c.name not in LLAMACPP_CONFIGS]


def load_llamacpp(args: argparse.Namespace, threads: int, kv_tokens: int, loaded: Loaded) -> None:
    """llama.cpp on the 16-bit copy and on the GGUF file itself (args.llamacpp_files, from check_llamacpp)."""
    from importlib.metadata import version

    from specserve.bench import llamacpp

    _log("loading llama.cpp ...")
    names = {c.name for c in args.only}
    for name, path in args.llamacpp_files.items():
        if name not in names:
            continue
        llm = llamacpp.load(path, threads, kv_tokens)
        loaded.closers.append(llm.close)
        loaded.runners[name] = llamacpp.runner(llm, args.max_new_tokens)
        loaded.prepare[name] = llamacpp.prepare(llm)
        loaded.setup[name] = {"gguf_file": path, "gguf_type": llamacpp.file_type(path),
                              "llamacpp_version": version("llama-cpp-python")}


def spec_setup(info: dict, draft_path: str | None) -> dict:
    """Our speculative configuration as the engine resolved it (its get_server_info)."""
    if "speculative_algorithm" not in info:
        return {}
    return {"speculative_algorithm": info["speculative_algorithm"], "draft_path": draft_path,
            "speculative_num_steps": info["speculative_num_steps"],
            "speculative_eagle_topk": info["speculative_eagle_topk"],
            "speculative_num_draft_tokens": info["speculative_num_draft_tokens"],
            "speculative_draft_stop_threshold": info.get("speculative_draft_stop_threshold"),
            "speculative_draft_score_temperature": info.get("speculative_draft_score_temperature"),
            "speculative_token_map": info.get("speculative_token_map"),
            "draft_dtype": info.get("speculative_draft_dtype")}


def eagle_head_and_map(model_path: str, head: str | None, token_map: str | None) -> tuple[str, str | None]:
    """--eagle-path / --eagle-token-map as given, or the target's bundled EAGLE-2 head with its FR-Spec map (a head
    other than a bundled one gets no map unless one is given; 'none' turns the map off)."""
    bundled = bundled_drafter(model_path, "eagle")
    head = head or bundled
    if token_map is None:
        token_map = bundled_drafter(model_path, "token-map") if head == bundled else None
    return head, None if token_map == "none" else token_map


def kernel_setup(info: dict) -> dict:
    """The one-row kernel the engine's packed target runs on (``platform/cpu/one_row_probe.py``), where it has one,
    the few-row kernel's prefetch verdict (``small_gemm.choose_prefetch``), and a float32 draft's float32 / bf16
    crossover (``platform/cpu/mixed_probe.py``) (info: its get_server_info)."""
    verdicts = info.get("cpu_one_row_kernel") or {}
    setup = {"one_row_kernel": next(iter(verdicts.values()))} if verdicts else {}
    prefetch = [v["prefetch"] for v in (info.get("cpu_small_gemm") or {}).values() if "prefetch" in v]
    if prefetch:  # the few-row kernel's software prefetch (small_gemm.choose_prefetch)
        setup["small_gemm_prefetch"] = prefetch[0]
    if info.get("cpu_draft_fp32_rows"):
        setup["draft_fp32_rows"] = {k: v for k, v in info["cpu_draft_fp32_rows"].items()
                                    if k in ("fp32_max_rows", "source")}
    if info.get("gguf_linears"):  # --quantization gguf: linears on the file's 4-bit blocks / dense
        setup["gguf_linears"] = info["gguf_linears"]
    return setup


def assisted_setup(assistant, draft_path: str) -> dict:
    """transformers' assisted-generation parameters as generate will use them (unset ones take its defaults)."""
    from transformers import GenerationConfig

    g, defaults = assistant.generation_config, GenerationConfig._get_default_generation_params()

    def value(key: str):
        v = getattr(g, key, None)
        return defaults.get(key) if v is None else v

    return {"draft_path": draft_path, "hf_num_assistant_tokens": value("num_assistant_tokens"),
            "hf_num_assistant_tokens_schedule": value("num_assistant_tokens_schedule"),
            "hf_assistant_confidence_threshold": value("assistant_confidence_threshold")}


# ---------------------------------------------------------------------------------------------- command
def held_out_inputs(model_path: str, num_prompts: int) -> tuple[list[list[int]], list[int]]:
    """The first num_prompts held-out requests of the model's family and the warm-up prompt, as token ids."""
    import transformers

    from specserve.bench.eval_acceptance import held_out_prompts_for

    encode = transformers.AutoTokenizer.from_pretrained(resolve_path(model_path)).encode
    prompts = [encode(t, add_special_tokens=True) for t in held_out_prompts_for(model_path, num_prompts)]
    return prompts, encode(WARMUP_TEXT, add_special_tokens=True)


def parse_tree(text: str) -> tuple[int, int, int]:
    """"S,K,N" (draft steps, top-k, draft tokens) -> (S, K, N); ValueError for anything but three integers."""
    values = tuple(int(v) for v in text.split(","))
    if len(values) != 3:
        raise ValueError(f"{text!r} is not three integers")
    return values


def tree_kv_margin(tree: tuple[int, int, int] | None) -> int:
    """KV slots beyond prompt + new tokens for a draft tree (steps, top-k, draft tokens), None: the default trees: a
    speculative step holds a request's verify nodes and drafting scratch (N + K x (S - 1), see
    Proposer.draft_slots_per_request) on top of its tokens; a request that cannot get them alone is failed, which would
    cut its output short."""
    if tree is None:
        return KV_MARGIN
    steps, topk, tokens = tree
    return max(KV_MARGIN, tokens + topk * steps + 1)


def build_graphs(loaded: Loaded, prompts: list[list[int]]) -> None:
    """--torch-compile-in-background: each of our engines runs the prompts untimed until a pass builds no new graph
    (``harness.build_background_graphs``), so the timed rounds meet built graphs only."""
    from specserve.bench.harness import build_background_graphs, flush_prefix_cache

    params = {"max_new_tokens": 32, "temperature": 0.0}
    for engine in loaded.engines:
        def run_pass(engine=engine) -> None:
            for p in prompts:
                engine.generate(input_ids=p, sampling_params=params)

        for i, graphs in enumerate(build_background_graphs(engine, run_pass)):
            _log(f"graph build pass {i + 1}: {graphs} graphs")
        flush_prefix_cache(engine)


def run_bench(args: argparse.Namespace) -> list[dict]:
    """Tokenize, load, warm up, run every prompt through the configurations in turn -> the rows."""
    import transformers

    from specserve.bench.bench_ngram import run_set

    threads = args.num_threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    prompts, warmup = held_out_inputs(args.model_path, args.num_prompts)
    # one request, with its tree's scratch
    kv_tokens = max(len(p) for p in [*prompts, warmup]) + args.max_new_tokens + tree_kv_margin(args.eagle3_tree)
    check_llamacpp(args)
    loaded = Loaded()
    try:
        load_all(args, threads, kv_tokens, loaded)
        if args.torch_compile_in_background:
            build_graphs(loaded, prompts)
        _log(f"{len(prompts)} prompts x {len(loaded.runners)} configurations ({', '.join(loaded.runners)})")
        rounds = [run_set(loaded.runners, prompts, warmup, loaded.prepare,
                          desc="prompts" if args.rounds == 1 else f"prompts, round {i + 1}/{args.rounds}")
                  for i in range(args.rounds)]
    finally:
        for engine in loaded.engines:
            engine.shutdown()
        for close in loaded.closers:
            close()
    return config_rows(rounds, loaded.setup)


def write_outputs(rows: list[dict], out_dir: str) -> dict[str, str]:
    """results.jsonl, table.md and speedup.png in out_dir -> their paths."""
    import os

    labels, values = speedup_bars(rows)
    paths = {"jsonl": write_jsonl(rows, os.path.join(out_dir, "results.jsonl")),
             "table": os.path.join(out_dir, "table.md")}
    with open(paths["table"], "w") as f:
        f.write(render(rows) + "\n")
    paths["plot"] = plot_bars(labels, values, os.path.join(out_dir, "speedup.png"),
                              title="specserve vs transformers: speed-up (tok/s ratio)", ylabel="ratio",
                              reference=1.0)
    return paths


def main(argv: list[str] | None = None) -> int:
    from specserve.config import ConfigError
    from specserve.models.loader import ModelLoadError

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except _BadFlag as e:
        print(f"specserve bench-compare: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if report_missing_extra("specserve bench-compare", "matplotlib"):
        return 2
    try:
        rows = run_bench(args)
    except (ConfigError, ModelLoadError, OSError) as e:
        print(f"specserve bench-compare: error: {e}", file=sys.stderr)
        return 2
    print(render(rows))
    for kind, path in write_outputs(rows, args.out_dir).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Core speed benchmark: specserve vs transformers ``generate`` on CPU, side by side in one run.

Measured, with the same prompts (token ids, so tokenization is not timed) and the same torch thread count:

1. Batch-1 greedy decode tokens/s on
   a. a tiny model (hidden 64, 2 layers): framework overhead dominates;
   b. a "large" model bigger than the CPU's L3 cache: memory-bound. For it the script also reports the
      fraction of the machine's memory read bandwidth that decoding reaches,
      ``non_embedding_weight_bytes * tokens_per_s / read_bandwidth``; the read bandwidth is measured here by
      timing ``t.sum()`` over a large fp32 tensor (best of several reps).
2. Batch-N (default 16) throughput with mixed prompt and output lengths (``ignore_eos``, so every request
   makes exactly its ``max_new_tokens``) vs transformers' left-padded batch ``generate`` with
   ``max_new_tokens`` = the largest one; both count only each request's own (useful) tokens. Two workloads:
   a. one wave: N requests submitted at once. Both engines take as many decode steps as the longest request
      needs, so this row compares the cost of a batched step;
   b. a stream: ``--batch-waves`` x N requests, served N at a time. specserve runs with
      ``max_running_requests=N`` and starts a waiting request as soon as one finishes (continuous batching);
      transformers runs them as consecutive padded batches of N, each lasting as long as its longest request.
      This row adds what continuous batching saves: the steps a padded batch spends waiting for its longest
      request while others could start.

Tokens/s = generated tokens / wall time of the whole generate call (prefill included), median of ``--reps``
timed runs after one warm-up. specserve's prefix cache is flushed before every run, so repeated prompts
are prefilled every time, as they are in transformers. transformers runs with ``eos_token_id=None`` so it
never stops early (and, like specserve's ``ignore_eos``, does not mask EOS, so greedy ids are comparable).

    python benchmarks/bench_core.py                      # full run (models cached in bench_out/models)
    python benchmarks/bench_core.py --skip-large --reps 1 # quick
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from specserve.bench.harness import (
    DTYPES,
    all_cores,
    compare_ids,
    flush_prefix_cache,
    load_hf,
    read_config,
    write_json,
)

TARGETS = {"tiny_decode": 1.5, "large_decode": 1.3, "batch": 2.0}  # specserve / transformers tokens/s
MODEL_SEED = 0
TOKENIZER_VOCAB = 512  # build_tokenizer's default; prompt ids stay below it so they are real tokens
BW_NOTE = (
    "fraction = non-embedding weight bytes (all parameters minus input-embedding tables that are not also the "
    "LM head; those are not read per token) * tokens/s / measured read bandwidth (best of reps of t.sum())"
)


# ---------------------------------------------------------------------------------------------- options
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_core.py", description=__doc__.split("\n")[0])
    g = p.add_argument_group("run")
    g.add_argument("--threads", type=int, default=all_cores(), help="torch threads (default: all cores)")
    g.add_argument("--reps", type=int, default=3, help="timed runs per measurement (median reported)")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and batch lengths")
    g.add_argument("--out", default="bench_out/bench_core.json", help="JSON report path")
    g.add_argument("--work-dir", default="bench_out/models", help="where built models are cached")
    g.add_argument("--skip-tiny", action="store_true", help="skip everything on the tiny model")
    g.add_argument("--skip-large", action="store_true", help="skip everything on the large model")
    g.add_argument("--skip-batch", action="store_true", help="skip the batch throughput rows")
    g.add_argument("--batch-models", default="tiny,large", help="models the batch rows run on (comma list)")
    g = p.add_argument_group("workloads")
    g.add_argument("--prompt-len", type=int, default=32, help="batch-1 prompt length (tokens)")
    g.add_argument("--decode-tokens", type=int, default=128, help="batch-1 tokens generated")
    g.add_argument("--batch-size", type=int, default=16, help="requests decoded together (both engines)")
    g.add_argument("--batch-waves", type=int, default=4,
                   help="the stream row serves waves x batch-size requests, batch-size at a time "
                        "(0 or 1: no stream row)")
    g.add_argument("--mixed-chunk", action="store_true",
                   help="specserve runs with --enable-mixed-chunk (a joining request's prefill in the running "
                        "requests' decode forward)")
    g.add_argument("--torch-compile", action="store_true",
                   help="specserve runs with --enable-torch-compile (graphs built during the warm-up run; "
                        "transformers stays eager)")
    g.add_argument("--batch-prompt-min", type=int, default=8)
    g.add_argument("--batch-prompt-max", type=int, default=128)
    g.add_argument("--batch-new-min", type=int, default=16)
    g.add_argument("--batch-new-max", type=int, default=128)
    g = p.add_argument_group("models")
    g.add_argument("--max-pos", type=int, default=2048, help="max_position_embeddings of both models")
    g.add_argument("--large-hidden", type=int, default=1024)
    g.add_argument("--large-intermediate", type=int, default=4096)
    g.add_argument("--large-layers", type=int, default=16)
    g.add_argument("--large-heads", type=int, default=16)
    g.add_argument("--large-kv-heads", type=int, default=4)
    g.add_argument("--large-vocab", type=int, default=32000)
    g.add_argument("--large-dtype", choices=sorted(DTYPES), default="bfloat16")
    g = p.add_argument_group("memory bandwidth")
    g.add_argument("--bw-gib", type=float, default=2.0, help="size of the tensor summed (GiB)")
    g.add_argument("--bw-reps", type=int, default=5)
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("threads", "reps", "prompt_len", "decode_tokens", "batch_size", "batch_prompt_min",
                 "batch_new_min", "bw_reps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.batch_waves < 0:
        p.error("--batch-waves must be >= 0")
    if a.batch_prompt_min > a.batch_prompt_max or a.batch_new_min > a.batch_new_max:
        p.error("batch length ranges: min must be <= max")
    longest = max(a.prompt_len + a.decode_tokens, a.batch_prompt_max + a.batch_new_max)
    if longest > a.max_pos:
        p.error(f"prompt + new tokens ({longest}) exceed --max-pos {a.max_pos}")
    a.batch_models = [m.strip() for m in a.batch_models.split(",") if m.strip()]
    if not set(a.batch_models) <= {"tiny", "large"}:
        p.error("--batch-models takes tiny and/or large")


def _log(msg: str) -> None:
    print(f"[bench_core] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- machine
def l3_cache_bytes() -> int | None:
    """Size of the largest (last-level) CPU cache from sysfs, or None where sysfs does not say."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * mult
        best = size if best is None else max(best, size)
    return best


def machine_info(args: argparse.Namespace) -> dict:
    import transformers

    cpu = platform.processor()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu, "cores": all_cores(), "threads": args.threads, "llc_bytes": l3_cache_bytes(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": {k: v for k, v in vars(args).items()},
    }


def measure_read_bandwidth(gib: float, reps: int) -> dict:
    """Memory read bandwidth: time t.sum() over a `gib` GiB fp32 tensor (pages touched first)."""
    n = max(1, int(gib * 2**30) // 4)
    t = torch.empty(n, dtype=torch.float32)  # [n]
    t.fill_(1.0)
    t.sum()  # warm-up
    times = []
    for _ in tqdm(range(reps), desc="read bandwidth", leave=False):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    nbytes = n * 4
    del t
    gc.collect()
    return {
        "method": "torch.sum over a float32 tensor",
        "tensor_bytes": nbytes, "reps": reps, "times_s": times,
        "best_bytes_per_s": nbytes / min(times), "median_bytes_per_s": nbytes / statistics.median(times),
        "used_for_fraction": "best_bytes_per_s",
    }


# ---------------------------------------------------------------------------------------------- models
def _build_atomically(path: str, build: Callable[[str], object]) -> str:
    """Build into path.tmp and rename, so an interrupted build is never mistaken for a cached one."""
    if os.path.isdir(path):
        return path
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    os.replace(tmp, path)
    return path


def ensure_tokenizer(work_dir: str) -> str:
    from specserve.test.tiny import build_tokenizer

    return _build_atomically(os.path.join(work_dir, "tokenizer"), build_tokenizer)


def ensure_model(work_dir: str, name: str, dtype: str, tokenizer_dir: str, **overrides) -> str:
    from specserve.test.tiny import make_model_dir

    def build(tmp: str) -> None:
        _log(f"building model {name} (cached in {work_dir}) ...")
        make_model_dir(tmp, "llama", seed=MODEL_SEED, dtype=DTYPES[dtype], tokenizer_dir=tokenizer_dir, **overrides)

    return _build_atomically(os.path.join(work_dir, name), build)


def tiny_model(args: argparse.Namespace, tokenizer_dir: str) -> str:
    name = f"tiny-llama-ctx{args.max_pos}-float32"
    return ensure_model(args.work_dir, name, "float32", tokenizer_dir, max_position_embeddings=args.max_pos)


def large_model(args: argparse.Namespace, tokenizer_dir: str) -> str:
    a = args
    name = (f"large-llama-h{a.large_hidden}-i{a.large_intermediate}-l{a.large_layers}-a{a.large_heads}"
            f"-kv{a.large_kv_heads}-v{a.large_vocab}-ctx{a.max_pos}-{a.large_dtype}")
    return ensure_model(
        a.work_dir, name, a.large_dtype, tokenizer_dir,
        hidden_size=a.large_hidden, intermediate_size=a.large_intermediate, num_hidden_layers=a.large_layers,
        num_attention_heads=a.large_heads, num_key_value_heads=a.large_kv_heads, vocab_size=a.large_vocab,
        max_position_embeddings=a.max_pos,
    )


def weight_bytes(model: nn.Module) -> dict:
    """Bytes of all parameters (tied ones once) and without input embeddings that are not also the LM head."""
    params = dict(model.named_parameters())  # named_parameters() lists a tied tensor once
    total = sum(p.numel() * p.element_size() for p in params.values())
    linear_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Linear)}
    embedding = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.weight.data_ptr() not in linear_ptrs
    )
    return {"all_params": total, "non_embedding": total - embedding, "embedding": embedding}


# ---------------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # R prompts of token ids
    new_tokens: list[int]  # R max_new_tokens (all produced: ignore_eos / eos_token_id=None)
    batch_size: int = 0  # requests decoded together; 0 = all R at once

    def __post_init__(self) -> None:
        self.batch_size = self.batch_size or len(self.prompts)

    @property
    def useful_tokens(self) -> int:
        return sum(self.new_tokens)

    def waves(self) -> list[tuple[list[list[int]], list[int]]]:
        """The requests in submission order, cut into groups of batch_size (transformers' padded batches)."""
        n = self.batch_size
        return [(self.prompts[i:i + n], self.new_tokens[i:i + n]) for i in range(0, len(self.prompts), n)]

    def describe(self) -> dict:
        return {"batch_size": self.batch_size, "requests": len(self.prompts),
                "prompt_lens": [len(p) for p in self.prompts], "new_tokens": self.new_tokens,
                "useful_tokens": self.useful_tokens}


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    from specserve.train.tokenizer import SPECIAL_TOKENS

    return [rng.randrange(len(SPECIAL_TOKENS), min(vocab, TOKENIZER_VOCAB)) for _ in range(n)]


def decode_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    return Workload("decode_b1", [_random_ids(rng, args.prompt_len, vocab)], [args.decode_tokens])


def batch_workload(args: argparse.Namespace, vocab: int, waves: int = 1) -> Workload:
    """waves x batch-size requests of mixed lengths (seeded; the first wave is the same for every `waves`)."""
    rng = random.Random(args.seed + 1)
    prompts, news = [], []
    for _ in range(waves):
        lens = [rng.randint(args.batch_prompt_min, args.batch_prompt_max) for _ in range(args.batch_size)]
        news += [rng.randint(args.batch_new_min, args.batch_new_max) for _ in range(args.batch_size)]
        prompts += [_random_ids(rng, n, vocab) for n in lens]
    name = f"batch{args.batch_size}" + (f"_stream{len(prompts)}" if waves > 1 else "")
    return Workload(name, prompts, news, args.batch_size)


def batch_workloads(args: argparse.Namespace, vocab: int) -> list[Workload]:
    """The one-wave row, then the stream row (when --batch-waves > 1)."""
    return [batch_workload(args, vocab)] + ([batch_workload(args, vocab, args.batch_waves)]
                                            if args.batch_waves > 1 else [])


def kv_tokens_needed(workloads: list[Workload]) -> int:
    return max(sum(len(p) + n for p, n in zip(w.prompts, w.new_tokens, strict=True)) for w in workloads) + 256


# ---------------------------------------------------------------------------------------------- timing
@dataclass
class Timing:
    times_s: list[float] = field(default_factory=list)
    tokens: int = 0  # useful tokens of one run
    outputs: list[list[int]] = field(default_factory=list)  # generated ids of the last run

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_s

    def to_json(self) -> dict:
        return {"times_s": self.times_s, "median_s": self.median_s, "tokens": self.tokens,
                "tokens_per_s": self.tokens_per_s}


def measure_pair(run_a: Callable, run_b: Callable, reps: int, label: str,
                 setup_a: Callable[[], None] | None = None) -> tuple[Timing, Timing, list[float]]:
    """One warm-up of each, then `reps` rounds timing A then B back to back (A B A B ...), so drift of a
    shared machine hits both alike. run() -> (generated ids per request, useful tokens). Also returns the
    per-round speed ratios A/B (time_b / time_a)."""
    a, b, ratios = Timing(), Timing(), []
    for i in tqdm(range(reps + 1), desc=label, leave=False):
        ta = _timed(run_a, a, setup_a)
        tb = _timed(run_b, b, None)
        if i > 0:
            a.times_s.append(ta)
            b.times_s.append(tb)
            ratios.append(tb / ta)
    return a, b, ratios


def _timed(run: Callable, timing: Timing, setup: Callable[[], None] | None) -> float:
    if setup is not None:
        setup()
    t0 = time.perf_counter()
    timing.outputs, timing.tokens = run()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- specserve
def specserve_engine(model_dir: str, dtype: str, args: argparse.Namespace, workloads: list[Workload]):
    import specserve

    return specserve.Engine(
        model_path=model_dir, dtype=dtype, max_total_tokens=kv_tokens_needed(workloads), log_level="warning",
        num_threads=args.threads, max_running_requests=max(w.batch_size for w in workloads),
        enable_mixed_chunk=args.mixed_chunk, enable_torch_compile=args.torch_compile,
    )


def specserve_run(engine, wl: Workload) -> tuple[list[list[int]], int]:
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in wl.new_tokens]
    results = engine.generate(input_ids=wl.prompts, sampling_params=params)  # list input -> list of dicts
    return [r["output_ids"] for r in results], sum(r["meta_info"]["completion_tokens"] for r in results)


# ---------------------------------------------------------------------------------------------- transformers
def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [B, L] left-padded with pad_id, attention_mask [B, L] (1 = real token)."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, L - len(p):] = 1
    return ids, mask


def hf_run(model, wl: Workload, pad_id: int) -> tuple[list[list[int]], int]:
    """One padded generate per wave of batch_size requests, one after the other; counts each request's own
    tokens only."""
    outputs: list[list[int]] = []
    for prompts, new_tokens in wl.waves():
        ids, mask = left_pad(prompts, pad_id)  # [B, L]
        with torch.inference_mode():
            out = model.generate(  # [B, L + max(new_tokens)]; eos_token_id=None: never stops early, EOS not masked
                input_ids=ids, attention_mask=mask, max_new_tokens=max(new_tokens), do_sample=False,
                eos_token_id=None, pad_token_id=pad_id,
            )
        gen = out[:, ids.shape[1]:].tolist()
        outputs += [row[:n] for row, n in zip(gen, new_tokens, strict=True)]
    return outputs, sum(len(o) for o in outputs)


# ---------------------------------------------------------------------------------------------- rows
def make_row(name: str, model: str, kind: str, target: float, wl: Workload, ss: Timing, hf: Timing,
             ratios: list[float]) -> dict:
    ratio = statistics.median(ratios)  # median of per-round ratios (paired runs), not a ratio of medians
    return {
        "name": name, "model": model, "kind": kind, "workload": wl.describe(),
        "specserve": ss.to_json(), "transformers": hf.to_json(),
        "specserve_tokens_per_s": ss.tokens_per_s, "transformers_tokens_per_s": hf.tokens_per_s,
        "ratio": ratio, "ratio_per_round": ratios, "target": target, "meets_target": ratio >= target,
        "greedy_ids": compare_ids(ss.outputs, hf.outputs),
    }


def add_bandwidth(row: dict, wbytes: dict, bw: dict, llc: int | None) -> None:
    per_s = bw["best_bytes_per_s"]
    row["weight_bytes"] = wbytes
    row["weights_exceed_llc"] = None if llc is None else wbytes["all_params"] > llc
    row["bandwidth_fraction"] = {
        "specserve": wbytes["non_embedding"] * row["specserve_tokens_per_s"] / per_s,
        "transformers": wbytes["non_embedding"] * row["transformers_tokens_per_s"] / per_s,
        "specserve_all_params": wbytes["all_params"] * row["specserve_tokens_per_s"] / per_s,
        "read_bytes_per_s": per_s, "note": BW_NOTE,
    }


def bench_model(label: str, model_dir: str, dtype: str, args: argparse.Namespace, with_batch: bool,
                bw: dict | None, llc: int | None) -> list[dict]:
    """All rows of one model: batch-1 decode (+ bandwidth fraction when bw is given) and optionally batch."""
    vocab = read_config(model_dir)["vocab_size"]
    workloads = [decode_workload(args, vocab)] + (batch_workloads(args, vocab) if with_batch else [])
    _log(f"{label}: specserve vs transformers ({dtype}, {args.threads} threads), runs alternating ...")
    engine = specserve_engine(model_dir, dtype, args, workloads)
    hf_model, pad_id = load_hf(model_dir, dtype)
    try:
        threads = engine.loop.call(lambda s: torch.get_num_threads())
        results = [
            measure_pair(lambda wl=wl: specserve_run(engine, wl), lambda wl=wl: hf_run(hf_model, wl, pad_id),
                         args.reps, f"{label} {wl.name}", setup_a=lambda: flush_prefix_cache(engine))
            for wl in workloads
        ]
    finally:
        engine.shutdown()
    wbytes = weight_bytes(hf_model)  # same checkpoint; specserve's packed linears are not parameters
    dec = workloads[0]
    row = make_row(f"{label}_decode_b1", label, "batch1_decode", TARGETS[f"{label}_decode"], dec, *results[0])
    row.update(dtype=dtype, specserve_scheduler_threads=threads)
    if bw is not None:
        add_bandwidth(row, wbytes, bw, llc)
    rows = [row]
    for wl, res in zip(workloads[1:], results[1:], strict=True):
        stream = len(wl.prompts) > wl.batch_size
        rows.append(make_row(f"{label}_{wl.name}", label, "batch_stream" if stream else "batch_one_wave",
                             TARGETS["batch"], wl, *res))
        rows[-1]["dtype"] = dtype
    return rows


# ---------------------------------------------------------------------------------------------- report
def format_table(report: dict) -> str:
    head = f"{'benchmark':<28}{'dtype':>10}{'specserve tok/s':>17}{'HF tok/s':>12}{'ratio':>8}{'target':>8}  ok  ids"
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        ids = r["greedy_ids"]
        lines.append(
            f"{r['name']:<28}{r['dtype']:>10}{r['specserve_tokens_per_s']:>17.1f}{r['transformers_tokens_per_s']:>12.1f}"
            f"{r['ratio']:>7.2f}x{r['target']:>7.1f}x  {'yes' if r['meets_target'] else 'NO ':<4}"
            f"{ids['rows_equal']}/{ids['rows']} equal"
        )
    bw = report.get("memory_bandwidth")
    if bw:
        lines.append(f"\nmemory read bandwidth: {bw['best_bytes_per_s'] / 1e9:.1f} GB/s best, "
                     f"{bw['median_bytes_per_s'] / 1e9:.1f} GB/s median "
                     f"(t.sum() over {bw['tensor_bytes'] / 2**30:.2f} GiB, best used)")
    for r in report["rows"]:
        if "bandwidth_fraction" in r:
            w, f = r["weight_bytes"], r["bandwidth_fraction"]
            lines.append(
                f"{r['name']}: weights {w['all_params'] / 1e6:.1f} MB all params, {w['non_embedding'] / 1e6:.1f} MB "
                f"non-embedding (exceeds LLC: {r['weights_exceed_llc']}); bandwidth reached (non-embedding bytes): "
                f"specserve {f['specserve']:.1%}, transformers {f['transformers']:.1%}"
            )
    lines.append("tokens/s = generated tokens / wall time of generate (prefill included), median of reps; "
                 "batch rows count each request's own tokens only; a _stream row serves its requests batch-size "
                 "at a time (specserve: continuous batching; transformers: consecutive padded batches)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    import transformers

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    os.makedirs(args.work_dir, exist_ok=True)
    report: dict = {"machine": machine_info(args), "targets": TARGETS, "rows": [], "memory_bandwidth": None}
    tokenizer_dir = ensure_tokenizer(args.work_dir)
    if not args.skip_tiny:
        tiny_dir = tiny_model(args, tokenizer_dir)
        with_batch = not args.skip_batch and "tiny" in args.batch_models
        report["rows"] += bench_model("tiny", tiny_dir, "float32", args, with_batch, None, None)
    if not args.skip_large:
        large_dir = large_model(args, tokenizer_dir)  # built before the bandwidth run (building is noisy)
        _log(f"measuring memory read bandwidth ({args.bw_gib} GiB x {args.bw_reps}) ...")
        report["memory_bandwidth"] = bw = measure_read_bandwidth(args.bw_gib, args.bw_reps)
        with_batch = not args.skip_batch and "large" in args.batch_models
        llc = report["machine"]["llc_bytes"]
        report["rows"] += bench_model("large", large_dir, args.large_dtype, args, with_batch, bw, llc)
    write_json(report, args.out)
    print(format_table(report))
    print(f"\nfull results: {args.out}")
    return report


if __name__ == "__main__":
    main()

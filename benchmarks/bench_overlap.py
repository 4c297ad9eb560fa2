"""The overlap scheduler (``--enable-spec-v2``) vs the serial speculative step, side by side in one run.

Two engines with the same EAGLE-3 chain (topk 1) are loaded in this process, one with the overlap scheduler; each
repetition sends the same batch of held-out prompts to one, then the other (A B A B), greedy, fixed token counts
(ignore_eos). ``--stop`` gives every request stop strings that never match and ``--logprobs`` asks for top-5
logprobs: the per-token output work the overlap scheduler moves beside the next forward. Reported per batch size:
tokens/s of each (median over the repetitions), the median of the per-repetition ratios, in how many repetitions
the overlap scheduler was faster, greedy equality, and how many steps overlapped.

    python benchmarks/bench_overlap.py [--batch-size 1,32] [--reps 5] [--stop] [--logprobs]

Any target works with ``--model-path``; ``--draft-model-path random`` gives it a random EAGLE-3 head (built in a
temporary folder) and ``--simulate-acc-len A`` simulates acceptance (``SPECSERVE_SIMULATE_ACC_LEN``), e.g. on the
large GEMM-bound model ``python benchmarks/bench_core.py`` builds under ``bench_out/models``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from specserve.bench.bench_speculative import parse_int_list
from specserve.bench.report import format_table

NEVER_MATCHES = ["\n\n\n\n\n\n", "<never-emitted-stop>"]  # checked after every token, never found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_overlap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="demo")
    p.add_argument("--draft-model-path", default="demo-eagle3",
                   help="an EAGLE-3 head folder, or 'random': a random head for the target (temporary folder)")
    p.add_argument("--simulate-acc-len", type=float, default=None,
                   help="simulated accept length (sets SPECSERVE_SIMULATE_ACC_LEN; lossy, benchmarking only)")
    p.add_argument("--steps", type=int, default=3, help="chain length (--speculative-num-steps), topk 1")
    p.add_argument("--batch-size", default="1,32", help="comma list")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--stop", action="store_true", help="stop strings on every request (never matching)")
    p.add_argument("--logprobs", action="store_true", help="return logprobs with top-5 lists")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--enable-torch-compile", action="store_true", help="both engines compile their forwards")
    a = p.parse_args(argv)
    try:
        a.batch_size = parse_int_list(a.batch_size, "--batch-size")
    except ValueError as e:
        p.error(str(e))
    if a.simulate_acc_len is not None and not 1.0 <= a.simulate_acc_len <= a.steps + 1:
        p.error(f"--simulate-acc-len must be in [1, --steps + 1 = {a.steps + 1}], got {a.simulate_acc_len:g}")
    return a


def _engines(args: argparse.Namespace):
    from specserve import Engine

    common = dict(model_path=args.model_path, speculative_algorithm="EAGLE3", dtype=args.dtype,
                  speculative_draft_model_path=args.draft_model_path, speculative_num_steps=args.steps,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=args.steps + 1, num_threads=args.num_threads,
                  disable_speculative_auto_off=True, log_level="warning", max_total_tokens=16384,
                  enable_torch_compile=args.enable_torch_compile)
    return Engine(**common), Engine(**common, enable_spec_v2=True)


def _timed(engine, prompts: list[str], params: dict, logprobs: bool) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params, return_logprob=logprobs or None, top_logprobs_num=5 if logprobs else None)
    seconds = time.perf_counter() - start
    ids = [o["output_ids"] for o in outs]
    return sum(map(len, ids)) / seconds, ids


def bench_batch(engines, batch: int, args: argparse.Namespace, prompts: list[str]) -> dict:
    serial, overlap = engines
    reqs = [prompts[i % len(prompts)] for i in range(batch)]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    if args.stop:
        params["stop"] = NEVER_MATCHES
    _timed(serial, reqs, params, args.logprobs)  # warm-up of both
    _timed(overlap, reqs, params, args.logprobs)
    before = overlap.get_server_info()["spec_overlapped_steps"]
    rates: dict[str, list[float]] = {"serial": [], "overlap": []}
    equal = True
    for _ in tqdm(range(args.reps), desc=f"batch {batch}", leave=False):
        a, a_ids = _timed(serial, reqs, params, args.logprobs)
        b, b_ids = _timed(overlap, reqs, params, args.logprobs)
        rates["serial"].append(a)
        rates["overlap"].append(b)
        equal &= a_ids == b_ids
    ratios = [b / a for a, b in zip(rates["serial"], rates["overlap"], strict=True)]
    return {"batch": batch, "serial_tok_s": statistics.median(rates["serial"]),
            "overlap_tok_s": statistics.median(rates["overlap"]), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "wins": f"{sum(r > 1 for r in ratios)}/{len(ratios)}",
            "equal": equal,
            "overlapped_steps": overlap.get_server_info()["spec_overlapped_steps"] - before}


def random_head(target: str, out_dir: str) -> str:
    """A random-weight EAGLE-3 head for `target` in out_dir (draft vocabulary: the first 8192 target ids at most)."""
    from specserve.models.loader import read_config
    from specserve.test.tiny import make_eagle3_head_dir

    vocab = read_config(target)["vocab_size"]
    return make_eagle3_head_dir(out_dir, target, kind="random", draft_vocab=list(range(min(vocab, 8192))))


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from specserve.demo_models import resolve_demo
    from specserve.speculative.simulate import simulated_acc_len
    from specserve.train.corpus import held_out_prompts

    args.model_path = resolve_demo(args.model_path)
    prompts = held_out_prompts(16)
    with tempfile.TemporaryDirectory(prefix="bench-overlap-head-") as tmp, simulated_acc_len(args.simulate_acc_len):
        if args.draft_model_path == "random":
            args.draft_model_path = random_head(args.model_path, tmp)
        else:
            args.draft_model_path = resolve_demo(args.draft_model_path)
        engines = _engines(args)  # the engines read the simulation variable when they are built
    try:
        rows = [bench_batch(engines, b, args, prompts) for b in args.batch_size]
    finally:
        for e in engines:
            e.shutdown()
    print(format_table(rows, [("batch", "batch", None), ("serial_tok_s", "serial tok/s", ".1f"),
                              ("overlap_tok_s", "overlap tok/s", ".1f"), ("ratio", "overlap / serial", ".3f"),
                              ("ratio_min", "min", ".3f"), ("ratio_max", "max", ".3f"),
                              ("wins", "overlap faster", None),
                              ("equal", "greedy equal", None), ("overlapped_steps", "overlapped steps", None)]))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

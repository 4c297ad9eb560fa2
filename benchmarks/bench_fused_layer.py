"""What a decoder layer in one operator call (``platform/cpu/fused_layer.py``) saves against the layer's modules, in
one process, alternating.

Per call: one SmolLM2-135M-shaped layer (hidden 576, 9 + 3 heads of 64, intermediate 1536, bf16 weights on this build's
few-row kernel: AVX2's, or AVX512-BF16's vector loop) over 256 keys, as one operator call and as its steps called one
by one from Python (what the operator replaces, less the modules' own Python), for a decode row, a verify tree of 8 and
16 decode rows; median us of 5 batches of ``--calls`` calls. End to end: one engine on ``--model-path`` (default: the
bundled SmolLM2) in bf16 decodes ``--max-new-tokens`` greedy tokens of each of ``--num-prompts`` prompts with the fused
layers installed and taken off, alternating ``--rounds`` times; with ``--speculative`` the same for an engine with the
model's bundled EAGLE-3 head (its layer fused and unfused with the target's). Printed: tokens/s of each (median) and
the ratio of each round. Needs a CPU with AVX2 or AVX512-BF16, a C++ compiler and PyTorch's headers (and on
AVX512-BF16, the few-row kernel taking the model's calls: ``SPECSERVE_SMALL_GEMM`` not off).

    python benchmarks/bench_fused_layer.py --rounds 5 [--speculative]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.platform.cpu import fused_layer
from specserve.platform.cpu.fused_layer import decoder_layer, decoder_layer_reference
from specserve.platform.cpu.small_gemm import pack

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how photosynthesis works to a ten-year-old.", "List three uses of a paperclip.",
           "What is the capital of Australia, and why is it not Sydney?"]


def layer_inputs(gen: torch.Generator, bsz: int, queries: int, keys: int = 256) -> tuple:
    """The operator's arguments for a SmolLM2-shaped layer: bsz requests of `queries` new tokens over `keys` keys."""
    hidden, heads, kv_heads, dim, inter = 576, 9, 3, 64, 1536
    linears = []
    for n, k in (((heads + 2 * kv_heads) * dim, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter)):
        linears += [pack((torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)), None, None]
    tokens = bsz * queries
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    norm = torch.ones(hidden, dtype=torch.bfloat16)
    cos, sin = torch.randn(tokens, 2, dim, generator=gen).to(torch.bfloat16).unsqueeze(1).unbind(2)
    k_buf, v_buf = ((torch.randn(bsz * keys + 1, kv_heads, dim, generator=gen) / 2).to(torch.bfloat16)
                    for _ in range(2))
    kv_slots = torch.arange(1, bsz * keys + 1).view(bsz, keys)
    mask = None
    if queries > 1:
        mask = torch.ones(bsz, 1, queries, keys, dtype=torch.bool)
        mask[..., keys - queries:] = torch.tril(torch.ones(queries, queries, dtype=torch.bool))
    return (x, linears, norm, norm, 1e-5, cos, sin, k_buf, v_buf, kv_slots[:, -queries:].reshape(-1), kv_slots, mask,
            heads, 0.125)


def per_call(calls: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{'forward':>16} {'one call us':>12} {'steps us':>9} {'one call / steps':>17}")
    for label, bsz, queries in (("decode row", 1, 1), ("verify tree of 8", 1, 8), ("16 decode rows", 16, 1)):
        args = layer_inputs(gen, bsz, queries)
        times: dict[str, list[float]] = {"op": [], "steps": []}
        for _ in range(5):  # alternate the two, batch by batch
            for kind, fn in (("op", decoder_layer), ("steps", decoder_layer_reference)):
                for _ in range(20):
                    fn(*args)
                start = time.perf_counter()
                for _ in range(calls):
                    fn(*args)
                times[kind].append((time.perf_counter() - start) / calls * 1e6)
        f, s = statistics.median(times["op"]), statistics.median(times["steps"])
        print(f"{label:>16} {f:>12.1f} {s:>9.1f} {f / s:>17.2f}")


def end_to_end(model_path: str, speculative: bool, rounds: int, new_tokens: int, num_prompts: int,
               threads: int) -> None:
    from specserve import Engine
    from specserve.demo_models import bundled_drafter

    kw = {}
    if speculative:
        kw = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": bundled_drafter(model_path),
              "disable_speculative_auto_off": True}
    engine = Engine(model_path=model_path, dtype="bfloat16", num_threads=threads, **kw)
    models = [engine.scheduler.runner.model]
    if speculative:
        models.append(engine.scheduler.decoder.proposer.head)
    layers = [m for model in models for m in model.modules() if isinstance(getattr(m, "fused", None),
                                                                          fused_layer.FusedLayer)]
    if not layers:
        raise SystemExit("the engine fused no decoder layer")
    installed = {m: m.fused for m in layers}
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    prompts = PROMPTS[:num_prompts]
    engine.generate(prompts[0], params)  # warm-up
    rates: dict[str, list[float]] = {"fused": [], "modules": []}
    steps: dict[str, int] = {"fused": 0, "modules": 0}

    def set_fused(on: bool) -> None:
        for m, op in installed.items():
            m.fused = op if on else None

    def timed(on: bool) -> None:
        engine.loop.call(lambda _s: set_fused(on))  # on the scheduler's thread, between steps
        kind = "fused" if on else "modules"
        start = time.perf_counter()
        outs = [engine.generate(p, params) for p in prompts]
        rates[kind].append(new_tokens * len(prompts) / (time.perf_counter() - start))
        steps[kind] += sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)

    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            timed(on)
    engine.shutdown()
    ratios = [f / m for f, m in zip(rates["fused"], rates["modules"], strict=True)]
    what = "EAGLE-3 (bundled head)" if speculative else "plain"
    print(f"{model_path}, {what}, bf16, {threads} threads, {len(prompts)} prompts x {new_tokens} greedy tokens, "
          f"{len(layers)} fused layers, {rounds} rounds alternating")
    line = (f"tok/s fused {statistics.median(rates['fused']):.1f}  modules {statistics.median(rates['modules']):.1f}  "
            f"fused / modules median {statistics.median(ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    if speculative:
        total = new_tokens * len(prompts) * rounds
        line += "  accept length " + ", ".join(f"{k} {total / v:.2f}" for k, v in steps.items() if v)
    print(line)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--speculative", action="store_true", help="also an EAGLE-3 engine with the bundled head")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    if not fused_layer.available():
        raise SystemExit("the fused layer does not run here (it needs AVX2 or AVX512-BF16, a C++ compiler and "
                         "PyTorch's headers)")
    torch.set_num_threads(args.num_threads)
    with torch.inference_mode():
        per_call(args.calls)
    end_to_end(args.model_path, False, args.rounds, args.max_new_tokens, args.num_prompts, args.num_threads)
    if args.speculative:
        end_to_end(args.model_path, True, args.rounds, args.max_new_tokens, args.num_prompts, args.num_threads)


if __name__ == "__main__":
    main()

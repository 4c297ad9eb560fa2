"""What the one-call element-wise operators (``platform/cpu/elementwise.py``: RMSNorm, SiLU-and-multiply, RoPE of
eager bf16 forwards, and the KV pool's K and V write) save against the eager PyTorch operators they replace, in one
process, alternating.

Per call: each operator and its eager composite on SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 + 3
heads of 64) at 1 and 16 rows, median us of 5 batches of ``--calls`` calls. End to end: one engine on ``--model-path``
(default: the bundled SmolLM2) in bf16 decodes ``--max-new-tokens`` greedy tokens of one prompt with the operators
installed and with them taken off its modules and KV pool, alternating ``--rounds`` times; printed: tokens/s of each
(median) and the ratio of each round. Needs AVX512-BF16 or AVX2, a C++ compiler and PyTorch's headers.

    python benchmarks/bench_elementwise.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from specserve.platform.cpu import elementwise as ew


def per_call(calls: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{'operator':>10} {'rows':>5} {'fused us':>9} {'eager us':>9} {'fused / eager':>14}")
    for rows in (1, 16):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        w = torch.rand(576, generator=gen).to(torch.bfloat16)
        gate_up = torch.randn(rows, 3072, generator=gen).to(torch.bfloat16)
        qk = torch.randn(rows, 12, 64, generator=gen).to(torch.bfloat16)
        cos, sin = torch.randn(rows, 2, 64, generator=gen).to(torch.bfloat16).unsqueeze(1).unbind(2)
        k, v = qk[:, 9:], qk[:, 9:] + 1  # 3 KV heads of 64 a token, written at slots of a 1024-slot pool
        k_buf, v_buf = (torch.zeros(1024, 3, 64, dtype=torch.bfloat16) for _ in range(2))
        slots = torch.randperm(1024, generator=gen)[:rows]
        pairs = {
            "rms_norm": (partial(ew.rms_norm, x, w, 1e-5), partial(ew.rms_norm_reference, x, w, 1e-5)),
            "silu_mul": (partial(ew.silu_mul, gate_up), partial(ew.silu_mul_reference, gate_up)),
            "rope": (partial(ew.rope, qk, cos, sin), partial(ew.rope_reference, qk, cos, sin)),
            "kv_store": (partial(ew.kv_store, k_buf, v_buf, slots, k, v),
                         partial(ew.kv_store_reference, k_buf, v_buf, slots, k, v)),
        }
        for name, (fused, eager) in pairs.items():
            times: dict[str, list[float]] = {"fused": [], "eager": []}
            for _ in range(5):  # alternate the two, batch by batch
                for kind, fn in (("fused", fused), ("eager", eager)):
                    for _ in range(50):
                        fn()
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times[kind].append((time.perf_counter() - start) / calls * 1e6)
            f, e = statistics.median(times["fused"]), statistics.median(times["eager"])
            print(f"{name:>10} {rows:>5} {f:>9.2f} {e:>9.2f} {f / e:>14.2f}")


def end_to_end(model_path: str, rounds: int, new_tokens: int, threads: int) -> None:
    from specserve import Engine

    engine = Engine(model_path=model_path, dtype="bfloat16", num_threads=threads)
    runner = engine.scheduler.runner
    installed = {m: m.fused for m in runner.model.modules() if getattr(m, "fused", None) is not None}
    store = runner.kv_pool.fused_store
    if not installed or store is None:
        raise SystemExit("the engine installed no fused operator")
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    engine.generate(prompt, params)  # warm-up
    rates: dict[str, list[float]] = {"fused": [], "eager": []}

    def set_fused(on: bool) -> None:
        for m, op in installed.items():
            m.fused = op if on else None
        runner.kv_pool.fused_store = store if on else None

    def timed(on: bool) -> None:
        engine.loop.call(lambda _s: set_fused(on))  # on the scheduler's thread, between steps
        start = time.perf_counter()
        engine.generate(prompt, params)
        rates["fused" if on else "eager"].append(new_tokens / (time.perf_counter() - start))

    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            timed(on)
    engine.shutdown()
    ratios = [f / e for f, e in zip(rates["fused"], rates["eager"], strict=True)]
    print(f"{model_path}, bf16, {threads} threads, {new_tokens} greedy tokens a call, {len(installed)} modules, "
          f"{rounds} rounds alternating")
    print(f"tok/s fused {statistics.median(rates['fused']):.1f}  eager {statistics.median(rates['eager']):.1f}  "
          f"fused / eager median {statistics.median(ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args(argv)
    if not ew.available():
        raise SystemExit("the fused operators do not run here (neither AVX512-BF16 nor AVX2, or no C++ compiler or "
                         "PyTorch headers)")
    torch.set_num_threads(args.num_threads)
    with torch.inference_mode():
        per_call(args.calls)
    end_to_end(args.model_path, args.rounds, args.max_new_tokens, args.num_threads)


if __name__ == "__main__":
    main()

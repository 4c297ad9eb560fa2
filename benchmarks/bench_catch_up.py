"""An EAGLE-family head's catch-up on a long prompt: its layer run past the K/V for each request's last row alone
(the default for one-layer heads, ``DraftModel.one_layer``) against every row, side by side on one engine.

The engine serves ``--model-path`` with its EAGLE-3 head (bf16 by default, radix cache off so that every request
prefills its whole prompt); each round sends a prompt of ``--prompt-words`` words twice, once with each
setting of ``speculative.eagle.last_rows_only`` (the order alternating round by round), asking for two new tokens
(the catch-up runs once the prompt is in; a one-token request finishes without it). Printed per setting: the head's
catch-up after the prefill (the drafter's ``after_prefill``) and the request's wall time, their medians over
``--rounds``, and every-row over last-row as ratios.

    python benchmarks/bench_catch_up.py --model-path smollm2 --draft-model-path smollm2-eagle3 --rounds 5
    python benchmarks/bench_catch_up.py --model-path demo --draft-model-path demo-eagle3 --rounds 5 --prompt-words 700
"""

from __future__ import annotations

import argparse
import statistics
import time

import specserve.speculative.eagle as eagle
from specserve import Engine
from specserve.demo_models import demo_path

SETTINGS = {"last rows": eagle.last_rows_only, "every row": lambda q_lens: False}
FILLER = "the quick brown fox jumps over the lazy dog while the cat sleeps near a warm fire"


def filler_prompt(words: int) -> str:
    """A prompt of ``words`` words of FILLER, repeated as far as needed."""
    filler = FILLER.split()
    return " ".join(filler[i % len(filler)] for i in range(words))


def timed_catch_up(engine: Engine) -> list[float]:
    """Wraps the engine's drafter's after_prefill; -> the list its calls' seconds are appended to."""
    proposer = engine.loop.scheduler.decoder.proposer
    inner, seconds = proposer.after_prefill, []

    def after_prefill(*args, **kwargs):
        start = time.perf_counter()
        inner(*args, **kwargs)
        seconds.append(time.perf_counter() - start)

    proposer.after_prefill = after_prefill
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--draft-model-path", default="smollm2-eagle3")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--prompt-words", type=int, default=1200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    engine = Engine(model_path=args.model_path, dtype=args.dtype, num_threads=args.num_threads,
                    speculative_algorithm="EAGLE3", speculative_draft_model_path=demo_path(args.draft_model_path),
                    disable_radix_cache=True)
    prompt = filler_prompt(args.prompt_words)
    params = {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0}
    catch_up = timed_catch_up(engine)
    engine.generate(prompt, params)  # warm-up
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name in (list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]):
            eagle.last_rows_only = SETTINGS[name]
            catch_up.clear()
            start = time.perf_counter()
            out = engine.generate(prompt, params)
            results[name].append((sum(catch_up), time.perf_counter() - start))
    engine.shutdown()
    print(f"{args.model_path} + {args.draft_model_path} ({args.dtype}, {args.num_threads} threads), prompt of "
          f"{out['meta_info']['prompt_tokens']} tokens, 2 new tokens; medians of {args.rounds} rounds")
    med = {name: (statistics.median(c for c, _ in rows), statistics.median(w for _, w in rows))
           for name, rows in results.items()}
    for name, (c, w) in med.items():
        print(f"  {name:10s} head catch-up {c * 1e3:7.2f} ms   request {w * 1e3:7.1f} ms")
    (c_last, w_last), (c_every, w_every) = med["last rows"], med["every row"]
    print(f"  every row / last rows: catch-up {c_every / c_last:.2f}x, request {w_every / w_last:.3f}x")


if __name__ == "__main__":
    main()

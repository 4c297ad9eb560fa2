"""Time to first token for prompts of lengths the engine has not met, with oneDNN's calls padded to a few row counts
(``platform/cpu/packing.py``: ``padded_rows``) and with each call at its own row count, in one engine, alternating.

oneDNN builds a matmul primitive for each row count it meets; every prompt of a new length made each packed linear
shape pay that once in its prefill. Each trial sends one prompt per setting, each of a length sent before by neither
(the radix cache off, one new token), so the unpadded calls always meet new row counts and the padded ones share the
counts earlier prompts met. Printed: the median time to first token of each setting and their ratio.

    python benchmarks/bench_prefill_rows.py --model-path demo --trials 12
    python benchmarks/bench_prefill_rows.py --model-path smollm2 --draft-model-path smollm2-eagle3
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_catch_up import filler_prompt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="demo")
    p.add_argument("--draft-model-path", default=None, help="an EAGLE-3 head: its catch-up on the prompt counts too")
    p.add_argument("--prompt-words", type=int, default=120, help="the first trial's prompt; each trial adds two words")
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--num-threads", type=int, default=2)
    ns = p.parse_args(argv)

    from specserve import Engine
    from specserve.demo_models import demo_path
    from specserve.platform.cpu import packing

    kw = {}
    if ns.draft_model_path:
        kw = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": demo_path(ns.draft_model_path)}
    engine = Engine(model_path=ns.model_path, dtype="bfloat16", num_threads=ns.num_threads, disable_radix_cache=True,
                    **kw)
    padded_from = packing.PAD_FROM

    def first_token(words: int) -> tuple[float, int]:
        start = time.perf_counter()
        out = engine.generate(filler_prompt(words), {"max_new_tokens": 1})
        return time.perf_counter() - start, out["meta_info"]["prompt_tokens"]

    first_token(ns.prompt_words // 2)  # warm-up
    times: dict[str, list[float]] = {"padded": [], "own row count": []}
    lengths = []
    for i in range(ns.trials):
        for setting in (("padded", "own row count") if i % 2 else ("own row count", "padded")):
            packing.PAD_FROM = padded_from if setting == "padded" else 1 << 62
            seconds, tokens = first_token(ns.prompt_words + 2 * i + (setting == "padded"))
            times[setting].append(seconds)
            lengths.append(tokens)
    packing.PAD_FROM = padded_from
    engine.shutdown()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    what = f"{ns.model_path} + {ns.draft_model_path}" if ns.draft_model_path else ns.model_path
    print(f"{what}, bf16, {ns.num_threads} threads, {ns.trials} trials, prompts of {min(lengths)}-{max(lengths)} "
          f"tokens, each length once")
    print(f"time to first token: padded {med['padded']:.2f} ms, own row count {med['own row count']:.2f} ms, "
          f"own / padded {med['own row count'] / med['padded']:.3f}")


if __name__ == "__main__":
    main()

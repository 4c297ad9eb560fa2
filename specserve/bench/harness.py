"""Measurement helpers shared by the benchmark commands here and the developer benchmarks in ``benchmarks/``:
engine and transformers set-up, greedy-id comparison, per-step timing and the JSON report."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def all_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def write_json(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def flush_prefix_cache(engine) -> None:
    """Drop the radix cache so every run prefills its prompts (the engine may still be wrapping up)."""
    for _ in range(500):
        if engine.flush_cache():
            return
        time.sleep(0.01)
    raise RuntimeError("specserve engine stayed busy; could not flush its prefix cache")


BUILD_PASSES = 4  # untimed passes at most while an engine builds its graphs in the background


def build_background_graphs(engine, run_pass, passes: int = BUILD_PASSES) -> list[int]:
    """An engine under --torch-compile-in-background: call run_pass() (its prompts, untimed) and wait for the compile
    thread, until a pass builds no new graph (at most `passes`), so what is timed next meets built graphs only.
    -> the engine's graph count after each pass."""
    counts: list[int] = []
    for _ in range(passes):
        before = engine.get_server_info()["torch_compile_graphs"]
        run_pass()
        engine.scheduler.runner.background_compiler.wait()
        counts.append(engine.get_server_info()["torch_compile_graphs"])
        if counts[-1] == before:
            break
    return counts


def load_hf(model_dir: str, dtype: str):
    """-> (transformers model, pad id)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    pad_id = read_config(model_dir).get("pad_token_id")
    return model, (0 if pad_id is None else pad_id)


def compare_ids(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy-id agreement per request: equal flags and the first differing position (None = equal)."""
    first = []
    for x, y in zip(a, b, strict=True):
        diff = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), None)
        if diff is None and len(x) != len(y):
            diff = min(len(x), len(y))
        first.append(diff)
    return {"all_equal": all(d is None for d in first), "rows_equal": sum(d is None for d in first),
            "rows": len(first), "first_mismatch": first}


class StepClock:
    """Accumulates wall time of forwards by mode and of the proposer's hooks on one engine.

    Its wrappers put the engine's objects in reference cycles, which only the cycle collector breaks: a sweep that
    loads one engine after another (each with its KV pool) runs ``gc.collect()`` once it has dropped an engine."""

    def __init__(self, engine) -> None:
        self.times: dict[str, list[float]] = {}
        sched = engine.scheduler
        self._wrap(sched.runner, "forward", lambda fb: fb.mode.value)
        if getattr(sched.decoder, "proposer", None) is not None:
            for hook in ("propose", "after_verify"):
                self._wrap(sched.decoder.proposer, hook, lambda *a, h=hook: h)

    def _wrap(self, obj, name: str, key) -> None:
        orig = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            self.times.setdefault(key(*args), []).append(time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)

    def mean_ms(self, key: str) -> float:
        values = self.times.get(key, [])
        return 1000 * statistics.fmean(values) if values else float("nan")

    def reset(self) -> None:
        self.times.clear()

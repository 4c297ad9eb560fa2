"""What a speculative step costs in operator calls alone, and the most that leaves EAGLE-3 over plain decoding.

A speculative step's wall time is the operators it calls (the target's verify forward, the head's forwards and
rankings: specserve's CPU operators such as ``decoder_layer``, ``small_gemm``, ``draft_levels``, ``draft_topk``,
``race_walk``, each timed around its call from Python) and everything between them (Python bookkeeping and small torch
calls). Were every microsecond between the operators gone, a step would cost its operator time alone, and EAGLE-3
would run at most ``accept length x plain decoding's step / operator time a step`` times plain decoding's speed: the
ceiling this script prints per tree, beside the speed-up measured and the parts of a step (its verify forward, its
drafting: the proposal and the head's catch-up, and the rest), each with its operators' time in parentheses. Every
figure is of decode steps alone (prefill excluded): a step is a call of the scheduler's decode step, speculative or
plain.

Plain decoding and one EAGLE-3 engine per tree (speculating at every step) in one process, every held-out prompt
through each engine in turn, the order reversed every other round; sampled requests are seeded from their prompt, so
every engine writes the same tokens (the script counts the outputs equal to plain decoding's).

    python benchmarks/bench_step_floor.py --model-path demo --temperature 0.7 --trees "5,4,6;8,3,12"
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specserve import Engine
from specserve.bench.bench_compare import held_out_inputs, parse_tree, resolve_path, tree_kv_margin
from specserve.bench.bench_ngram import ours_prepare, ours_runner


class OpClock:
    """Wall time inside specserve's CPU operators while a step of the engine being timed runs (``active``), by the
    part of the step that called them (``part``). The operators are timed from ``install`` on, into the clock made
    last."""

    current: OpClock | None = None
    _installed: tuple | None = None  # the originals ``install`` replaced

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)  # by the part of the step that called the operator
        self.part = "rest"
        self.active = False
        self._depth = 0
        OpClock.current = self

    def timed(self, call, *args, **kwargs):
        """call(*args, **kwargs), its time added to this clock's part where it is active (not nested in another)."""
        if not self.active or self._depth:
            return call(*args, **kwargs)
        self._depth += 1
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds[self.part] += time.perf_counter() - start
            self._depth -= 1

    @classmethod
    def install(cls) -> None:
        """Time every call of a ``torch.ops.specserve`` operator (the operator class's ``__call__``, however the
        caller holds it) and of ``packing.cpu_gemv`` (one-row linears on PyTorch's kernel), once per process."""
        if cls._installed:
            return
        from torch._ops import OpOverload

        from specserve.platform.cpu import packing

        op_call = OpOverload.__call__

        def call(op, *args, **kwargs):
            clock = cls.current
            if clock is None or op.namespace != "specserve":
                return op_call(op, *args, **kwargs)
            return clock.timed(op_call, op, *args, **kwargs)

        gemv = packing.cpu_gemv
        cls._installed = (op_call, gemv)
        OpOverload.__call__ = call
        packing.cpu_gemv = lambda *args, **kwargs: (gemv(*args, **kwargs) if cls.current is None
                                                    else cls.current.timed(gemv, *args, **kwargs))

    @classmethod
    def uninstall(cls) -> None:
        """Undo ``install``."""
        if not cls._installed:
            return
        from torch._ops import OpOverload

        from specserve.platform.cpu import packing

        OpOverload.__call__, packing.cpu_gemv = cls._installed
        cls._installed = None
        cls.current = None


class StepParts:
    """Per decode step of one engine: its wall time and, for a speculative engine, its verify forward's and drafting's
    (the rest: what is left of the step), each part with the time of the operators called inside it."""

    PARTS = ("verify", "draft", "rest")

    def __init__(self, engine: Engine, ops: OpClock) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.ops = ops
        sched = engine.scheduler
        self._wrap_step(sched)
        proposer = getattr(sched.decoder, "proposer", None)
        if proposer is not None:
            self._wrap_part(sched.decoder, "_verify_forward", "verify")
            for hook in ("propose", "after_verify"):
                self._wrap_part(proposer, hook, "draft")

    def _wrap_step(self, sched) -> None:
        orig, ops = sched._run_decode, self.ops

        def timed(*args, **kwargs):
            ops.seconds.clear()
            ops.active, ops.part = True, "rest"
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.totals["step"] += time.perf_counter() - start
                ops.active = False
                for part, seconds in ops.seconds.items():
                    self.totals[f"{part} ops"] += seconds
                self.steps += 1

        sched._run_decode = timed

    def _wrap_part(self, obj, name: str, part: str) -> None:
        orig, ops = getattr(obj, name), self.ops

        def timed(*args, **kwargs):
            outer, ops.part = ops.part, part
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.totals[part] += time.perf_counter() - start
                ops.part = outer

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.totals.clear()
        self.steps = 0

    def ms(self, key: str) -> float:
        return 1e3 * self.totals[key] / max(1, self.steps)

    def figures(self) -> dict[str, float]:
        """ms a step: step, verify, draft and rest, each also as '<part> ops', and 'ops' (every operator)."""
        out = {key: self.ms(key) for key in ("step", "verify", "draft")}
        out["rest"] = out["step"] - out["verify"] - out["draft"]
        for part in self.PARTS:
            out[f"{part} ops"] = self.ms(f"{part} ops")
        out["ops"] = sum(out[f"{part} ops"] for part in self.PARTS)
        return out


def parse_trees(text: str) -> list[tuple[int, int, int]]:
    trees = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        try:
            trees.append(parse_tree(item))
        except ValueError:
            raise SystemExit(f"--trees: {item!r} is not STEPS,TOPK,DRAFT_TOKENS") from None
    if not trees:
        raise SystemExit("--trees: no tree given")
    return trees


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="demo")
    p.add_argument("--draft", default=None, help="the EAGLE-3 head (default: the model's bundled one, <model>-eagle3)")
    p.add_argument("--trees", default="8,3,12", help="STEPS,TOPK,DRAFT_TOKENS, separated by ';'")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=8, help="the first N held-out requests")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-threads", type=int, default=2)
    a = p.parse_args(argv)
    trees = parse_trees(a.trees)
    draft = resolve_path(a.draft or f"{a.model_path}-eagle3")
    torch.set_num_threads(a.num_threads)
    target = resolve_path(a.model_path)
    prompts, warmup = held_out_inputs(a.model_path, a.num_prompts)
    kv = max(len(x) for x in [*prompts, warmup]) + a.max_new_tokens + max(tree_kv_margin(t) for t in trees)
    ops = OpClock()
    names = ["plain", *(",".join(map(str, t)) for t in trees)]
    engines: dict[str, Engine] = {}
    try:
        for name, tree in zip(names, [None, *trees], strict=True):
            kw = {}
            if tree is not None:
                kw = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                          speculative_num_steps=tree[0], speculative_eagle_topk=tree[1],
                          speculative_num_draft_tokens=tree[2], disable_speculative_auto_off=True)
            engines[name] = Engine(model_path=target, dtype=a.dtype, num_threads=a.num_threads, max_total_tokens=kv,
                                   log_level="warning", **kw)
        ops.install()
        parts = {n: StepParts(e, ops) for n, e in engines.items()}
        runners = {n: ours_runner(e, a.max_new_tokens, a.temperature) for n, e in engines.items()}
        prepare = {n: ours_prepare(e) for n, e in engines.items()}
        for n in names:
            runners[n](warmup)
            parts[n].reset()
        per_round: dict[str, list[dict]] = {n: [] for n in names}
        outputs: dict[str, list[list[int]]] = {n: [] for n in names}
        for r in range(a.rounds):
            order = names if r % 2 == 0 else names[::-1]
            tokens, verifies = defaultdict(int), defaultdict(int)
            for ids in prompts:
                for n in order:
                    prepare[n]()
                    out, verify_ct, _ = runners[n](ids)
                    tokens[n] += len(out) - 1  # the first came from the prefill
                    verifies[n] += verify_ct
                    if r == 0:
                        outputs[n].append(out)
            for n in names:
                per_round[n].append({**parts[n].figures(),
                                     "accept": tokens[n] / verifies[n] if verifies[n] else 1.0})
                parts[n].reset()
            print(f"round {r + 1}: " + ", ".join(f"{n} {per_round[n][-1]['step']:.2f} ms a step" for n in names),
                  flush=True)
    finally:
        ops.uninstall()
        for engine in engines.values():
            engine.shutdown()
    report(a, names, per_round, outputs)


def report(a, names: list[str], per_round: dict[str, list[dict]], outputs: dict[str, list[list[int]]]) -> None:
    def med(n: str, key: str) -> float:
        return statistics.median(x[key] for x in per_round[n])

    print(f"\n{a.model_path}, {a.dtype}, {a.num_threads} threads, {a.num_prompts} prompts x {a.max_new_tokens} tokens, "
          f"temperature {a.temperature}, {a.rounds} rounds (medians)")
    print(f"plain decoding: {med('plain', 'step'):.3f} ms a step, operators {med('plain', 'ops'):.3f} ms")
    print("| tree | accept length | step ms (operators) | verify forward | drafting | rest | over plain (rounds) | "
          "ceiling, operators only (rounds) | outputs equal to plain |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|")
    for n in names[1:]:
        rows = list(zip(per_round[n], per_round["plain"], strict=True))
        speedups = [s["accept"] * b["step"] / s["step"] for s, b in rows]
        ceilings = [s["accept"] * b["step"] / s["ops"] for s, b in rows if s["ops"] > 0]
        cells = [f"{med(n, key):.2f} ({med(n, key + ' ops'):.2f})" for key in ("verify", "draft", "rest")]
        step, ops = med(n, "step"), med(n, "ops")
        equal = sum(x == y for x, y in zip(outputs[n], outputs["plain"], strict=True))
        accept = statistics.mean(x["accept"] for x in per_round[n])
        over = f"{statistics.median(speedups):.2f} ({', '.join(f'{x:.2f}' for x in speedups)})"
        print(f"| {n} | {accept:.2f} | {step:.2f} ({ops:.2f}, {ops / step:.0%}) | {' | '.join(cells)} | {over} | "
              f"{ceiling_text(ceilings)} | {equal}/{len(outputs['plain'])} |")


def ceiling_text(ceilings: list[float]) -> str:
    """The ceiling's median and rounds; "-" where no operator of specserve's ran (e.g. float32, or no C++ build)."""
    if not ceilings:
        return "-"
    return f"{statistics.median(ceilings):.2f} ({', '.join(f'{x:.2f}' for x in ceilings)})"


if __name__ == "__main__":
    main()

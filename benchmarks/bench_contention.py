"""Plain greedy decoding while other processes keep CPU cores busy: specserve (its defaults) against transformers
``generate`` (its defaults), on the same model and prompts; or (``--against eager``) specserve compiling its forwards
in the background (``--specserve-compile``) against its own eager decoding.

Each engine runs in its own worker process, loaded once and warmed up; the neighbours are separate processes
started for one condition and stopped after it. Within a condition the engines take turns, rep by rep (the first
of the pair alternating), each decoding every prompt (the prefix cache flushed before each, as transformers has
none). Conditions, in the order given (``--conditions``):

    quiet            no neighbour
    KIND[:N]         N (default 1) neighbours of one kind:
                     python    a tight pure-Python loop (one core)
                     numpy     small numpy matmuls in a loop, one BLAS thread (one core)
                     torch     small torch matmuls, 1 thread (one core)
                     torch-mt  torch matmuls at torch's default thread count (every core: a multi-threaded job)

Reported per condition: specserve's tokens/s in the condition's first run, during which its thread count adapts
(that run is not counted: ``--warmup-runs``); tokens/s of each engine (median and min-max over reps); specserve /
the other engine (median and min-max of the per-rep ratios); busy / quiet of each engine (its median against its
median in the first quiet condition); specserve's thread count at the end of the condition and its switches so
far; the machine's load average as the condition started; whether specserve's greedy ids equal its first quiet
rep's.

    python benchmarks/bench_contention.py [--conditions quiet,python,python:2,torch-mt,quiet] [--reps 3]
        [--num-prompts 2] [--max-new-tokens 64] [--model-path demo] [--dtype bfloat16] [--specserve-threads N]
        [--specserve-compile] [--against transformers|eager] [--json PATH]

With ``--specserve-compile`` the warm-up runs until every graph is built (on a cold torch.compile cache its
child process fills the cache first: minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from specserve.bench.report import format_table

BASELINES = ("transformers", "eager")  # the engine specserve is compared with: transformers, or specserve eager
WARMUP_TEXT = "def warm_up(x):\n    return x + 1\n\ndef warm_up(x):"
# what each kind of neighbour runs until it is killed (python -c)
NEIGHBOURS = {
    "python": "while True:\n    pass",
    "numpy": "import numpy as np\na = np.random.rand(128, 128)\nwhile True:\n    a = np.tanh(a @ a)",
    "torch": ("import torch\ntorch.set_num_threads(1)\nx = torch.randn(256, 256)\n"
              "while True:\n    x = torch.tanh(x @ x)"),
    "torch-mt": "import torch\nx = torch.randn(512, 512)\nwhile True:\n    x = torch.tanh(x @ x)",
}
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------------------------- conditions
@dataclass(frozen=True)
class Condition:
    kind: str | None  # None: quiet
    count: int = 0

    @property
    def label(self) -> str:
        return "quiet" if self.kind is None else f"{self.count} x {self.kind}"


def parse_condition(text: str) -> Condition:
    """'quiet', 'python', 'python:2' -> a Condition (ValueError for an unknown kind or a bad count)."""
    if text == "quiet":
        return Condition(None)
    kind, _, count = text.partition(":")
    if kind not in NEIGHBOURS:
        raise ValueError(f"unknown neighbour kind {kind!r} (one of {', '.join(NEIGHBOURS)}, or quiet)")
    n = int(count) if count else 1
    if n < 1:
        raise ValueError(f"neighbour count must be >= 1: {text!r}")
    return Condition(kind, n)


def neighbour_command(kind: str) -> tuple[list[str], dict[str, str]]:
    """-> (argv, environment) of one neighbour process: one-core kinds get one thread of every math library."""
    env = dict(os.environ)
    if kind != "torch-mt":
        env.update(ONE_THREAD_ENV)
    return [sys.executable, "-c", NEIGHBOURS[kind]], env


@contextlib.contextmanager
def neighbours(cond: Condition, settle_s: float) -> Iterator[list[subprocess.Popen]]:
    """The condition's neighbour processes, running for the body (given settle_s to start spinning)."""
    procs = []
    try:
        for _ in range(cond.count):
            argv, env = neighbour_command(cond.kind)
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if procs:
            time.sleep(settle_s)
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


# ---------------------------------------------------------------------------------------------- engine workers
def _worker(conn, engine: str, model_dir: str, dtype: str, prompts: list[list[int]], warmup: list[int],
            max_new_tokens: int, threads: int | None, compile_: bool = False) -> None:
    """Load one engine with its defaults (specserve: ``threads`` fixes its count; ``compile_``: background compile,
    every graph built during the warm-up; eager: specserve without it), warm it up, then decode every prompt on
    each "run" message."""
    from specserve.bench.bench_ngram import hf_runner, ours_prepare, ours_runner

    prepare, info = (lambda: None), dict
    if engine in ("specserve", "eager"):
        from specserve import Engine
        from specserve.bench.harness import build_background_graphs

        kv_tokens = max(len(p) for p in [*prompts, warmup]) + max_new_tokens + 64
        compiled = compile_ and engine == "specserve"
        eng = Engine(model_path=model_dir, dtype=dtype, max_total_tokens=kv_tokens, log_level="warning",
                     num_threads=threads, torch_compile_in_background=compiled)
        run, prepare = ours_runner(eng, max_new_tokens), ours_prepare(eng)
        if compiled:
            build_background_graphs(eng, lambda: [run(p) for p in (warmup, *prompts[:1])], passes=6)
        fields = ("cpu_threads", "cpu_thread_switches", "cpu_thread_probes")

        def info() -> dict:
            state = eng.get_server_info()
            return {k: state.get(k) for k in fields}
    else:
        from specserve.bench.harness import load_hf

        model, pad_id = load_hf(model_dir, dtype)
        run = hf_runner(model, pad_id, max_new_tokens)
    run(warmup)
    conn.send("ready")
    while conn.recv() == "run":
        tokens, seconds, ids = 0, 0.0, []
        for p in prompts:
            prepare()
            start = time.perf_counter()
            out = run(p)[0]
            seconds += time.perf_counter() - start
            tokens += len(out)
            ids.append(out)
        conn.send({"tokens": tokens, "seconds": seconds, "ids": ids, **info()})


class Worker:
    def __init__(self, engine: str, model_dir: str, dtype: str, prompts, warmup, max_new_tokens: int,
                 threads: int | None = None, compile_: bool = False) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no torch state (threads, OpenMP pools) shared
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, engine, model_dir, dtype, prompts, warmup,
                                                      max_new_tokens, threads, compile_), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{engine} worker did not start")

    def run(self) -> dict:
        self.conn.send("run")
        return self.conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.proc.join(timeout=30)


# ---------------------------------------------------------------------------------------------- figures
def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(samples: list[dict], baseline: str = "transformers") -> list[dict]:
    """samples: {"condition", "rep", "engine", "tokens", "seconds", "ids", ...} -> one row per condition, in order.
    A condition given twice (quiet at the start and the end) keeps its rows apart by its position ("index")."""
    engines = ("specserve", baseline)
    rows, quiet, quiet_ids = [], {}, None
    for index in dict.fromkeys(s["index"] for s in samples):
        first = next((s for s in samples if s["index"] == index and s["engine"] == "specserve"), None)
        cs = [s for s in samples if s["index"] == index and s["rep"] >= 0]
        tps = {e: [s["tokens"] / s["seconds"] for s in cs if s["engine"] == e] for e in engines}
        pairs = {}  # rep -> engine -> tok/s
        for s in cs:
            pairs.setdefault(s["rep"], {})[s["engine"]] = s["tokens"] / s["seconds"]
        ratios = [p["specserve"] / p[baseline] for p in pairs.values() if len(p) == 2]
        ours = [s for s in cs if s["engine"] == "specserve"]
        row = {"condition": cs[0]["condition"], "index": index, "load": cs[0].get("load"),
               "specserve_first_run": first["tokens"] / first["seconds"] if first is not None else None,
               **{e: _spread(v) for e, v in tps.items() if v},
               "ours_over_baseline": _spread(ratios) if ratios else None,
               "cpu_threads": ours[-1].get("cpu_threads") if ours else None,
               "cpu_thread_switches": ours[-1].get("cpu_thread_switches") if ours else None}
        if row["condition"] == "quiet" and not quiet:
            quiet = {e: row[e]["median"] for e in engines if e in row}
            quiet_ids = ours[0]["ids"] if ours else None
        row["busy_over_quiet"] = {e: row[e]["median"] / quiet[e] for e in engines if e in row and e in quiet}
        row["ids_equal_quiet"] = all(s["ids"] == quiet_ids for s in ours) if quiet_ids is not None else None
        rows.append(row)
    return rows


def _fmt(spread: dict | None, digits: int) -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"


def render(rows: list[dict], baseline: str = "transformers") -> str:
    shown = [{"condition": r["condition"], "load": "-" if r["load"] is None else f"{r['load']:.2f}",
              "ours": _fmt(r.get("specserve"), 1), "hf": _fmt(r.get(baseline), 1),
              "first": "-" if r["specserve_first_run"] is None else f"{r['specserve_first_run']:.1f}",
              "ratio": _fmt(r["ours_over_baseline"], 2),
              "ours_bq": _ratio(r["busy_over_quiet"].get("specserve")),
              "hf_bq": _ratio(r["busy_over_quiet"].get(baseline)),
              "threads": f"{r['cpu_threads']} ({r['cpu_thread_switches']})",
              "ids": "-" if r["ids_equal_quiet"] is None else ("yes" if r["ids_equal_quiet"] else "NO")}
             for r in rows]
    return format_table(shown, [("condition", "neighbours", None), ("load", "load 1m", None),
                                ("first", "specserve first run", None),
                                ("ours", "specserve tok/s", None), ("hf", f"{baseline} tok/s", None),
                                ("ratio", f"specserve / {baseline}", None), ("ours_bq", "specserve busy/quiet", None),
                                ("hf_bq", f"{baseline} busy/quiet", None),
                                ("threads", "specserve threads (switches)", None), ("ids", "ids = quiet", None)])


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def machine_line() -> str:
    model = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    import torch
    import transformers

    return (f"{os.cpu_count()} CPUs ({model}), {len(os.sched_getaffinity(0))} usable; torch {torch.__version__}, "
            f"transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f} at start")


# ---------------------------------------------------------------------------------------------- command
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_contention.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--conditions", default="quiet,python,python:2,torch-mt,quiet",
                   help="comma-separated: quiet, or KIND[:N] with KIND one of " + ", ".join(NEIGHBOURS))
    p.add_argument("--reps", type=int, default=3, help="runs of each engine per condition")
    p.add_argument("--num-prompts", type=int, default=2, help="held-out demo prompts per run")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--model-path", default="demo")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--settle", type=float, default=1.0, help="seconds between starting neighbours and measuring")
    p.add_argument("--warmup-runs", type=int, default=1,
                   help="runs of each engine per condition before the counted reps (specserve's first one, in which "
                        "its thread count adapts to the new condition, is shown as 'first run')")
    p.add_argument("--specserve-threads", type=int, default=None,
                   help="--num-threads for specserve (a fixed count, no adaptation); default: its own choice")
    p.add_argument("--specserve-compile", action="store_true",
                   help="specserve compiles its forwards in the background (--torch-compile-in-background); the "
                        "warm-up waits for the graphs")
    p.add_argument("--against", default="transformers", choices=BASELINES,
                   help="the other engine: transformers generate, or specserve's eager decoding (with its defaults)")
    p.add_argument("--json", default=None, help="also write the rows (and the samples) here")
    args = p.parse_args(argv)
    try:
        args.conditions = [parse_condition(c.strip()) for c in args.conditions.split(",") if c.strip()]
    except ValueError as e:
        p.error(str(e))
    return args


def measure(args: argparse.Namespace, workers: dict[str, Worker]) -> list[dict]:
    samples = []
    for index, cond in enumerate(args.conditions):
        with neighbours(cond, args.settle):
            load = os.getloadavg()[0]
            for rep in range(-args.warmup_runs, args.reps):  # negative reps: the condition's untimed first runs
                engines = ("specserve", args.against)
                order = engines if rep % 2 == 0 else engines[::-1]
                for engine in order:
                    s = workers[engine].run()
                    samples.append({"condition": cond.label, "index": index, "rep": rep, "engine": engine,
                                    "load": load, **s})
                    which = f"rep {rep + 1}/{args.reps}" if rep >= 0 else "warm-up"
                    print(f"  {cond.label:>14} {which:>9} {engine:>12}: "
                          f"{s['tokens'] / s['seconds']:7.1f} tok/s", file=sys.stderr, flush=True)
    return samples


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    import transformers

    from specserve.bench.bench_compare import resolve_path
    from specserve.bench.eval_acceptance import held_out_prompts_for
    from specserve.bench.harness import write_json

    model_dir = resolve_path(args.model_path)
    encode = transformers.AutoTokenizer.from_pretrained(model_dir).encode
    prompts = [encode(t, add_special_tokens=True) for t in held_out_prompts_for(args.model_path, args.num_prompts)]
    warmup = encode(WARMUP_TEXT, add_special_tokens=True)
    print(machine_line())
    workers = {}
    try:
        for engine in ("specserve", args.against):
            workers[engine] = Worker(engine, model_dir, args.dtype, prompts, warmup, args.max_new_tokens,
                                     args.specserve_threads, args.specserve_compile)
        samples = measure(args, workers)
    finally:
        for w in workers.values():
            w.stop()
    rows = summarize(samples, args.against)
    compiled = ", specserve compiled in the background" if args.specserve_compile else ""
    print(f"{args.model_path} {args.dtype}, greedy, {len(prompts)} prompts x {args.max_new_tokens} new tokens per "
          f"run, {args.reps} reps per condition, engines alternating{compiled}; median (min-max)")
    print(render(rows, args.against))
    if args.json:
        write_json({"machine": machine_line(), "rows": rows,
                    "samples": [{k: v for k, v in s.items() if k != "ids"} for s in samples]}, args.json)
    return rows


if __name__ == "__main__":
    main()

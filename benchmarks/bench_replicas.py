"""Replicas: output tokens/s of one server against two replicas on the same CPUs, inside one server (--dp-size 2)
and as two servers behind SGLang's router.

Setups, all on this machine's C CPUs, started side by side before the first round (an idle server takes no CPU time):
- one:    ``specserve serve --num-threads C``
- dp2:    ``specserve serve --dp-size 2`` (each replica pinned to C/2 CPUs, C/2 threads)
- router: two ``specserve serve --num-threads C/2``, each pinned to its C/2 CPUs, behind ``sglang_router.launch_router``
          (``--policy``; the pip package sglang-router, unchanged)
Each round sends the same workload to each setup in turn: ``--num-prompts`` held-out prompts, greedy, exactly
``--max-new-tokens`` tokens each (``ignore_eos``), at most ``--concurrency`` in flight, streamed through the official
openai client (``specserve bench-serving``'s client; the prefix cache flushed first). Prints output tokens/s per
setup, the median over ``--rounds`` after one uncounted warm-up round, and each setup's ratio to ``one`` taken
round by round (median, min-max).

    python benchmarks/bench_replicas.py --rounds 3 [--server-flags "--speculative-algorithm EAGLE3 ..."]
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys

from specserve.bench.bench_serving import build_parser, first_model, for_api, load_dataset, run_once
from specserve.utils import free_port, terminate_process, wait_for_server

START_TIMEOUT_S = 600


class Setup:
    def __init__(self, name: str) -> None:
        self.name, self.procs, self.url = name, [], ""

    def close(self) -> None:
        for p in reversed(self.procs):
            terminate_process(p)


def serve(model: str, flags: list[str], cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """One `specserve serve` (pinned to `cpus` when given) -> (its process, its URL) once it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.launch_server", "--model-path", model, "--port", str(port),
           "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, timeout=START_TIMEOUT_S, process=proc)
    return proc, url


def router(worker_urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-port",
                             str(free_port()), "--log-level", "warn"])
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, timeout=120, process=proc)
    return proc, url


def start(names: list[str], model: str, flags: list[str], policy: str) -> list[Setup]:
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    if half < 1:
        raise SystemExit("two replicas need at least 2 CPUs")
    shares = [set(cpus[:half]), set(cpus[half:2 * half])]
    setups = []
    try:
        for name in names:
            s = Setup(name)
            setups.append(s)
            if name == "one":
                proc, s.url = serve(model, ["--num-threads", str(len(cpus)), *flags])
                s.procs.append(proc)
            elif name == "dp2":
                proc, s.url = serve(model, ["--dp-size", "2", *flags])
                s.procs.append(proc)
            else:
                urls = []
                for share in shares:
                    proc, url = serve(model, ["--num-threads", str(half), *flags], share)
                    s.procs.append(proc)
                    urls.append(url)
                proc, s.url = router(urls, policy)
                s.procs.append(proc)
    except BaseException:
        for s in setups:
            s.close()
        raise
    return setups


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--server-flags", default="", help="more flags for every server (one string)")
    p.add_argument("--setups", default="one,dp2,router", help="which run: one, dp2, router (one is the baseline)")
    p.add_argument("--policy", default="round_robin", help="sglang-router's --policy (round_robin, cache_aware, ...)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    names = ["one", *(n for n in args.setups.split(",") if n != "one")]
    if set(names) - {"one", "dp2", "router"}:
        p.error("--setups: choose from one, dp2, router")
    prompts = for_api(load_dataset("held-out", args.num_prompts, 0, 0), "completions")
    params = {"max_tokens": args.max_new_tokens, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    setups = start(names, args.model, shlex.split(args.server_flags), args.policy)
    tps: dict[str, list[float]] = {n: [] for n in names}
    try:
        for rnd in range(args.rounds + 1):
            for s in setups:
                ns = build_parser().parse_args(["--base-url", s.url, "--disable-tqdm"])
                row, records = run_once(ns, first_model(s.url, None), prompts, params, args.concurrency, math.inf)
                if row["failed"]:
                    raise SystemExit(f"{s.name}: {row['failed']} requests failed, e.g. "
                                     f"{next(r.error for r in records if not r.ok)}")
                if rnd > 0:  # round 0 warms up
                    tps[s.name].append(row["output_throughput"])
    finally:
        for s in setups:
            s.close()
    cpus = len(os.sched_getaffinity(0))
    print(f"{args.model} {args.server_flags or '(plain)'}, {cpus} CPUs, {args.num_prompts} prompts x "
          f"{args.max_new_tokens} tokens, concurrency {args.concurrency}; median of {args.rounds} rounds")
    print(f"{'setup':>8} {'tok/s':>8} {'vs one':>8} {'(min-max)':>12}")
    for n in names:
        ratios = [a / b for a, b in zip(tps[n], tps["one"], strict=True)]
        print(f"{n:>8} {statistics.median(tps[n]):>8.1f} {statistics.median(ratios):>8.2f} "
              f"{min(ratios):>5.2f}-{max(ratios):<5.2f}")


if __name__ == "__main__":
    main()

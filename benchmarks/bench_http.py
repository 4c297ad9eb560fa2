"""HTTP server benchmark: streaming throughput through the server vs the offline Engine, and latency.

Measured side by side in one run, on the same model, thread count and batch:

1. Throughput: a batch of B requests (token-id prompts, greedy, ``ignore_eos`` so each makes exactly its
   ``max_tokens``) run (a) by the offline ``Engine`` in this process (``generate`` on the whole batch) and
   (b) as B concurrent SSE streams through ``/v1/completions`` of a ``python -m specserve.launch_server``
   subprocess, read by a bare asyncio HTTP client in this process (lean, so that the client, which
   shares the machine, takes as little CPU from the server as possible). Rounds alternate A B A B after one
   warm-up each; the prefix cache is flushed before every run; ``ratio`` = HTTP tokens/s / Engine tokens/s,
   median of the per-round ratios (target >= 0.9).
2. Latency seen by a streaming client: time to first token (request sent -> first chunk with text) and
   inter-token latency (the gap before a chunk divided over the tokens it carries, from
   ``stream_options.continuous_usage_stats``) at 1 concurrent stream and at B concurrent streams (the
   latter from the throughput rounds); p50 / p90 / p99.

    python benchmarks/bench_http.py                      # small random Llama, batch 16
    python benchmarks/bench_http.py --model tiny --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from bench_core import Workload, _log, _random_ids, ensure_model, ensure_tokenizer, kv_tokens_needed, specserve_run
from specserve.bench.harness import all_cores, flush_prefix_cache
from specserve.utils import free_port, terminate_process, wait_for_server

TARGET_RATIO = 0.9
MODELS = {  # name -> make_model_dir overrides (vocab: the benchmark tokenizer's 512)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_http.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", help="tiny | small (random Llamas built here) | a model folder")
    p.add_argument("--threads", type=int, default=all_cores(), help="torch threads of engine and server")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--rounds", type=int, default=3, help="timed A/B rounds (median reported)")
    p.add_argument("--single-requests", type=int, default=8, help="sequential requests for the 1-stream latency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="bench_out/models")
    p.add_argument("--out", default="bench_out/bench_http.json")
    return p.parse_args(argv)


def model_dir(args: argparse.Namespace) -> str:
    if os.path.isdir(args.model):
        return args.model
    if args.model not in MODELS:
        raise SystemExit(f"--model must be one of {', '.join(MODELS)} or a model folder, got {args.model!r}")
    tok = ensure_tokenizer(args.work_dir)
    return ensure_model(args.work_dir, f"http-{args.model}-llama-ctx2048", "float32", tok,
                        max_position_embeddings=2048, **MODELS[args.model])


def workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    lens = [rng.randint(args.prompt_min, args.prompt_max) for _ in range(args.batch_size)]
    return Workload(f"batch{args.batch_size}", [_random_ids(rng, n, vocab) for n in lens],
                    [args.new_tokens] * args.batch_size)


# ---------------------------------------------------------------------------------------------- HTTP client
@dataclass
class StreamStats:
    tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


async def stream_one(host: str, port: int, prompt: list[int], max_tokens: int) -> StreamStats:
    """One streamed /v1/completions request over a bare asyncio connection (HTTP/1.1, chunked SSE): the
    client does as little work as possible, so it perturbs the server it shares the machine with little."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
    stats = StreamStats()
    reader, writer = await asyncio.open_connection(host, port)
    sent = last = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP error: {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):  # headers (uvicorn streams chunked)
        pass
    buf = b""
    while size := int((await reader.readline()).strip() or b"0", 16):
        buf += (await reader.readexactly(size + 2))[:-2]
        *events, buf = buf.split(b"\n\n")
        now = time.perf_counter()
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            done = json.loads(event[6:])["usage"]["completion_tokens"]
            new = done - stats.tokens
            if new <= 0:
                continue
            if stats.ttft_s is None:
                stats.ttft_s = now - sent
                stats.itl_s.extend([0.0] * (new - 1))  # tokens that came with the first one
            else:
                stats.itl_s.extend([(now - last) / new] * new)
            stats.tokens, last = done, now
    writer.close()
    return stats


async def stream_batch(url: str, wl: Workload) -> list[StreamStats]:
    u = urlparse(url)
    return await asyncio.gather(*[stream_one(u.hostname, u.port, p, n)
                                  for p, n in zip(wl.prompts, wl.new_tokens, strict=True)])


def http_run(url: str, wl: Workload) -> tuple[float, int, list[StreamStats]]:
    t0 = time.perf_counter()
    stats = asyncio.run(stream_batch(url, wl))
    return time.perf_counter() - t0, sum(s.tokens for s in stats), stats


def flush_server(url: str) -> None:
    import requests

    for _ in range(500):
        if requests.post(url + "/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(0.01)
    raise RuntimeError("the server stayed busy; could not flush its prefix cache")


def start_server(path: str, args: argparse.Namespace, kv_tokens: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--model-path", path, "--port",
                             str(port), "--num-threads", str(args.threads), "--max-total-tokens", str(kv_tokens),
                             "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, timeout=600, process=proc)
    return proc, url


# ---------------------------------------------------------------------------------------------- report
def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    qs = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return {"p50_ms": 1e3 * qs[49], "p90_ms": 1e3 * qs[89], "p99_ms": 1e3 * qs[98], "n": len(xs)}


def latency(stats: list[StreamStats]) -> dict:
    return {"ttft": percentiles([s.ttft_s for s in stats if s.ttft_s is not None]),
            "itl": percentiles([x for s in stats for x in s.itl_s])}


def format_report(r: dict) -> str:
    t = r["throughput"]
    lines = [
        f"model {r['model']} | threads {r['threads']} | batch {r['workload']['batch_size']} x "
        f"{r['workload']['new_tokens'][0]} new tokens | rounds {r['rounds']}",
        f"throughput  engine {t['engine_tokens_per_s']:.1f} tok/s   http {t['http_tokens_per_s']:.1f} tok/s   "
        f"ratio {t['ratio']:.3f} (per round {', '.join(f'{x:.3f}' for x in t['ratios'])}; target >= "
        f"{TARGET_RATIO})",
        "latency (ms)        TTFT p50 / p90 / p99          ITL p50 / p90 / p99",
    ]
    for name, lat in r["latency"].items():
        a, b = lat["ttft"], lat["itl"]
        lines.append(f"  {name:<16}  {a['p50_ms']:7.1f} / {a['p90_ms']:7.1f} / {a['p99_ms']:7.1f}      "
                     f"{b['p50_ms']:6.2f} / {b['p90_ms']:6.2f} / {b['p99_ms']:6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    import specserve

    torch.set_num_threads(args.threads)
    path = model_dir(args)
    wl = workload(args, vocab=512)
    kv = kv_tokens_needed([wl])
    engine = specserve.Engine(model_path=path, max_total_tokens=kv, num_threads=args.threads, log_level="warning")
    proc, url = start_server(path, args, kv)
    try:
        engine_s, http_s, ratios, batch_stats = [], [], [], []
        for i in range(args.rounds + 1):  # round 0 warms both up
            flush_prefix_cache(engine)
            t0 = time.perf_counter()
            _, engine_tokens = specserve_run(engine, wl)
            te = time.perf_counter() - t0
            flush_server(url)
            th, http_tokens, stats = http_run(url, wl)
            assert engine_tokens == http_tokens == wl.useful_tokens, (engine_tokens, http_tokens)
            _log(f"round {i}: engine {te:.2f}s, http {th:.2f}s" + (" (warm-up)" if i == 0 else ""))
            if i > 0:
                engine_s.append(te)
                http_s.append(th)
                ratios.append(te / th)
                batch_stats.extend(stats)
        single = Workload("single", wl.prompts[:1], wl.new_tokens[:1])
        single_stats = []
        for _ in range(args.single_requests):
            flush_server(url)
            single_stats.extend(http_run(url, single)[2])
    finally:
        terminate_process(proc)
        engine.shutdown()
    report = {
        "model": path, "threads": args.threads, "rounds": args.rounds, "workload": wl.describe(),
        "throughput": {
            "engine_tokens_per_s": wl.useful_tokens / statistics.median(engine_s),
            "http_tokens_per_s": wl.useful_tokens / statistics.median(http_s),
            "ratios": ratios, "ratio": statistics.median(ratios), "target": TARGET_RATIO,
            "engine_times_s": engine_s, "http_times_s": http_s,
        },
        "latency": {"1 stream": latency(single_stats), f"{args.batch_size} streams": latency(batch_stats)},
    }
    print(format_report(report))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()

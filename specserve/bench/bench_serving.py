"""``specserve bench-serving``: load a RUNNING specserve (or any OpenAI-compatible) server and measure it, like
SGLang's ``python -m sglang.bench_serving``.

    specserve serve &                                  # the default model with EAGLE-3, port 30000
    specserve bench-serving                            # 16 held-out prompts, 64 tokens, concurrency 1 then 4
    specserve bench-serving --base-url http://host:8000 --api chat --dataset prompts.jsonl \\
        --num-prompts 200 --max-new-tokens 256 --max-concurrency 1,8,32 --request-rate 4

Every request is streamed through the official ``openai`` client (``stream_options.include_usage``, so the
output token count is the server's own). Per request: TTFT (request sent -> first chunk with text), ITL (the
gaps between chunks with text; a speculative step can deliver several tokens in one chunk, so ITL is per
chunk), TPOT = (e2e - TTFT) / (output tokens - 1) (per token), e2e latency and the token counts. Per run (one
per ``--max-concurrency`` x ``--request-rate`` value): request and token throughput, mean/p50/p90/p99 of
TTFT/ITL/TPOT/e2e, failed requests (an error fails its request, never the run) and, when the server reports
``avg_spec_accept_length`` in ``/get_server_info``, the accept length of the run's own verify steps.

Requests arrive all at once (``--request-rate inf``) or as a Poisson process (``--seed``), and at most
``--max-concurrency`` are in flight. The server's prefix cache is flushed (best effort) before each run so
runs see the same cache state. Written to ``--out-dir``: requests.jsonl (one record per request),
summary.jsonl (one row per run), summary.md (the table, also printed), throughput.png and latency.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import string
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from specserve.bench.report import (
    format_table,
    import_extra,
    percentiles,
    plot_lines,
    report_missing_extra,
    write_jsonl,
)

DEFAULT_BASE_URL = "http://127.0.0.1:30000"
HELD_OUT = "held-out"
RANDOM = "random"
APIS = ("completions", "chat")
REQUEST_TIMEOUT_S = 3600.0
FLUSH_TRIES = 100
METRICS = ("ttft", "itl", "tpot", "e2e")


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class Prompt:
    """One request's input: a completion prompt or chat messages (exactly one is set)."""

    text: str | None = None
    messages: list[dict] | None = None


@dataclass
class RequestRecord:
    """What one streamed request measured (times in ms from the moment it was sent)."""

    index: int  # the prompt's index in the dataset
    ok: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    tokens_counted: str = "usage"  # "usage": the server's count; "chunks": no usage came, chunks counted
    chunks: int = 0  # chunks with text
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    start_s: float = 0.0  # when it was sent, from the start of the run


def chunk_timing(sent: float, text_times: Sequence[float], end: float, output_tokens: int) -> dict:
    """TTFT, ITLs, TPOT and e2e (ms) of one stream from its clock readings (s): sent, each chunk with text, end.
    TPOT is None below 2 output tokens; TTFT None when no text came."""
    ms = 1e3
    ttft = (text_times[0] - sent) * ms if text_times else None
    e2e = (end - sent) * ms
    itl = [(b - a) * ms for a, b in zip(text_times, text_times[1:], strict=False)]
    tpot = (e2e - ttft) / (output_tokens - 1) if ttft is not None and output_tokens > 1 else None
    return {"ttft_ms": ttft, "e2e_ms": e2e, "itl_ms": itl, "tpot_ms": tpot}


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the run's start) of n requests: all 0 at rate inf, else a Poisson process (exponential
    gaps of mean 1/rate, seeded; the first request leaves after one gap, as in SGLang)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _chunk_text(chunk, api: str) -> str:
    if not chunk.choices:
        return ""
    if api == "chat":
        return chunk.choices[0].delta.content or ""
    return chunk.choices[0].text or ""


async def send_one(client, api: str, model: str, prompt: Prompt, params: dict, index: int, t0: float
                   ) -> RequestRecord:
    """Stream one request; any error is recorded in the record (ok=False), never raised."""
    rec = RequestRecord(index=index)
    sent = time.perf_counter()
    rec.start_s = sent - t0
    text_times: list[float] = []
    usage = None
    try:
        kw = dict(model=model, stream=True, stream_options={"include_usage": True}, **params)
        if api == "chat":
            stream = await client.chat.completions.create(messages=prompt.messages, **kw)
        else:
            stream = await client.completions.create(prompt=prompt.text, **kw)
        async for chunk in stream:
            if _chunk_text(chunk, api):
                text_times.append(time.perf_counter())
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
    except Exception as e:  # noqa: BLE001 - a failed request is a measurement, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.e2e_ms = (time.perf_counter() - sent) * 1e3
        return rec
    rec.chunks = len(text_times)
    if usage is not None:
        rec.output_tokens, rec.prompt_tokens = usage.completion_tokens, usage.prompt_tokens
    else:  # no usage from this server: each chunk with text carries at least one token (a lower bound)
        rec.output_tokens, rec.tokens_counted = len(text_times), "chunks"
    for key, value in chunk_timing(sent, text_times, time.perf_counter(), rec.output_tokens).items():
        setattr(rec, key, value)
    rec.ok = True
    return rec


# ---------------------------------------------------------------------------------------------- datasets
def random_text(n_chars: int, rng: random.Random) -> str:
    """n_chars random printable ASCII characters (letters, digits, punctuation, spaces)."""
    alphabet = string.ascii_letters + string.digits + string.punctuation + "    "
    return "".join(rng.choice(alphabet) for _ in range(n_chars))


def read_dataset_file(path: str) -> list[Prompt]:
    """.jsonl: a "prompt" string or chat "messages" list per record; any other file: one prompt per non-empty
    line."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\r\n") for line in f]
    if not path.endswith(".jsonl"):
        return [Prompt(text=line) for line in lines if line.strip()]
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            out.append(Prompt(text=rec["prompt"]))
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            out.append(Prompt(messages=rec["messages"]))
        else:
            raise ValueError(f"{path} line {n}: expected a JSON object with a \"prompt\" string or a "
                             "\"messages\" list")
    return out


def load_dataset(source: str, num_prompts: int, random_input_len: int, seed: int) -> list[Prompt]:
    if source == HELD_OUT:
        from specserve.train.corpus import held_out_prompts

        return [Prompt(text=p) for p in held_out_prompts(num_prompts)]
    if source == RANDOM:
        rng = random.Random(seed)
        return [Prompt(text=random_text(random_input_len, rng)) for _ in range(num_prompts)]
    prompts = read_dataset_file(source)[:num_prompts]
    if not prompts:
        raise ValueError(f"{source} holds no prompt")
    return prompts


def for_api(prompts: list[Prompt], api: str) -> list[Prompt]:
    """Chat wraps a text prompt as one user message; completions cannot take chat messages."""
    if api == "chat":
        return [p if p.messages is not None else Prompt(messages=[{"role": "user", "content": p.text}])
                for p in prompts]
    if any(p.messages is not None for p in prompts):
        raise ValueError("the dataset holds chat \"messages\": use --api chat")
    return prompts


# ---------------------------------------------------------------------------------------------- server
def _http(base_url: str, path: str, api_key: str | None, method: str = "GET") -> tuple[int, bytes]:
    """(HTTP status, body) of GET/POST base_url+path; status 0 when the server could not be reached."""
    req = urllib.request.Request(base_url + path, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {api_key or 'None'}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError, ValueError):
        return 0, b""


def _json_or_empty(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def server_state(base_url: str, api_key: str | None) -> dict:
    """/get_server_info with SGLang's "internal_states"[0] merged in ({} when the server has no such route)."""
    status, body = _http(base_url, "/get_server_info", api_key)
    info = _json_or_empty(body) if status == 200 else {}
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        return {**states[0], **info}
    return info


def flush_cache(base_url: str, api_key: str | None) -> bool:
    """Best effort: POST /flush_cache, retried while the server answers 400 (busy: requests still finishing).
    False when it never worked (e.g. a server without that route)."""
    for _ in range(FLUSH_TRIES):
        status, _ = _http(base_url, "/flush_cache", api_key, method="POST")
        if status == 200:
            return True
        if status != 400:
            return False
        time.sleep(0.05)
    return False


def accept_length_between(before: dict, after: dict) -> float | None:
    """The accept length (tokens per verify step) of the steps between two server states: from the cumulative
    avg_spec_accept_length x spec_verify_ct when both are reported, else the server's cumulative average, else
    None (no speculation reported)."""
    if "avg_spec_accept_length" not in after:
        return None
    a1, c1 = before.get("avg_spec_accept_length"), before.get("spec_verify_ct")
    a2, c2 = after["avg_spec_accept_length"], after.get("spec_verify_ct")
    if None not in (a1, c1, c2) and c2 > c1:
        return (a2 * c2 - a1 * c1) / (c2 - c1)
    return float(a2)


# ---------------------------------------------------------------------------------------------- runs
def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """One run's figures from its request records (NaN-free: None where there is nothing to measure)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    chunks = sum(r.chunks for r in ok)
    row = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else None,
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
    }
    values = {
        "ttft": [r.ttft_ms for r in ok if r.ttft_ms is not None],
        "itl": [x for r in ok for x in r.itl_ms],
        "tpot": [r.tpot_ms for r in ok if r.tpot_ms is not None],
        "e2e": [r.e2e_ms for r in ok if r.e2e_ms is not None],
    }
    for name in METRICS:
        for stat, v in percentiles(values[name]).items():
            row[f"{stat}_{name}_ms"] = None if math.isnan(v) else v
    return row


async def _run(base_url: str, api_key: str | None, api: str, model: str, prompts: list[Prompt], params: dict,
               concurrency: int, arrivals: list[float], progress) -> tuple[list[RequestRecord], float]:
    openai = import_extra("openai")
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "None", max_retries=0,
                                timeout=REQUEST_TIMEOUT_S)
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def one(i: int, prompt: Prompt, at: float) -> RequestRecord:
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            rec = await send_one(client, api, model, prompt, params, i, t0)
        progress.update(1)
        return rec

    try:
        records = await asyncio.gather(*(one(i, p, a) for i, (p, a) in enumerate(zip(prompts, arrivals,
                                                                                       strict=True))))
    finally:
        await client.close()
    return list(records), time.perf_counter() - t0


def run_once(ns: argparse.Namespace, model: str, prompts: list[Prompt], params: dict, concurrency: int,
             rate: float, label: str | None = None) -> tuple[dict, list[RequestRecord]]:
    """One measured run: flush the prefix cache, read the server state, send every prompt, read it again."""
    from tqdm import tqdm

    flush_cache(ns.base_url, ns.api_key)
    before = server_state(ns.base_url, ns.api_key)
    arrivals = arrival_times(len(prompts), rate, ns.seed)
    rate_label = "inf" if math.isinf(rate) else rate
    with tqdm(total=len(prompts), desc=label or f"concurrency {concurrency}, rate {rate_label}", unit="req",
              disable=ns.disable_tqdm, file=sys.stderr) as bar:
        records, duration = asyncio.run(_run(ns.base_url, ns.api_key, ns.api, model, prompts, params,
                                             concurrency, arrivals, bar))
    after = server_state(ns.base_url, ns.api_key)
    row = {"max_concurrency": concurrency, "request_rate": rate_label, "num_prompts": len(prompts),
           **summarize(records, duration), "accept_length": accept_length_between(before, after)}
    return row, records


def warm_up(ns: argparse.Namespace, model: str, prompts: list[Prompt], params: dict) -> None:
    if ns.warmup_requests <= 0:
        return
    warm = [prompts[i % len(prompts)] for i in range(ns.warmup_requests)]
    _, records = run_once(ns, model, warm, params, concurrency=len(warm), rate=math.inf,
                          label="warm-up")
    failed = [r.error for r in records if not r.ok]
    if failed:
        print(f"warning: {len(failed)} warm-up request(s) failed, e.g. {failed[0]}", file=sys.stderr)


def first_model(base_url: str, api_key: str | None) -> str:
    """The first id of the server's /v1/models (RuntimeError when the server does not answer)."""
    status, body = _http(base_url, "/v1/models", api_key)
    data = _json_or_empty(body).get("data") if status == 200 else None
    if not data:
        raise RuntimeError(f"no model list from {base_url}/v1/models: is the server running? (see --base-url)")
    return data[0]["id"]


# ---------------------------------------------------------------------------------------------- report
COLUMNS = [
    ("max_concurrency", "concurrency", None), ("request_rate", "rate (req/s)", None),
    ("completed", "done", None), ("failed", "failed", None), ("duration_s", "time (s)", ".1f"),
    ("request_throughput", "req/s", ".2f"), ("output_throughput", "out tok/s", ".1f"),
    ("total_token_throughput", "total tok/s", ".1f"),
    ("mean_ttft_ms", "TTFT mean (ms)", ".0f"), ("p50_ttft_ms", "TTFT p50", ".0f"), ("p99_ttft_ms", "TTFT p99", ".0f"),
    ("p50_itl_ms", "ITL p50 (ms/chunk)", ".1f"), ("p99_itl_ms", "ITL p99", ".1f"),
    ("mean_tpot_ms", "TPOT mean (ms/tok)", ".1f"), ("p50_tpot_ms", "TPOT p50", ".1f"),
    ("p99_tpot_ms", "TPOT p99", ".1f"), ("p50_e2e_ms", "e2e p50 (ms)", ".0f"),
    ("tokens_per_chunk", "tok/chunk", ".2f"), ("accept_length", "accept len", ".2f"),
]


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """throughput.png (output tok/s) and latency.png (p50 TPOT and ITL) against concurrency, a line per rate."""
    rates = list(dict.fromkeys(r["request_rate"] for r in rows))

    def series(key: str, suffix: str = "") -> dict:
        out = {}
        for rate in rates:
            pts = [(r["max_concurrency"], r[key]) for r in rows if r["request_rate"] == rate and r[key] is not None]
            out[f"rate {rate}{suffix}"] = ([x for x, _ in pts], [y for _, y in pts])
        return out

    logx = len({r["max_concurrency"] for r in rows}) > 2
    return [
        plot_lines(series("output_throughput"), os.path.join(out_dir, "throughput.png"),
                   title="output tokens/s vs concurrency", xlabel="max concurrency", ylabel="output tokens/s",
                   logx=logx),
        plot_lines({**series("p50_tpot_ms", ", p50 TPOT"), **series("p50_itl_ms", ", p50 ITL (per chunk)")},
                   os.path.join(out_dir, "latency.png"), title="p50 latency per token / per chunk",
                   xlabel="max concurrency", ylabel="ms", logx=logx),
    ]


def setup_line(ns: argparse.Namespace, model: str, n: int) -> str:
    return (f"server {ns.base_url} | model {model} | api {ns.api} | dataset {ns.dataset} x {n} | max new tokens "
            f"{ns.max_new_tokens} | temperature {ns.temperature} | ignore_eos {ns.ignore_eos}")


# ---------------------------------------------------------------------------------------------- command
def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers > 0 or inf, got {text!r}") from None
    if not values or any(not v > 0 for v in values):  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers > 0 or inf, got {text!r}")
    return values


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench-serving",
                                description="Load a running OpenAI-compatible server and measure throughput "
                                            "and latency (TTFT, ITL, TPOT, e2e) per concurrency / request rate.")
    p.add_argument("--base-url", default=None, help=f"server root (default: {DEFAULT_BASE_URL})")
    p.add_argument("--host", default=None, help="server host (with --port, instead of --base-url)")
    p.add_argument("--port", type=_at_least(1), default=None, help="server port (default 30000)")
    p.add_argument("--model", default=None, help="model name sent (default: the first id of /v1/models)")
    p.add_argument("--api", "--backend", dest="api", choices=APIS, default="completions",
                   help="OpenAI endpoint: /v1/completions or /v1/chat/completions (default: completions)")
    p.add_argument("--api-key", default=None, help="bearer token of the server")
    p.add_argument("--dataset", default=HELD_OUT,
                   help="'held-out' (code prompts from held-out standard-library modules), 'random' (random "
                        "printable text of --random-input-len chars) or a file: .jsonl with a \"prompt\" or chat "
                        "\"messages\" per record, else one prompt per line (default: held-out)")
    p.add_argument("--num-prompts", type=_at_least(1), default=16)
    p.add_argument("--random-input-len", type=_at_least(1), default=512, help="characters per random prompt")
    p.add_argument("--max-new-tokens", "--output-len", dest="max_new_tokens", type=_at_least(1), default=64,
                   help="max_tokens of every request (default 64)")
    p.add_argument("--temperature", type=_temperature, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens per request")
    p.add_argument("--max-concurrency", type=_positive_ints, default=[1, 4],
                   help="requests in flight at most; a comma list runs once per value (default: 1,4)")
    p.add_argument("--request-rate", type=_rates, default=[math.inf],
                   help="requests/s, Poisson arrivals; inf = all at once under the concurrency cap; a comma "
                        "list runs once per value (default: inf)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random dataset and the arrival times")
    p.add_argument("--warmup-requests", type=_at_least(0), default=1, help="unmeasured requests sent first")
    p.add_argument("--out-dir", default=None, help="default: bench_results/bench-serving-<timestamp>")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    ns = build_parser().parse_args(argv)
    if ns.base_url is None:
        ns.base_url = f"http://{ns.host or '127.0.0.1'}:{ns.port or 30000}" \
            if ns.host or ns.port else DEFAULT_BASE_URL
    ns.base_url = ns.base_url.rstrip("/")
    if ns.base_url.endswith("/v1"):
        ns.base_url = ns.base_url[: -len("/v1")]
    if ns.out_dir is None:
        ns.out_dir = os.path.join("bench_results", "bench-serving-" + time.strftime("%Y%m%d-%H%M%S"))
    return ns


def request_params(ns: argparse.Namespace) -> dict:
    params = {"max_tokens": ns.max_new_tokens, "temperature": ns.temperature}
    if ns.ignore_eos:
        params["extra_body"] = {"ignore_eos": True}  # SGLang's extra; sent only when asked for
    return params


def main(argv: list[str]) -> int:
    try:
        ns = parse_args(argv)
    except SystemExit as e:  # argparse printed the message naming the flag
        return int(e.code or 0)
    if report_missing_extra("specserve bench-serving", "openai", "matplotlib"):
        return 2
    try:
        prompts = for_api(load_dataset(ns.dataset, ns.num_prompts, ns.random_input_len, ns.seed), ns.api)
    except (ValueError, OSError) as e:
        print(f"error: --dataset: {e}", file=sys.stderr)
        return 2
    try:
        model = ns.model or first_model(ns.base_url, ns.api_key)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    params = request_params(ns)
    print(setup_line(ns, model, len(prompts)), file=sys.stderr)
    warm_up(ns, model, prompts, params)
    rows, records = [], []
    for run, (rate, concurrency) in enumerate((r, c) for r in ns.request_rate for c in ns.max_concurrency):
        row, recs = run_once(ns, model, prompts, params, concurrency, rate)
        rows.append({"run": run, **row})
        records += [{"run": run, "max_concurrency": row["max_concurrency"], "request_rate": row["request_rate"],
                     **asdict(r)} for r in recs]
        if row["failed"]:
            first = next(r.error for r in recs if not r.ok)
            print(f"warning: {row['failed']} request(s) failed, e.g. {first}", file=sys.stderr)
    table = format_table(rows, COLUMNS)
    os.makedirs(ns.out_dir, exist_ok=True)
    with open(os.path.join(ns.out_dir, "summary.md"), "w") as f:
        f.write(setup_line(ns, model, len(prompts)) + "\n\n" + table + "\n")
    paths = [write_jsonl(records, os.path.join(ns.out_dir, "requests.jsonl")),
             write_jsonl(rows, os.path.join(ns.out_dir, "summary.jsonl")),
             os.path.join(ns.out_dir, "summary.md"), *plot(rows, ns.out_dir)]
    print(setup_line(ns, model, len(prompts)))
    print(table)
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

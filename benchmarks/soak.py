"""Soak test of the HTTP server: mixed traffic for a long time, then checks that nothing leaked or broke.

Starts ``specserve serve`` (the default model with EAGLE-3 unless flags say otherwise: every flag this script
does not define goes to the server, e.g. ``--model-path``, ``--speculative-algorithm``, ``--max-queued-requests``)
on a free loopback port and drives it with ``--concurrency`` clients for ``--duration`` seconds. Each client loops
over a random mix of:

- the official ``openai`` client: completions and chat, plain and streamed, n = 1 or 2, greedy or sampled with a
  seed, stop strings and logprobs sometimes;
- SGLang's native ``/generate`` (httpx): one prompt, a batch of prompts, streamed;
- clients that go away: a stream closed after a few chunks, a non-streamed request cut by a short client timeout;
- aborts: a streamed ``/generate`` with its own rid, aborted through ``/abort_request`` once its first chunk is in;
- bad requests (malformed JSON, out-of-range parameters, a wrong content type), which must be answered 400.

Then it checks, prints a summary, writes it as JSON (``--out``) and exits 1 if a check failed:

1. no response had status 5xx; a 503 whose code is the documented overload answer (queue_full, shutting_down) is
   counted apart and allowed;
2. the KV cache is back to its baseline once traffic stops (``/get_server_info``): nothing running, queued or
   locked, every request row free, every slot free or held by the prefix cache, every slot free after
   ``/flush_cache``;
3. the model worker's RSS grows by less than ``--max-rss-growth`` from the end of the warm-up to the end (the worker
   is found as the server subprocess's child, through /proc);
4. greedy prompts run before and after the traffic (one at a time, prefix cache flushed) give the same token ids;
5. no request failed otherwise (a connection error, an error status to a valid request, a malformed answer).

    python benchmarks/soak.py --duration 120                       # demo model, EAGLE-3, 8 clients
    python benchmarks/soak.py --speculative-algorithm NGRAM --out bench_out/soak_ngram.json
    python benchmarks/soak.py --model-path /path/to/hf-folder --concurrency 16
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
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import specserve
from specserve.bench.harness import write_json
from specserve.bench.report import report_missing_extra
from specserve.utils import free_port, terminate_process, wait_for_server

PROG = "python benchmarks/soak.py"
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300  # a valid request slower than this under load counts as an error
IDLE_POLL_S = 0.2
RSS_SAMPLE_EVERY_S = 5
KV_TOUCHED = 0.95  # the share of the KV pool the prefix cache must have filled before the RSS baseline
TICK_S = 0.5  # progress bar refresh, and how late after the warm-up the RSS baseline may be taken
OVERLOAD_CODES = ("queue_full", "shutting_down")  # the server's documented 503 answers (RequestManager)

# Python-code prompts: the demo model was trained on Python source
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "# sort a list\n",
           "for i in range(10):", "def read_lines(path):\n", "while True:\n", "from collections import",
           "def merge(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n", "try:\n    import json\nexcept"]
CHAT_PROMPTS = ["Write a function that reverses a string.", "What does a dict comprehension look like?",
                "Explain list slicing.", "Write a class for a queue."]
GREEDY_PROMPTS = ["def fibonacci(n):", "class Node:\n", "import sys\n\n\ndef main(", "# parse the arguments\n"]
STOPS = ["\n\n", "return", "):"]

# Bad requests (path, body, content type): each must be answered 400
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', "application/json"),  # truncated JSON
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', "application/json"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000000}', "application/json"),  # past the context
    ("/v1/chat/completions", b'{"messages": "hello"}', "application/json"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "application/json"),
    ("/generate", b'{"text": "x", "sampling_params": {"top_p": 2.0}}', "application/json"),
    ("/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": "many"}}', "application/json"),
    ("/generate", b'{"text": "x"}', "text/plain"),
    ("/abort_request", b"{}", "application/json"),  # neither rid nor abort_all
]

# Outcomes of one request
OK = "ok"  # answered as asked
CUT = "cut"  # the client went away on purpose (stream closed, client timeout)
ABORTED = "aborted"  # ended by /abort_request
FINISHED = "finished"  # a request meant to be cut or aborted ended first
REJECTED = "400"  # a bad request answered 400, as it must be
OVERLOAD = "503"  # the documented overload answer
SERVER_ERROR = "5xx"  # any other 5xx: a failure
ERROR = "error"  # anything else unexpected: a failure
OUTCOMES = (OK, CUT, ABORTED, FINISHED, REJECTED, OVERLOAD, SERVER_ERROR, ERROR)
FAILURES = (SERVER_ERROR, ERROR)
OVERLOAD_BACKOFF_S = 0.5  # a client told the server is full waits, as a well-behaved one does (no 503 storm)
MAX_ERRORS_KEPT = 20
LONG_TOKENS = 1024


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """-> (this script's arguments, the flags for the server)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False,
                                epilog="Any other flag goes to `specserve serve` (e.g. --model-path, "
                                       "--speculative-algorithm, --max-total-tokens, --num-threads).")
    p.add_argument("--duration", type=float, default=1800, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=8, help="clients with a request in flight at once")
    p.add_argument("--warmup", type=float, default=None, help="seconds of traffic before the RSS baseline is "
                   "taken (default: a quarter of --duration, at most 300); it also waits until the prefix cache has "
                   "filled the KV pool, whose pages become resident only when first written")
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of an ordinary request")
    p.add_argument("--greedy-tokens", type=int, default=32, help="tokens of each greedy before/after prompt")
    p.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed worker RSS growth (fraction)")
    p.add_argument("--drain-timeout", type=float, default=60, help="seconds for the server to go idle after")
    p.add_argument("--api-key", default=None, help="given to the server and sent by the clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/soak.json")
    p.add_argument("--server-log", default=None, help="the server's output (default: --out with .server.log)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, server_flags = p.parse_known_args(argv)
    if {"--host", "--port"} & {f.split("=")[0] for f in server_flags}:
        p.error("--host and --port are chosen by the script (a free loopback port)")
    if args.warmup is None:
        # the worker's RSS grows for a few minutes as it meets new batch shapes (allocator arenas, kernel caches),
        # then levels off: growth after that is what a leak looks like
        args.warmup = min(300.0, args.duration / 4)
    if args.duration <= 0 or args.concurrency < 1 or not 0 <= args.warmup < args.duration:
        p.error("need --duration > 0, --concurrency >= 1 and 0 <= --warmup < --duration")
    if args.server_log is None:
        args.server_log = os.path.splitext(args.out)[0] + ".server.log"
    return args, server_flags


# ---------------------------------------------------------------------------------------------- server
def server_env() -> dict:
    """The server runs the specserve this script imports (a checkout on PYTHONPATH wins over an installed one)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(specserve.__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def start_server(server_flags: list[str], api_key: str | None, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", *server_flags, "--host", "127.0.0.1", "--port", str(port)]
    if api_key:
        cmd += ["--api-key", api_key]
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, timeout=START_TIMEOUT_S, process=proc, api_key=api_key)
    except (RuntimeError, TimeoutError) as e:
        terminate_process(proc)
        raise SystemExit(f"{PROG}: error: {e}; the server's output:\n{log_tail(log_path)}") from None
    return proc, url


def log_tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def log_errors(path: str) -> int:
    """Lines of the server's output that report an error or a traceback."""
    with open(path, errors="replace") as f:
        return sum(" ERROR " in line or line.startswith("Traceback") for line in f)


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is pid, read from /proc (no psutil needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it exited meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the command name in (...) may hold spaces
            out.append(int(entry))
    return out


def worker_pid(server_pid: int) -> int:
    """The model worker: the server subprocess's one child (so the script does not depend on /get_server_info
    showing the worker's pid)."""
    kids = child_pids(server_pid)
    if len(kids) != 1:
        raise RuntimeError(f"expected the server (pid {server_pid}) to have one child, its model worker; "
                           f"found {kids}")
    return kids[0]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ---------------------------------------------------------------------------------------------- requests
class StatusError(Exception):
    """An HTTP answer other than the one expected."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(f"HTTP {status} ({code}): {message[:200]}")
        self.status, self.code = status, code


class Malformed(Exception):
    """A 200 answer whose content is not what was asked for."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise Malformed(what)


def status_outcome(status: int, code: str | None) -> str:
    if status == 503 and code in OVERLOAD_CODES:
        return OVERLOAD
    return SERVER_ERROR if status >= 500 else ERROR


def error_code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@dataclass
class Tally:
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # kind -> outcome -> n
    tokens: int = 0  # completion tokens of the requests answered in full
    errors: list[str] = field(default_factory=list)  # the first unexpected failures, for the report

    def add(self, kind: str, outcome: str, detail: str | None = None) -> None:
        self.counts[kind][outcome] += 1
        if detail is not None and len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(f"{kind}: {detail}")

    def total(self, outcome: str | None = None) -> int:
        return sum(c[outcome] if outcome else sum(c.values()) for c in self.counts.values())


class Traffic:
    """The clients' connections to one server and the request kinds they send."""

    def __init__(self, url: str, api_key: str | None, max_tokens: int) -> None:
        import httpx
        import openai

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S)
        # no retries: a retried 5xx would go unseen
        self.oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "unused", timeout=REQUEST_TIMEOUT_S,
                                      max_retries=0)
        self.max_tokens, self.tally = max_tokens, Tally()
        self.model, self.context_len = None, None  # from /v1/models, on entering
        self.kinds = {  # kind -> (weight in the mix, coroutine function(rng) -> outcome)
            "completion": (3, lambda rng: self.completion(rng, stream=False)),
            "completion_stream": (3, lambda rng: self.completion(rng, stream=True)),
            "chat": (3, lambda rng: self.chat(rng, stream=False)),
            "chat_stream": (3, lambda rng: self.chat(rng, stream=True)),
            "generate": (2, lambda rng: self.generate(rng, batch=False)),
            "generate_batch": (1, lambda rng: self.generate(rng, batch=True)),
            "generate_stream": (2, self.generate_stream),
            "stream_cut": (1, self.stream_cut),
            "timeout_cut": (1, self.timeout_cut),
            "abort": (1, self.abort),
            "bad_request": (1, self.bad_request),
        }

    async def __aenter__(self) -> Traffic:
        card = (await self.oai.models.list()).data[0]
        self.model, self.context_len = card.id, getattr(card, "max_model_len", None) or 2048
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()
        await self.oai.close()

    # -------------------------------------------------------------- plumbing
    async def post(self, path: str, body: dict) -> dict | list:
        r = await self.http.post(path, json=body)
        if r.status_code != 200:
            raise StatusError(r.status_code, error_code(r.content), r.text)
        return r.json()

    async def info(self) -> dict:
        r = await self.http.get("/get_server_info")
        r.raise_for_status()
        return r.json()

    async def flush(self) -> None:
        """Drops the prefix cache (the server refuses while requests are still leaving: retry)."""
        for _ in range(100):
            if (await self.http.post("/flush_cache")).status_code == 200:
                return
            await asyncio.sleep(IDLE_POLL_S)
        raise RuntimeError("the server stayed busy; could not flush its prefix cache")

    async def run(self, kind: str, rng: random.Random) -> str:
        """One request of `kind`; its outcome, tallied (a failure is an outcome, never an exception here)."""
        import httpx
        import openai

        detail = None
        try:
            outcome = await self.kinds[kind][1](rng)
        except StatusError as e:
            outcome, detail = status_outcome(e.status, e.code), str(e)
        except openai.APIStatusError as e:
            outcome, detail = status_outcome(e.status_code, e.code), f"HTTP {e.status_code}: {e.message[:200]}"
        except (httpx.TimeoutException, openai.APITimeoutError) as e:
            outcome, detail = ERROR, f"no answer within {REQUEST_TIMEOUT_S}s: {type(e).__name__}"
        except Exception as e:  # a connection error, a malformed answer: counted, and the soak goes on
            outcome, detail = ERROR, f"{type(e).__name__}: {e}"
        self.tally.add(kind, outcome, detail if outcome in FAILURES else None)
        return outcome

    def new_tokens(self, rng: random.Random) -> int:
        return rng.randint(1, self.max_tokens)

    def long_tokens(self) -> int:
        """max_tokens of a request that is meant to be cut: long enough to be still running when the cut comes
        on a fast model, short enough to fit the context after any prompt of PROMPTS."""
        return min(LONG_TOKENS, self.context_len // 2)

    # -------------------------------------------------------------- OpenAI API
    def openai_sampling(self, rng: random.Random) -> dict:
        """Greedy or seeded sampling, n = 2 sometimes, a stop string sometimes."""
        kw = {"temperature": 0.0} if rng.random() < 0.5 else {"temperature": 0.8, "top_p": 0.95,
                                                              "seed": rng.randrange(2**31)}
        if rng.random() < 0.2:
            kw["n"] = 2
        if rng.random() < 0.25:
            kw["stop"] = rng.choice(STOPS)
        return {"model": self.model, "max_tokens": self.new_tokens(rng), **kw}

    async def completion(self, rng: random.Random, stream: bool) -> str:
        kw = {"prompt": rng.choice(PROMPTS), **self.openai_sampling(rng)}
        if rng.random() < 0.25:
            kw["logprobs"] = 2
        return await self._openai(self.oai.completions.create, kw, stream)

    async def chat(self, rng: random.Random, stream: bool) -> str:
        kw = {"messages": [{"role": "user", "content": rng.choice(CHAT_PROMPTS)}], **self.openai_sampling(rng)}
        if rng.random() < 0.25:
            kw.update(logprobs=True, top_logprobs=2)
        return await self._openai(self.oai.chat.completions.create, kw, stream)

    async def _openai(self, create, kw: dict, stream: bool) -> str:
        n = kw.get("n", 1)
        if not stream:
            r = await create(**kw)
            expect(len(r.choices) == n, f"{len(r.choices)} choices for n={n}")
            expect(all(c.finish_reason in ("stop", "length") for c in r.choices),
                   f"finish reasons {[c.finish_reason for c in r.choices]}")
            self.tally.tokens += r.usage.completion_tokens
            return OK
        finished = {}
        async for chunk in await create(stream=True, stream_options={"include_usage": True}, **kw):
            finished.update({c.index: c.finish_reason for c in chunk.choices if c.finish_reason})
            if chunk.usage is not None:
                self.tally.tokens += chunk.usage.completion_tokens
        expect(sorted(finished) == list(range(n)) and set(finished.values()) <= {"stop", "length"},
               f"streamed finish reasons {finished} for n={n}")
        return OK

    # -------------------------------------------------------------- native API
    def native_body(self, rng: random.Random, text: str | list[str]) -> dict:
        params = {"max_new_tokens": self.new_tokens(rng), "temperature": 0.0}
        if rng.random() < 0.5:
            params.update(temperature=0.8, top_p=0.95, sampling_seed=rng.randrange(2**31))
        if rng.random() < 0.25:
            params["stop"] = rng.choice(STOPS)
        body = {"text": text, "sampling_params": params}
        if rng.random() < 0.2:
            body.update(return_logprob=True, top_logprobs_num=2)
        return body

    async def generate(self, rng: random.Random, batch: bool) -> str:
        text = rng.sample(PROMPTS, rng.randint(2, 4)) if batch else rng.choice(PROMPTS)
        out = await self.post("/generate", self.native_body(rng, text))
        results = out if batch else [out]
        expect(isinstance(results, list) and len(results) == (len(text) if batch else 1),
               f"{len(results)} results for {len(text) if batch else 1} prompts")
        for r in results:
            reason = r["meta_info"]["finish_reason"]
            expect(reason is not None and reason["type"] in ("stop", "length"), f"finish reason {reason}")
            self.tally.tokens += r["meta_info"]["completion_tokens"]
        return OK

    async def generate_stream(self, rng: random.Random) -> str:
        body = {**self.native_body(rng, rng.choice(PROMPTS)), "stream": True}
        last = None
        async for event in self.sse("/generate", body):
            last = event
        expect(last is not None and last["meta_info"]["finish_reason"]["type"] in ("stop", "length"),
               f"the stream ended with {last and last['meta_info']['finish_reason']}")
        self.tally.tokens += last["meta_info"]["completion_tokens"]
        return OK

    async def sse(self, path: str, body: dict):
        """The JSON events of a streamed answer; Malformed if it ends without [DONE]."""
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                content = await r.aread()
                raise StatusError(r.status_code, error_code(content), content.decode(errors="replace"))
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return
                if line.startswith("data: "):
                    yield json.loads(line[len("data: "):])
        raise Malformed("the stream ended without [DONE]")

    # -------------------------------------------------------------- clients that go away, aborts
    async def stream_cut(self, rng: random.Random) -> str:
        """A stream closed by the client after a few chunks (the server must abort it and free its KV)."""
        keep = rng.randint(1, 4)
        if rng.random() < 0.5:
            stream = await self.oai.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": rng.choice(CHAT_PROMPTS)}],
                max_tokens=self.long_tokens(), stream=True)
        else:
            body = {"text": rng.choice(PROMPTS), "sampling_params": {"max_new_tokens": self.long_tokens()},
                    "stream": True}
            stream = self.sse("/generate", body)
        seen = 0
        try:
            async for _ in stream:
                seen += 1
                if seen == keep:
                    return CUT
        finally:
            await (stream.close() if hasattr(stream, "close") else stream.aclose())
        return FINISHED

    async def timeout_cut(self, rng: random.Random) -> str:
        """A non-streamed request given up by the client (its timeout) while the server still works on it."""
        import openai

        client = self.oai.with_options(timeout=rng.uniform(0.2, 2.0))
        try:
            await client.completions.create(model=self.model, prompt=rng.choice(PROMPTS),
                                            max_tokens=self.long_tokens())
        except openai.APITimeoutError:
            return CUT
        return FINISHED

    async def abort(self, rng: random.Random) -> str:
        """A streamed /generate aborted through /abort_request with its rid once it is running."""
        rid = uuid.uuid4().hex
        body = {"text": rng.choice(PROMPTS), "sampling_params": {"max_new_tokens": self.long_tokens()},
                "stream": True, "rid": rid}
        answer, last = None, None
        async for event in self.sse("/generate", body):
            last = event
            if answer is None:
                answer = await self.post("/abort_request", {"rid": rid})
        expect(last is not None, "the stream sent no event")
        reason = last["meta_info"]["finish_reason"]["type"]
        if reason != "abort":
            return FINISHED  # it finished before the abort reached the model loop
        expect(answer["aborted"] == 1, f"ended by an abort, but /abort_request answered {answer}")
        return ABORTED

    async def bad_request(self, rng: random.Random) -> str:
        import openai

        if rng.random() < 0.2:  # through the official client, which raises BadRequestError
            try:
                await self.oai.completions.create(model=self.model, prompt="x", temperature=-1.0)
            except openai.BadRequestError:
                return REJECTED
            raise Malformed("the openai client's temperature=-1 was accepted")
        path, content, ctype = rng.choice(BAD_REQUESTS)
        r = await self.http.post(path, content=content, headers={"Content-Type": ctype})
        if r.status_code == 400:
            return REJECTED
        if r.status_code >= 500:
            raise StatusError(r.status_code, error_code(r.content), r.text)
        raise Malformed(f"{path} {content[:60]!r} answered {r.status_code}, not 400")


# ---------------------------------------------------------------------------------------------- phases
KV_FIELDS = ("free_slots", "radix_cached_tokens", "kv_locked_tokens", "free_req_rows", "kv_usage",
             "num_running_reqs", "num_waiting_reqs", "num_inflight_reqs")
BUSY_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_inflight_reqs", "kv_locked_tokens")


async def kv_state(traffic: Traffic) -> dict:
    info = await traffic.info()
    return {k: info[k] for k in KV_FIELDS}


async def wait_idle(traffic: Traffic, timeout: float) -> bool:
    """Waits for the last requests (the cut and aborted ones included) to leave the model loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = await kv_state(traffic)
        if not any(state[k] for k in BUSY_FIELDS):
            return True
        await asyncio.sleep(IDLE_POLL_S)
    return False


async def greedy_outputs(traffic: Traffic, tokens: int) -> list[list[int]]:
    """The greedy prompts one at a time, each on an empty prefix cache: the same conditions before and after the
    traffic, so any difference comes from state the traffic left behind."""
    outs = []
    for prompt in GREEDY_PROMPTS:
        await traffic.flush()
        r = await traffic.post("/generate", {"text": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}})
        outs.append(r["output_ids"])
    return outs


@dataclass
class Rss:
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the traffic, bytes)
    after_warmup: int | None = None  # the baseline, taken at baseline_s
    baseline_s: float | None = None

    def late_slope(self) -> float | None:
        """MiB per minute over the second half of the samples (least squares): a leak keeps a steady slope, while
        growth that levels off tends to 0."""
        late = [(t, b) for t, b in self.samples if t >= self.samples[-1][0] / 2] if self.samples else []
        if len(late) < 3:
            return None
        fit = statistics.linear_regression([t for t, _ in late], [b for _, b in late])
        return fit.slope * 60 / (1 << 20)


async def kv_touched(traffic: Traffic, capacity: int) -> bool:
    """Whether the prefix cache has held at least KV_TOUCHED of the KV pool: the pool is allocated at start but
    its pages become resident only when first written, so the worker's RSS grows until the cache has filled it."""
    state = await kv_state(traffic)
    return capacity - state["free_slots"] >= KV_TOUCHED * capacity


async def watch(traffic: Traffic, worker: int, args: argparse.Namespace, start: float, rss: Rss,
                kv_capacity: int) -> None:
    """Ticks the progress bar and samples the worker's RSS until cancelled; the RSS baseline is the first sample
    after the warm-up once the KV pool has been filled (kv_touched), so the pool's first writes do not count as
    growth."""
    from tqdm import tqdm

    with tqdm(total=round(args.duration), unit="s", desc="soak", disable=True if args.no_progress else None,
              bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s{postfix}") as bar:
        next_sample = 0.0
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= next_sample:
                if (rss.after_warmup is None and elapsed >= args.warmup and elapsed < args.duration
                        and await kv_touched(traffic, kv_capacity)):
                    rss.after_warmup, rss.baseline_s = rss_bytes(worker), elapsed
                rss.samples.append((elapsed, rss_bytes(worker)))
                next_sample += RSS_SAMPLE_EVERY_S
            bar.update(min(round(elapsed), bar.total) - bar.n)
            bar.set_postfix({"requests": traffic.tally.total(), "failed": failures(traffic.tally)}, refresh=False)
            await asyncio.sleep(TICK_S)


async def client(traffic: Traffic, index: int, seed: int, deadline: float) -> None:
    rng = random.Random(f"{seed}-{index}")
    kinds = list(traffic.kinds)
    weights = [traffic.kinds[k][0] for k in kinds]
    while time.monotonic() < deadline:
        if await traffic.run(rng.choices(kinds, weights)[0], rng) == OVERLOAD:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * OVERLOAD_BACKOFF_S)


async def drive(traffic: Traffic, worker: int, args: argparse.Namespace, kv_capacity: int) -> tuple[Rss, float]:
    """The mixed traffic for --duration seconds (requests in flight at the deadline run to their end);
    -> (worker RSS samples, seconds of traffic)."""
    start = time.monotonic()
    rss = Rss()
    watcher = asyncio.create_task(watch(traffic, worker, args, start, rss, kv_capacity))
    try:
        await asyncio.gather(*[client(traffic, i, args.seed, start + args.duration)
                               for i in range(args.concurrency)])
    finally:
        watcher.cancel()
    if rss.after_warmup is None:  # the KV pool never filled (or the run ended first): the first post-warm-up sample
        rss.baseline_s, rss.after_warmup = next(((t, b) for t, b in rss.samples if t >= args.warmup),
                                                (time.monotonic() - start, rss_bytes(worker)))
    return rss, time.monotonic() - start


def failures(tally: Tally) -> int:
    return sum(tally.total(o) for o in FAILURES)


async def soak(args: argparse.Namespace, url: str, server_pid: int) -> dict:
    worker = worker_pid(server_pid)
    async with Traffic(url, args.api_key, args.max_tokens) as traffic:
        before = await greedy_outputs(traffic, args.greedy_tokens)
        await traffic.flush()
        kv_base = await kv_state(traffic)
        rss, seconds = await drive(traffic, worker, args, kv_base["free_slots"])
        idle = await wait_idle(traffic, args.drain_timeout)
        kv_end = await kv_state(traffic)
        rss_end = rss_bytes(worker)
        await traffic.flush()
        kv_flushed = await kv_state(traffic)
        after = await greedy_outputs(traffic, args.greedy_tokens)
        model = traffic.model
    return {
        "model": model, "duration_s": seconds, "concurrency": args.concurrency, "warmup_s": args.warmup,
        "requests": {kind: dict(c) for kind, c in sorted(traffic.tally.counts.items())},
        "totals": {o: traffic.tally.total(o) for o in OUTCOMES},
        "throughput": {"requests_per_s": traffic.tally.total() / seconds,
                       "completion_tokens": traffic.tally.tokens,
                       "completion_tokens_per_s": traffic.tally.tokens / seconds},
        "errors": traffic.tally.errors,
        "kv": {"baseline": kv_base, "after_traffic": kv_end, "after_flush": kv_flushed, "drained": idle},
        "rss": {"worker_pid": worker, "after_warmup": rss.after_warmup, "baseline_s": rss.baseline_s, "end": rss_end,
                "growth": rss_end / rss.after_warmup - 1, "late_slope_mib_per_min": rss.late_slope(),
                "samples": rss.samples},
        "greedy": {"prompts": len(GREEDY_PROMPTS), "tokens": args.greedy_tokens, "before": before, "after": after},
    }


# ---------------------------------------------------------------------------------------------- checks, report
def kv_problems(kv: dict) -> list[str]:
    base, end, flushed = kv["baseline"], kv["after_traffic"], kv["after_flush"]
    problems = [f"{k} = {end[k]}" for k in BUSY_FIELDS if end[k]]
    held = base["free_slots"] + base["radix_cached_tokens"] - end["free_slots"] - end["radix_cached_tokens"]
    if held:
        problems.append(f"{held} slots neither free nor in the prefix cache")
    if end["free_req_rows"] != base["free_req_rows"]:
        problems.append(f"free request rows {end['free_req_rows']} (baseline {base['free_req_rows']})")
    if flushed["free_slots"] != base["free_slots"]:
        problems.append(f"free slots after a flush {flushed['free_slots']} (baseline {base['free_slots']})")
    return problems


def checks(r: dict, max_rss_growth: float) -> dict:
    """name -> {"passed", "detail"} for the five checks of the module docstring."""
    t, kv, rss, g = r["totals"], r["kv"], r["rss"], r["greedy"]
    kv_bad = kv_problems(kv)
    same = sum(a == b for a, b in zip(g["before"], g["after"], strict=True))
    mib = 1 << 20
    late = rss["late_slope_mib_per_min"]
    slope = "" if late is None else f"; second half {late:+.2f} MiB/min"
    return {
        "no_5xx": {"passed": t[SERVER_ERROR] == 0,
                   "detail": f"{t[SERVER_ERROR]} 5xx; {t[OVERLOAD]} overload 503 (allowed)"},
        "kv_baseline": {"passed": kv["drained"] and not kv_bad,
                        "detail": "; ".join(kv_bad) or (
                            f"free {kv['baseline']['free_slots']} -> {kv['after_traffic']['free_slots']} + "
                            f"{kv['after_traffic']['radix_cached_tokens']} cached -> "
                            f"{kv['after_flush']['free_slots']} after a flush")},
        "rss_growth": {"passed": rss["growth"] < max_rss_growth,
                       "detail": f"{rss['after_warmup'] / mib:.1f} MiB at {rss['baseline_s'] or 0:.0f} s -> "
                                 f"{rss['end'] / mib:.1f} MiB, "
                                 f"{rss['growth']:+.2%} (limit {max_rss_growth:.0%}){slope}"},
        "greedy_identical": {"passed": same == g["prompts"],
                             "detail": f"{same}/{g['prompts']} prompts x {g['tokens']} tokens identical"},
        "no_errors": {"passed": t[ERROR] == 0, "detail": f"{t[ERROR]} unexpected failures"},
    }


def format_report(r: dict) -> str:
    th = r["throughput"]
    lines = [f"soak: model {r['model']} | {r['duration_s']:.0f} s, {r['concurrency']} clients | "
             f"{sum(r['totals'].values())} requests, {th['requests_per_s']:.2f} req/s, "
             f"{th['completion_tokens_per_s']:.1f} completion tok/s",
             f"  {'kind':<18}" + "".join(f"{o:>9}" for o in OUTCOMES)]
    for kind, counts in r["requests"].items():
        lines.append(f"  {kind:<18}" + "".join(f"{counts.get(o, 0):>9}" for o in OUTCOMES))
    lines.append(f"  {'total':<18}" + "".join(f"{r['totals'][o]:>9}" for o in OUTCOMES))
    lines.append(f"server: exit code {r['server']['exit_code']}, {r['server']['log_errors']} error lines in "
                 f"{r['server']['log']}")
    lines += [f"  {e}" for e in r["errors"][:5]]
    for name, c in r["checks"].items():
        lines.append(f"{'PASS' if c['passed'] else 'FAIL'}  {name:<17} {c['detail']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args, server_flags = parse_args(argv)
    if report_missing_extra(PROG, "openai"):
        raise SystemExit(2)
    proc, url = start_server(server_flags, args.api_key, args.server_log)
    try:
        report = asyncio.run(soak(args, url, proc.pid))
    finally:
        exit_code = terminate_process(proc)
    report["server"] = {"flags": server_flags, "exit_code": exit_code, "log": args.server_log,
                        "log_errors": log_errors(args.server_log)}
    report["checks"] = checks(report, args.max_rss_growth)
    report["passed"] = all(c["passed"] for c in report["checks"].values())
    print(format_report(report))
    write_json(report, args.out)
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)

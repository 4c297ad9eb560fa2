"""The request manager of the HTTP process: tokenizes, admits, routes worker outputs to requests, detokenizes.

``RequestManager`` owns the tokenizer (with the chat template), the ``RequestFactory`` shared with the
offline Engine, and the model worker process. Endpoints turn a request into prepared requests (on a
tokenizer thread, off the event loop), ``submit`` them as one ``Job``, then either await the results or
iterate the job's chunks. Outputs arrive from the worker on a reader thread and are routed on the event loop;
detokenization happens when a job's consumer applies them, so the model loop never waits for text. With --dp-size N
there are N worker processes (replicas): each job goes to one of them (``replicas.Balancer``), and their runtime
states are reported merged (``replicas.merge_states``).

Admission: with ``--max-queued-requests`` set, at most max-running + max-queued samples may be in flight;
beyond that ``submit`` raises ``Overloaded`` at once (the endpoint answers 503). The same check runs before a
request is tokenized or built (``check_room``, with the per-request limits of ``request_limits``), so a request
with no room costs nothing. While draining (SIGTERM) or after the worker died every new request is refused the
same way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from specserve.config import ConfigError, ServerArgs
from specserve.engine import grammar_backend, load_tokenizer
from specserve.frontend import (
    PreparedRequest,
    RequestError,
    RequestFactory,
    RequestState,
    merge_outputs,
    prepare_requests,
)
from specserve.models.loader import ModelLoadError, resolve_model_path
from specserve.request import ReqOutput
from specserve.request_limits import RequestLimits
from specserve.server import openai_format as fmt
from specserve.server.metrics import ServerMetrics
from specserve.server.replicas import Balancer, merge_states
from specserve.server.worker import ReqSpec
from specserve.server.worker_client import WorkerProcess
from specserve.tools.formats import detect_parser, tool_call_format

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 1800.0
CALL_TIMEOUT_S = 120.0


class Overloaded(Exception):
    """The request cannot be admitted now (queue full, draining, worker gone): HTTP 503."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def scoped(owner: str | None, rid: str) -> str:
    """A client's rid as the worker knows it: in the client's own namespace (see server/auth.py)."""
    return rid if owner is None else f"{owner}/{rid}"


class Job:
    """The samples of one HTTP request (prompts x n), as submitted together.

    rid is the client's; key (the rid in its owner's namespace) is what the manager and the worker know it by."""

    def __init__(self, rid: str, key: str, prepared: list[PreparedRequest], stream: bool,
                 run: Callable[..., Any]) -> None:
        self.rid, self.key, self.run = rid, key, run  # run(fn, *args): off the event loop (the tokenizer pool)
        self.created = time.monotonic()
        self.states: list[RequestState] = [p.state for p in prepared]
        self.rids = [p.req.rid for p in prepared]
        self.stream = stream
        self._events: asyncio.Queue[tuple[int, ReqOutput]] = asyncio.Queue()
        self._buffered: list[list[ReqOutput]] = [[] for _ in prepared]
        self._unfinished = len(prepared)
        self.done = asyncio.Event()  # every sample's final output has arrived (not necessarily consumed)
        self._done_callbacks: list[Callable[[], Any]] = []
        self.watcher: asyncio.Task | None = None  # the client-disconnect watcher (see streaming.py)

    def push(self, index: int, out: ReqOutput) -> None:
        if self.stream:
            self._events.put_nowait((index, out))
        else:
            self._buffered[index].append(out)
        if out.finished_reason is not None:
            self._unfinished -= 1
            if self._unfinished == 0:
                self.done.set()
                for cb in self._done_callbacks:
                    cb()

    def on_done(self, cb: Callable[[], Any]) -> None:
        if self.done.is_set():
            cb()
        else:
            self._done_callbacks.append(cb)

    async def results(self) -> list[dict]:
        """Non-streaming: waits for every sample, detokenizes each in one call (on the tokenizer pool), returns the
        result dicts."""
        await self.done.wait()
        return await self.run(self._apply_buffered)

    def _apply_buffered(self) -> list[dict]:
        for state, outs in zip(self.states, self._buffered, strict=True):
            state.apply_all(outs)
        return [s.result() for s in self.states]

    async def chunks(self) -> AsyncIterator[list[tuple[int, dict]]]:
        """Streaming: yields lists of (sample index, incremental chunk dict). Outputs that piled up while the
        consumer was busy are merged, so a slow client gets fewer, larger chunks rather than falling behind."""
        while not all(s.finished for s in self.states):
            batch = [await self._events.get()]
            while not self._events.empty():
                batch.append(self._events.get_nowait())
            by_index: dict[int, list[ReqOutput]] = {}
            for index, out in batch:
                by_index.setdefault(index, []).append(out)
            yield await self.run(self._apply_chunks, by_index)

    def _apply_chunks(self, by_index: dict[int, list[ReqOutput]]) -> list[tuple[int, dict]]:
        return [(i, self.states[i].apply(outs[0] if len(outs) == 1 else merge_outputs(outs)))
                for i, outs in sorted(by_index.items())]


class RequestManager:
    def __init__(self, args: ServerArgs) -> None:
        """Starts the model worker and loads the tokenizer meanwhile; blocks until the model is loaded."""
        self.args = args
        self.served_model_name = served_model_name(args)
        self.workers = [WorkerProcess(args, i) for i in range(args.dp_size)]  # loading side by side
        try:
            self.tokenizer = self._load_tokenizer()
            infos = [w.wait_ready(WORKER_START_TIMEOUT_S) for w in self.workers]
        except BaseException:
            for w in self.workers:
                w.kill()
            raise
        # one replica's model info; the requests the server runs at once: all replicas' (a request's limits stay
        # one replica's: it runs on one)
        self.info = {**infos[0], "max_running_requests": sum(i["max_running_requests"] for i in infos)}
        self.balancer = Balancer(len(self.workers), args.load_balance_method)
        self.context_len: int = self.info["context_length"]
        self.factory = RequestFactory(self.tokenizer, self.info["vocab_size"], self.context_len,
                                      set(self.info["eos_token_ids"]), args.random_seed, torch.device("cpu"))
        self.limits = RequestLimits.from_args(args, self.context_len, self.tokenizer)
        self.factory.limits, self.factory.admit = self.limits, self.check_room
        self.factory.grammar = grammar_backend(args, self.tokenizer, self.info["vocab_size"])  # validates grammars
        self.tool_call_parser = args.tool_call_parser or detect_parser(self.tokenizer.chat_template)
        self.tool_format = tool_call_format(self.tool_call_parser) if self.tool_call_parser else None
        queued = args.max_queued_requests
        self.capacity = None if queued is None else self.info["max_running_requests"] + queued
        self.metrics = ServerMetrics() if args.enable_metrics else None
        self.draining = False
        self.drain_started = asyncio.Event()  # set with draining: cuts short the bodies still being read
        self.worker_alive = True
        self.worker_failed = False  # the worker died while the server was not stopping it
        self.on_worker_exit: Callable[[], Any] | None = None
        self._routes: dict[str, tuple[Job, int, int]] = {}  # sample rid -> (job, index, replica)
        self._jobs: dict[str, Job] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=args.tokenizer_worker_num,
                                                  thread_name_prefix="specserve-tokenizer")
        self._health: asyncio.Task | None = None  # the /health_generate probe in flight, shared by its callers
        self.loop: asyncio.AbstractEventLoop | None = None

    def _load_tokenizer(self):
        try:
            model_dir = resolve_model_path(self.args.model_path)
        except ModelLoadError as e:
            raise ConfigError(f"--model-path: {e}") from e
        tokenizer = load_tokenizer(self.args, model_dir)
        if self.args.chat_template:
            tokenizer.chat_template = read_chat_template(self.args.chat_template)
        return tokenizer

    # ------------------------------------------------------------------ lifecycle
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Binds to the server's event loop and starts reading the worker's messages."""
        self.loop = loop
        for w in self.workers:
            w.start_reader(self._from_reader, lambda w=w: self._reader_exited(w))

    def start_draining(self) -> None:
        """Refuse new requests and cut short bodies still arriving; in-flight requests run on."""
        self.draining = True
        self.drain_started.set()

    async def shutdown(self) -> None:
        self.start_draining()
        codes = await asyncio.gather(*(asyncio.to_thread(w.stop) for w in self.workers))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        logger.info("model worker%s stopped (exit code %s)", "s" if len(codes) > 1 else "",
                    ", ".join(str(c) for c in codes))

    @property
    def num_inflight(self) -> int:
        return len(self._routes)

    # ------------------------------------------------------------------ requests
    async def run_in_tokenizer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(*args) (tokenization, chat templates, request building) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def submit(self, rid: str, prepared: list[PreparedRequest], stream: bool, owner: str | None = None) -> Job:
        """Admits the samples of one request as a job; owner: the caller's rid namespace (server/auth.py)."""
        self.check_room(len(prepared))
        key = scoped(owner, rid)
        for p in prepared:
            p.req.rid = scoped(owner, p.req.rid)
        if key in self._jobs or any(p.req.rid in self._routes for p in prepared):
            raise RequestError(f"a request with rid {rid!r} is already running", "rid")
        job = Job(rid, key, prepared, stream, self.run_in_tokenizer)
        self._jobs[key] = job
        replica = self.balancer.pick(len(prepared))  # every sample of the job: they share the prompt's KV there
        for i, p in enumerate(prepared):
            self._routes[p.req.rid] = (job, i, replica)
            p.req.stream = stream  # a non-streaming job reads only finished results (Req.stream)
        self.workers[replica].send(("add", [ReqSpec.from_req(p.req) for p in prepared]))
        return job

    def check_room(self, n: int) -> None:
        """Raises Overloaded unless n more samples may be admitted now. Called before a request is tokenized or
        built (from a tokenizer thread), and again when it is submitted."""
        if self.draining:
            self._reject("the server is shutting down", "shutting_down")
        if not self.worker_alive:
            self._reject("the model worker is not running", "worker_down")
        if self.capacity is not None and len(self._routes) + n > self.capacity:
            self._reject(f"the server is at capacity ({self.capacity} requests running or queued; "
                         "--max-running-requests + --max-queued-requests); retry later", "queue_full")

    def _reject(self, message: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()
        raise Overloaded(message, reason)

    def abort(self, rid: str, owner: str | None = None, any_owner: bool = False) -> int:
        """Aborts a job (by its client rid) or one sample (by its sample rid) of `owner`, or of any owner (the
        admin). -> the number of samples aborted (0: nothing of the caller's is running under that rid)."""
        if any_owner:
            jobs = [j for j in self._jobs.values() if j.rid == rid]
            samples = [r for r, (j, i, _) in self._routes.items() if j.states[i].rid == rid]
        else:
            job = self._jobs.get(scoped(owner, rid))
            jobs = [job] if job is not None else []
            samples = [scoped(owner, rid)] if scoped(owner, rid) in self._routes else []
        rids = {r for j in jobs for r in j.rids if r in self._routes} | set(samples)
        for r in rids:
            self._send_abort(r)
        return len(rids)

    def abort_job(self, job: Job) -> None:
        """Aborts what is still running of a job (its client left)."""
        for r in job.rids:
            if r in self._routes:
                self._send_abort(r)

    def abort_all(self) -> int:
        rids = list(self._routes)
        for r in rids:
            self._send_abort(r)
        return len(rids)

    def _send_abort(self, rid: str) -> None:
        self.workers[self._routes[rid][2]].send(("abort", rid))

    async def call(self, name: str, timeout: float = CALL_TIMEOUT_S) -> list[Any]:
        """Runs a named query on every replica's loop thread ("server_info", "flush_cache") -> their answers."""
        if not self.worker_alive:
            raise RuntimeError("the model worker is not running")
        return list(await asyncio.gather(*(self._call(w, name, timeout) for w in self.workers)))

    async def _call(self, worker: WorkerProcess, name: str, timeout: float) -> Any:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            worker.send(("call", call_id, name))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    def render_chat(self, messages: list[dict], template_kwargs: dict | None, continue_final: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
        """Chat messages -> prompt ids through this server's chat template, within its limits (call it on the
        tokenizer pool). A template brought by the request is code: refused unless --trust-request-chat-template."""
        if template_kwargs and "chat_template" in template_kwargs and not self.args.trust_request_chat_template:
            raise RequestError("this server renders chats with its own template only; a request's "
                               "chat_template_kwargs.chat_template needs --trust-request-chat-template",
                               "chat_template_kwargs")
        return fmt.render_chat(self.tokenizer, messages, template_kwargs, continue_final,
                               timeout=self.args.chat_template_timeout, check_chars=self.limits.check_prompt_chars,
                               tools=tools)

    async def health_generate(self, timeout: float) -> dict:
        """A one-token greedy generation through the whole stack, admitted like any request (503 when there is no
        room). Concurrent callers share the one in flight, so probes cannot pile work onto the model."""
        if self._health is None or self._health.done():
            self._health = asyncio.ensure_future(asyncio.wait_for(self._generate_one(), timeout))
        return await asyncio.shield(self._health)

    async def _generate_one(self) -> dict:
        tok = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else 0
        prepared, _ = await self.run_in_tokenizer(
            prepare_requests, self.factory, None, {"max_new_tokens": 1, "temperature": 0}, [tok])
        job = self.submit(prepared[0].req.rid, prepared, stream=False, owner="health")
        return (await job.results())[0]

    # ------------------------------------------------------------------ worker messages
    def _from_reader(self, msg: tuple) -> None:  # reader thread
        try:
            self.loop.call_soon_threadsafe(self._on_message, msg)
        except RuntimeError:  # the event loop is closed: shutting down
            pass

    def _reader_exited(self, worker: WorkerProcess) -> None:  # reader thread
        try:
            self.loop.call_soon_threadsafe(self._on_worker_exit, worker)
        except RuntimeError:
            pass

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            self._route(msg[1])
        elif kind == "reply":
            _, call_id, ok, value = msg
            fut = self._calls.get(call_id)
            if fut is not None and not fut.done():
                fut.set_result(value) if ok else fut.set_exception(RuntimeError(value))

    def _route(self, outs: list[ReqOutput]) -> None:
        now = time.monotonic()
        for out in outs:
            route = self._routes.get(out.rid)
            if route is None:
                continue
            job, index, replica = route
            if self.metrics is not None:
                self.metrics.on_output(out, job.created, now)
            job.push(index, out)
            if out.finished_reason is not None:
                del self._routes[out.rid]
                self.balancer.finished(replica)
                if job.done.is_set():
                    self._jobs.pop(job.key, None)

    def _on_worker_exit(self, worker: WorkerProcess) -> None:
        """A worker is gone: fail every open request and pending call (with --dp-size, the other replicas' too: the
        server stops, as with one worker)."""
        if not self.worker_alive:
            return  # another replica's exit already did it
        self.worker_alive = False
        if not self.draining:
            self.worker_failed = True  # the server exits with code 1
            replica = f" (replica {worker.replica} of {len(self.workers)})" if len(self.workers) > 1 else ""
            logger.error("the model worker%s exited unexpectedly (exit code %s)", replica, worker.proc.poll())
        reason = {"type": "abort", "message": "the model worker exited"}
        for rid, (job, *_) in list(self._routes.items()):
            state = job.states[job.rids.index(rid)]
            self._route([ReqOutput(rid, [], reason, state.prompt_tokens, len(state.output_ids), 0)])
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(RuntimeError("the model worker exited"))
        if self.on_worker_exit is not None and not self.draining:
            self.on_worker_exit()

    # ------------------------------------------------------------------ info
    async def server_info(self) -> tuple[dict, list[dict] | None]:
        """-> (the runtime state: the replicas' merged, ``merge_states``; each replica's with its dp_rank, or None
        with one replica)."""
        states = await self.call("server_info")
        merged = {**merge_states(states), "num_inflight_reqs": self.num_inflight, "draining": self.draining}
        return merged, [{**s, "dp_rank": i} for i, s in enumerate(states)] if len(states) > 1 else None


def served_model_name(args: ServerArgs) -> str:
    """--served-model-name, else the model path as given (SGLang's rule), except that with an admin key a local
    folder is served under its own name: its path on this machine is the admin's to see."""
    if args.served_model_name:
        return args.served_model_name
    if args.admin_api_key and os.path.exists(args.model_path):
        return os.path.basename(os.path.normpath(args.model_path))
    return args.model_path


def read_chat_template(value: str) -> str:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template: {value!r} is neither a file nor a Jinja template")

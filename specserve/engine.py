"""Engine: the offline API, mirroring ``sglang.Engine``.

    engine = specserve.Engine(model_path="path/to/model", max_total_tokens=4096)
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 16})
    for chunk in engine.generate("Hello", {"max_new_tokens": 16}, stream=True): print(chunk["text"], end="")
    engine.shutdown()

The scheduler runs in a background thread (``SchedulerLoop``); callers block on per-request queues (or
await asyncio queues). Detokenization happens on the caller's side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from transformers import AutoTokenizer

from specserve.config import ConfigError, ServerArgs
from specserve.frontend import (
    PreparedRequest,
    RequestError,
    RequestFactory,
    RequestState,
    check_off_args,
    prepare_requests,
)
from specserve.grammar import GrammarBackend, make_grammar_backend
from specserve.grammar.compiles import GrammarCompiles
from specserve.parallel.ranks import RankFailure
from specserve.platform import platform_policy
from specserve.request import Req, ReqOutput, unstarted_output
from specserve.scheduler.model_runner import ModelRunner, resolve_device
from specserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def load_tokenizer(args: ServerArgs, model_dir: str):
    path = args.tokenizer_path or model_dir
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"--tokenizer-path: cannot load a tokenizer from {path!r}: {e}") from e


def grammar_backend(args: ServerArgs, tokenizer, vocab_size: int) -> GrammarBackend | None:
    """The structured-output grammar engine of --grammar-backend for this tokenizer (None: off)."""
    return make_grammar_backend(args.grammar_backend, tokenizer, vocab_size,
                                any_whitespace=not args.constrained_json_disable_any_whitespace)


def build_scheduler(args: ServerArgs) -> Scheduler:
    """The Scheduler of a serving process (the Engine's, the server's worker): the platform policy first, so the
    allocator is set up before the model's tensors and the scheduler thread exist (platform/cpu/malloc.py)."""
    platform = platform_policy(args, resolve_device(args.device))
    platform.tune_allocator()
    return Scheduler(args, ModelRunner(args, platform))


class SchedulerLoop:
    """Drives a Scheduler in a thread: takes requests/aborts from an inbox, delivers outputs to states."""

    def __init__(self, scheduler: Scheduler, grammar: GrammarBackend | None = None) -> None:
        self.scheduler = scheduler
        self.inbox: queue.Queue = queue.Queue()
        # compiles requests' grammars on its own threads, then puts them into the inbox (the queue's own method:
        # no reference back to this loop, so a dropped engine is freed without a garbage collection)
        self.compiles = GrammarCompiles(grammar, self.inbox.put) if grammar is not None else None
        if grammar is not None:
            scheduler.grammar_stats = grammar.stats  # the server info reports compiles and mask time
        self.failed: str | None = None  # why the loop ended for good (``fatal``)
        self.states: dict[str, RequestState] = {}
        self.deliver: dict[str, Any] = {}  # rid -> callable(ReqOutput)
        self._stop = threading.Event()
        self.platform = scheduler.runner.platform
        args = scheduler.args
        if scheduler.runner.background_compiler is not None:
            logger.info("torch.compile: each forward runs eager until its graph is built in the background")
        elif args.enable_torch_compile and not args.skip_server_warmup:  # build the graphs before the first request
            logger.info("warm-up requests done in %.1fs", scheduler.warm_up())
        # this thread loaded the model; its idle OpenMP workers would slow the loop's (platform/cpu/omp.py)
        self.platform.release_thread_pool()
        self.thread = threading.Thread(target=self._run, name="specserve-scheduler", daemon=True)
        self.thread.start()

    def submit(self, prepared: list[PreparedRequest], deliver) -> None:
        if self.failed is not None:
            raise RuntimeError(f"the engine stopped: {self.failed}")
        self.platform.release_thread_pool()  # the caller may have run torch since
        for p in prepared:
            self.deliver[p.req.rid] = deliver(p.state)
        self.inbox.put(("add", [p.req for p in prepared]))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def call(self, fn) -> Any:
        """Run fn(scheduler) on the loop thread and return its result (for stats, flush, checks)."""
        self.platform.release_thread_pool()  # as in submit
        box: queue.Queue = queue.Queue()
        self.inbox.put(("call", (fn, box)))
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        if self.compiles is not None:
            self.compiles.close()
        self._stop.set()
        self.inbox.put(("noop", None))
        self.thread.join(timeout=30)
        self.scheduler.runner.close()

    def _run(self) -> None:
        # every tensor the scheduler makes is an inference tensor, so compiled forwards see one kind of input
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.scheduler.has_work()
            if idle:  # a caller's own torch work while we wait should not meet our idle OpenMP pool
                self.platform.release_thread_pool()
            self.platform.upkeep(idle)
            self._drain(block=idle)
            if self._stop.is_set():
                break
            try:
                outputs = self._timed_step()
            except RankFailure as e:  # a tensor-parallel rank is gone: nothing can run any more
                logger.error("%s; the engine stops", e)
                self._dispatch(self._abort_all(str(e)))
                self.fatal(str(e))
                return
            except Exception as e:  # noqa: BLE001 - never leave callers hanging
                logger.exception("scheduler step failed; aborting running requests")
                outputs = self._abort_all(f"internal error: {type(e).__name__}: {e}")
            self._dispatch(outputs)

    def fatal(self, message: str) -> None:
        """The engine cannot go on (``RankFailure``): the loop ends; later requests are refused."""
        self.failed = message
        self._stop.set()

    def _timed_step(self) -> list[ReqOutput]:
        """One scheduler step at the platform's thread count; a decode step's wall time goes back to the platform,
        whose count follows contention (platform/cpu/governor.py). Prefill and mixed steps are not timed: their
        cost depends on token counts this loop does not see."""
        sched, stats = self.scheduler, self.scheduler.stats
        self.platform.apply_threads()
        prefills, decodes, batch = stats.num_prefill_steps, stats.num_decode_steps, len(sched.running)
        compiling = self._compile_busy()
        start = time.perf_counter()
        outputs = sched.step()
        if (stats.num_prefill_steps == prefills and stats.num_decode_steps == decodes + 1
                and not (compiling or self._compile_busy())):
            self.platform.time_step(batch, time.perf_counter() - start)
        return outputs

    def _compile_busy(self) -> bool:
        """A background compile holds a core (and the forwards run a thread short of the platform's count): such a
        step says nothing about the count the platform chose."""
        compiler = self.scheduler.runner.background_compiler
        return compiler is not None and compiler.busy()

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        kind, payload = item
        if kind == "add":
            for req in payload:
                self._add(req)
        elif kind == "compiled":
            req, error = self.compiles.finish(*payload)
            if req is not None:
                self.scheduler.add_request(req)
            elif error is not None:
                self._dispatch([error])
        elif kind == "abort":
            out = self.compiles.abort(payload) if self.compiles is not None else None
            self._dispatch([o for o in [out or self.scheduler.abort(payload)] if o is not None])
        elif kind == "call":
            fn, box = payload
            try:
                box.put((True, fn(self.scheduler)))
            except Exception as e:  # noqa: BLE001
                box.put((False, e))

    def _add(self, req: Req) -> None:
        """A new request joins the scheduler, or first waits for its grammar to compile off this thread."""
        if req.params.grammar is None or req.grammar is not None:
            self.scheduler.add_request(req)
        elif self.compiles is None:
            reason = {"type": "abort", "message": "structured outputs are off on this server (--grammar-backend none)"}
            self._dispatch([unstarted_output(req, reason)])
        elif (ready := self.compiles.start(req)) is not None:
            self.scheduler.add_request(ready)

    def _abort_all(self, message: str) -> list[ReqOutput]:
        sched = self.scheduler
        reqs = [r for r, _, _ in sched.prefilling] + [*sched.waiting, *sched.running]
        if sched.chunked is not None:
            reqs.append(sched.chunked)
        rids = list(dict.fromkeys(r.rid for r in reqs))  # a failed prefill's request may also be chunked/running
        outs = []
        for rid in rids:
            try:
                out = self.scheduler.abort(rid)
            except Exception:  # noqa: BLE001
                out = None
            if out is not None:
                out.finished_reason = {"type": "abort", "message": message}
                outs.append(out)
        return outs

    def _dispatch(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            fn = self.deliver.get(out.rid)
            if fn is None:
                continue
            if out.finished_reason is not None:
                del self.deliver[out.rid]
            fn(out)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        args = ServerArgs.from_kwargs(model_path=model_path, **kwargs).validate()
        if args.model_path is None:
            raise ConfigError("--model-path is required")
        if args.dp_size > 1:
            raise ConfigError("--dp-size > 1 starts replicas in the server (specserve serve); the offline Engine is "
                              "one replica: make one Engine per replica instead")
        logging.getLogger("specserve").setLevel(args.log_level.upper())
        self.server_args = args
        self.scheduler = build_scheduler(args)
        runner = self.scheduler.runner
        self.tokenizer = load_tokenizer(args, runner.model_dir)
        eos = set(runner.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.factory = RequestFactory(
            self.tokenizer, runner.spec.vocab_size, runner.context_len, eos, args.random_seed, runner.device
        )
        self.factory.grammar = grammar_backend(args, self.tokenizer, runner.spec.vocab_size)
        self.loop = SchedulerLoop(self.scheduler, self.factory.grammar)
        self._closed = False

    # ------------------------------------------------------------------ request preparation
    def _prepare(self, prompt, sampling_params, input_ids, rid, logprob_fields: dict, sglang_args: dict):
        check_off_args(sglang_args)  # SGLang's lora_path, image_data, ...: their off values only
        return prepare_requests(self.factory, prompt, sampling_params, input_ids, rid, **logprob_fields)

    # ------------------------------------------------------------------ sync API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] | None = None,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_text_in_logprobs: bool | None = None,
        temp_scaled_logprobs: bool | None = None,
        **sglang_args: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (-> dict) or a batch / n > 1 (-> list of dicts); stream -> chunk iterator.
        The logprob arguments are SGLang's (``Engine.generate``): one value, or a list of one per prompt."""
        self._check_open()
        prepared, single = self._prepare(prompt, sampling_params, input_ids, rid, dict(
            return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, return_text_in_logprobs=return_text_in_logprobs,
            temp_scaled_logprobs=temp_scaled_logprobs), sglang_args)
        if stream:
            if not single:
                raise RequestError("stream=True takes a single prompt with n=1", "stream")
            return self._stream(prepared[0])
        _not_streamed(prepared)
        self.loop.submit(prepared, _collect_deliver)
        results = [self._wait(p.state) for p in prepared]
        return results[0] if single else results

    @staticmethod
    def _wait(state: RequestState) -> dict:
        state.queue.done.wait()
        state.apply_all(state.queue.items)
        return state.result()

    def _stream(self, p: PreparedRequest) -> Iterator[dict]:
        self.loop.submit([p], _thread_deliver)
        try:
            while not p.state.finished:
                yield p.state.apply(p.state.queue.get())
        finally:
            if not p.state.finished:  # the consumer stopped early: free the request's KV
                self.loop.abort(p.req.rid)

    # ------------------------------------------------------------------ async API
    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] | None = None,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_text_in_logprobs: bool | None = None,
        temp_scaled_logprobs: bool | None = None,
        **sglang_args: Any,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        self._check_open()
        prepared, single = self._prepare(prompt, sampling_params, input_ids, rid, dict(
            return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, return_text_in_logprobs=return_text_in_logprobs,
            temp_scaled_logprobs=temp_scaled_logprobs), sglang_args)
        loop = asyncio.get_running_loop()
        for p in prepared:
            p.state.queue = asyncio.Queue()
        deliver = _async_deliver(loop)
        if stream:
            if not single:
                raise RequestError("stream=True takes a single prompt with n=1", "stream")
            return self._astream(prepared[0], deliver)
        _not_streamed(prepared)
        self.loop.submit(prepared, deliver)
        results = []
        for p in prepared:
            while not p.state.finished:
                p.state.apply(await p.state.queue.get())
            results.append(p.state.result())
        return results[0] if single else results

    async def _astream(self, p: PreparedRequest, deliver) -> AsyncIterator[dict]:
        self.loop.submit([p], deliver)
        try:
            while not p.state.finished:
                yield p.state.apply(await p.state.queue.get())
        finally:
            if not p.state.finished:
                self.loop.abort(p.req.rid)

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str) -> None:
        self.loop.abort(rid)

    def flush_cache(self) -> bool:
        return self.loop.call(lambda s: s.flush_cache())

    def get_server_info(self) -> dict:
        """SGLang's shape: the server arguments, the runtime state over them, the state again as
        ``internal_states[0]`` (one data-parallel rank), and the version."""
        return server_info(self.server_args, self.loop.call(_server_info))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.loop.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _not_streamed(prepared: list[PreparedRequest]) -> None:
    """The caller reads only the finished results: the scheduler sends each request's tokens at its finish."""
    for p in prepared:
        p.req.stream = False


class _Collector:
    """Non-streaming delivery: outputs are appended on the loop thread; the caller wakes once, at finish."""

    def __init__(self) -> None:
        self.items: list[ReqOutput] = []
        self.done = threading.Event()

    def put(self, out: ReqOutput) -> None:
        self.items.append(out)
        if out.finished_reason is not None:
            self.done.set()


def _collect_deliver(state: RequestState):
    state.queue = _Collector()
    return state.queue.put


def _thread_deliver(state: RequestState):
    return state.queue.put


def _async_deliver(loop: asyncio.AbstractEventLoop):
    def bind(state: RequestState):
        return lambda out: loop.call_soon_threadsafe(state.queue.put_nowait, out)

    return bind


SECRET_FIELDS = ("api_key", "admin_api_key")
# where things live on the server's machine, and its process ids: the admin's to see (server/auth.py)
PRIVATE_FIELDS = ("model_path", "tokenizer_path", "speculative_draft_model_path", "speculative_token_map",
                  "chat_template", "worker_pid")
HIDDEN = "(hidden: admin key only)"


def server_info(args: ServerArgs, state: dict, private: bool = True, replicas: list[dict] | None = None) -> dict:
    """/server_info and Engine.get_server_info(): arguments (secrets hidden), then the runtime state, again under
    SGLang's "internal_states": `state` itself, or with --dp-size > 1 each replica's (`replicas`).
    private=False hides paths and pids too (a server's non-admin callers)."""
    from specserve.version import __version__

    shown = {**dataclasses.asdict(args), **state}
    for name in SECRET_FIELDS:
        if shown.get(name) is not None:
            shown[name] = "***"
    if not private:
        for name in PRIVATE_FIELDS:
            if shown.get(name) is not None:
                shown[name] = HIDDEN
        state = {k: shown[k] for k in state}
        replicas = replicas and [{k: HIDDEN if k in PRIVATE_FIELDS else v for k, v in r.items()} for r in replicas]
    return {**shown, "internal_states": replicas or [state], "version": __version__}


def _server_info(s: Scheduler) -> dict:
    return {"status": "ready", **s.server_info()}

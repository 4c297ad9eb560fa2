"""``--enable-torch-compile``: compiled decode, verify and draft forwards (CPU and CUDA).

``torch.compile`` (inductor) fuses the many small element-wise ops of a decoder layer (norms, RoPE, SiLU-gating,
residual adds) into generated kernels; on small-batch decode, where a forward is mostly per-op overhead, that is
where the time goes. Prefill (EXTEND) stays eager: its shapes vary the most and it is compute-bound anyway.

A wrapped module keeps its eager forward and gains a compiled twin; each call picks one from the ForwardBatch
(its first argument): compiled for the modes in ``modes`` when the batch has at most ``--torch-compile-max-bs``
requests, eager otherwise (SGLang's rule for ``--torch-compile-max-bs``). The dimensions that vary from call to
call (token rows, requests, queries and keys per request) are marked dynamic before the first call
(``mark_varying_dims``), so each attention variant (decode with or without a mask, tree verify, draft steps) gets one
graph for all batch sizes above 1 and one for batch 1, which dynamo always specializes. Left to dynamo
(``dynamic=None`` alone), every variant compiled first for its first shapes and again, dynamic, on the first change:
SmolLM2-135M's plain decoding built 7 graphs at start-up instead of 3. Compile time is measured per call: a call
during which dynamo built a new graph counts as compile time (``CompileStats``), reported in the server info.

A one-token CPU forward (batch-1 decode, a draft's first step) runs its compiled graph with oneDNN off
(``models.one_row``): its linears then call PyTorch's matrix-vector kernel on the kept plain weights from
inside the graph, the fastest one-row path on CPU (SmolLM2-135M bf16 decode: 12.4 ms a token against 17-18 ms
eager).

Before each compiled call dynamo checks its guards (the inputs and every module attribute the graph read still
match). Recursive dict-tag guards (``use_recursive_dict_tags_for_guards``) skip a module tree whose attribute dicts
nobody has written to since the last call: on SmolLM2's decode the check fell from 0.81 to 0.38 ms a step. Each
wrapped module compiles a copy of its forward's code (``_with_own_code``), so its graphs and guards are its own:
a second instance of the class never shares them (where it did, dict-tag guard evaluation crashed on an attribute
holding a tensor in one instance and None in the other: a linear's plain weight, kept or dropped).

``--torch-compile-in-background`` keeps torch.compile off the scheduler's path (``BackgroundCompiler``): the first
call of each kind (``variant_key``) runs eager and hands a copy of its inputs to a compile thread, which builds the
graph from them; calls of a kind whose graph is built run it through dynamo's run-only mode (``torch._dynamo.run``:
cached graphs whose guards pass, eager otherwise, never a compile on the scheduler's thread). The copy writes its
K/V to the pool's padding slot 0, so the compile thread never touches a request's cache. A server is ready at once
and decodes eager until its graphs are built, with the compile sharing the CPU meanwhile. Kinds are keyed by the
OpenMP thread count as well (dynamo guards a graph on it): each count the platform may run at (the CPU governor's
levels) gets its own graphs, so compiled decoding follows contention as eager decoding does.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import types
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from specserve.attention import ForwardBatch, ForwardMode
from specserve.models.compile_warm import CacheWarmer
from specserve.models.one_row import one_row_forward, onednn_off

logger = logging.getLogger(__name__)

COMPILED_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE,
                            ForwardMode.DRAFT_EXTEND})
RECOMPILE_LIMIT = 64  # graphs per compiled function (dynamo's default of 8 is too few for decode + verify + draft)
# the background compiler's builds per kind of call (a kind may need several graphs: values its guards pin), and its
# tries of a kind whose build raised (a forward running beside a build can upset its guards)
BUILDS_PER_KIND, FAILED_TRIES = 8, 2


class _ThreadFlag(threading.local):
    done = False


_configured = _ThreadFlag()


@dataclass
class CompileStats:
    graphs: int = 0  # graphs dynamo built for the wrapped forwards
    seconds: float = 0.0  # wall time of the calls that built them (tracing + inductor + the run itself)
    compiled_calls: int = 0
    per_module: Counter = field(default_factory=Counter)  # graphs by the wrapped module's class name
    background: bool = False  # --torch-compile-in-background: graphs built on a compile thread
    eager_calls: int = 0  # background: calls run eager (no graph of their kind yet, or none whose guards took them)
    kinds_built: int = 0  # background: kinds of call whose graph the compile thread built
    kinds_pending: int = 0  # background: kinds handed to the compile thread and not built yet
    kinds_failed: int = 0  # background: kinds whose compile raised (they stay eager; the error is logged)


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class _Ran(threading.local):
    graph = False  # a graph built by ``_flagged_inductor`` ran on this thread since the flag was cleared


_ran = _Ran()


def _flagged_inductor(gm: torch.fx.GraphModule, example_inputs):
    """torch.compile's inductor backend, its compiled graph flagging each run on the running thread (``_ran``): how
    a run-only call (``torch._dynamo.run``) that met a built graph is told from one dynamo ran eager."""
    from torch._inductor.compile_fx import compile_fx

    run = compile_fx(gm, example_inputs)

    def flagged(*args):
        _ran.graph = True
        return run(*args)

    flagged._boxed_call = getattr(run, "_boxed_call", False)  # dynamo calls it as it would call `run`
    return flagged


class CompiledForward:
    """Callable replacing ``module.forward``: fn(fb, *args) compiled or eager, chosen per call. With a
    ``BackgroundCompiler`` the graphs are built on its thread and this one only runs graphs already built."""

    def __init__(self, eager, max_bs: int, stats: CompileStats, modes=COMPILED_MODES,
                 background: BackgroundCompiler | None = None) -> None:
        self.eager, self.max_bs, self.stats, self.modes = eager, max_bs, stats, modes
        twin = _with_own_code(eager)
        self.compiled = torch.compile(twin, dynamic=None,
                                      backend="inductor" if background is None else _flagged_inductor)
        self.background = background
        # dynamo's run-only mode on the same code object: the graphs compiled above whose guards pass, else eager
        self.run_only = torch._dynamo.run(twin) if background is not None else None

    def use_compiled(self, fb: ForwardBatch) -> bool:
        # eager: request-by-request attention (a split prefill catch-up), which loops over a varying number of
        # groups, and an extend most of whose rows only write their K/V (``ForwardBatch.out_rows``)
        return (fb.mode in self.modes and fb.attn.batch_size <= self.max_bs and fb.attn.groups is None
                and fb.out_rows is None)

    def __call__(self, fb: ForwardBatch, *args, **kwargs):
        if not self.use_compiled(fb):
            if self.background is not None:
                self.background.fit_threads()  # eager forwards too, prefill above all
            return self.eager(fb, *args, **kwargs)
        _configure_dynamo()  # dynamo's config is per thread: set it on the thread that runs the forwards
        mark_varying_dims(fb, args)
        if self.background is not None:
            return self._call_built(fb, args, kwargs)
        self.stats.compiled_calls += 1
        before, start = _graph_count(), time.perf_counter()
        out = self._run(self.compiled, fb, args, kwargs)
        self.count_built(_graph_count() - before, time.perf_counter() - start, fb)
        return out

    def _call_built(self, fb: ForwardBatch, args: tuple, kwargs: dict):
        """Background compiling: a built graph that takes this call, else eager, handing the compile thread a copy
        of the inputs when its kind has no graph for them (``BackgroundCompiler.claim``). A kind is keyed by the
        thread count too: dynamo guards a graph on the count it was built at."""
        threads = self.background.fit_threads()
        key = (self.background.build_count(threads),) + variant_key(fb, args)
        if not self.background.built(key):
            self.stats.eager_calls += 1
            copy = self.background.claim(key, fb, args, kwargs)
            out = self.eager(fb, *args, **kwargs)
            if copy is not None:  # handed over after the eager call: state it builds lazily (RoPE tables) exists
                self.background.submit(key, self, copy)
            return out
        if key[0] != threads:  # a graph for another count: its guards would refuse this call
            self.stats.eager_calls += 1
            return self.eager(fb, *args, **kwargs)
        _ran.graph = False
        out = self._run(self.run_only, fb, args, kwargs)
        if _ran.graph:
            self.stats.compiled_calls += 1
            return out
        # no built graph of this kind took these inputs (a shape or value its guards pinned): dynamo ran it eager;
        # the compile thread builds one more graph from them
        self.stats.eager_calls += 1
        copy = self.background.claim(key, fb, args, kwargs)
        if copy is not None:
            self.background.submit(key, self, copy)
        return out

    @staticmethod
    def _run(fn, fb: ForwardBatch, args: tuple, kwargs: dict):
        with onednn_off() if one_row_forward(fb.input_ids) else nullcontext():
            return fn(fb, *args, **kwargs)

    def count_built(self, built: int, elapsed: float, fb: ForwardBatch) -> None:
        """Count `built` new graphs, made by a call of `elapsed` seconds."""
        if not built:
            return
        module = type(getattr(self.eager, "__self__", self.eager)).__name__
        self.stats.graphs += built
        self.stats.per_module[module] += built
        self.stats.seconds += elapsed
        logger.info("torch.compile: %d new graph(s) for %s (%s, batch %d) in %.1fs", built, module,
                    fb.mode.value, fb.attn.batch_size, elapsed)


def variant_key(fb: ForwardBatch, args: tuple) -> tuple:
    """What tells two calls' graphs apart (dynamo's guards, as ``mark_varying_dims`` leaves them): the mode, batch 1
    or more (dynamo specializes a size of 1), a one-token forward (run with oneDNN off), which optional inputs are
    present, the attention's flags and the extra arguments' ranks and dtypes. Calls with one key mostly meet one
    graph; a call its graphs' guards refuse asks for one more (``BUILDS_PER_KIND``)."""
    attn = fb.attn
    optional = tuple(getattr(attn, name, None) is None for name in ATTN_VARYING_DIMS)
    flags = tuple(getattr(attn, name, None) for name in ("is_causal", "one_query"))
    extra = tuple((t.dim(), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in args)
    return (fb.mode, attn.batch_size == 1, fb.input_ids.numel() == 1, type(attn).__name__, optional, flags,
            fb.logits_indices is None, fb.input_embeds is None, tuple(fb.capture_layers), extra)


def detached_inputs(fb: ForwardBatch, args: tuple, kwargs: dict) -> tuple[ForwardBatch, tuple, dict]:
    """A copy of a forward's inputs that the compile thread can run at any later time: its tensors copied (strides
    kept), and the slots it writes K/V to all the pool's padding slot 0, so running it never changes a request's
    cache (what it reads from the pool only feeds outputs nobody uses)."""
    def copy(t):
        return _strided_copy(t) if isinstance(t, torch.Tensor) else t

    attn = fb.attn
    if dataclasses.is_dataclass(attn):
        attn = dataclasses.replace(attn, **{f.name: copy(getattr(attn, f.name)) for f in dataclasses.fields(attn)
                                            if f.init and isinstance(getattr(attn, f.name), torch.Tensor)})
    fb = dataclasses.replace(fb, input_ids=copy(fb.input_ids), positions=copy(fb.positions),
                             out_cache_loc=copy(fb.out_cache_loc).zero_(), attn=attn,
                             logits_indices=copy(fb.logits_indices), input_embeds=copy(fb.input_embeds),
                             rope_rows={})
    return fb, tuple(copy(t) for t in args), {k: copy(v) for k, v in kwargs.items()}


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of t with its sizes and strides: dynamo's guards check strides (a request's KV slots are a view into
    the slot table, whose rows are longer), so a contiguous clone would build a graph its calls miss. A tensor whose
    elements share memory (expanded: a stride of 0) is copied as a view of a copy of its whole storage."""
    if all(st != 0 or n <= 1 for n, st in zip(t.size(), t.stride(), strict=True)):
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    storage = t.untyped_storage().clone()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


class BackgroundCompiler:
    """Builds graphs on a thread of its own from the inputs ``CompiledForward`` hands it, one kind of call at a
    time, so the scheduler's thread never waits for torch.compile. The thread ends when nothing is left to build
    (its OpenMP workers go with it) and starts again on the next kind.

    Graphs are built per OpenMP thread count (dynamo guards a graph on the count it was built at): for each count in
    ``counts`` (the platform's ``thread_counts``: the governor's levels, so compiled decoding follows contention as
    eager decoding does), as calls at that count meet a kind without one. ``target`` gives the count the next
    forward should run with (the platform's ``thread_target``)."""

    def __init__(self, stats: CompileStats, target: Callable[[], int], counts: tuple[int, ...]) -> None:
        self.stats = stats
        self.target = target
        self.counts = frozenset(counts)
        # build for the platform's count even while the forwards run one thread short (the cache-filling child, which
        # warms one count at a time); else for the count a call runs at
        self.build_at_target = False
        stats.background = True
        self.warmer: CacheWarmer | None = None  # the child filling the cache: builds wait until it has exited
        self._built: set = set()
        self._pending: set = set()  # kinds claimed and not built or failed yet
        self._attempts: Counter = Counter()  # kind -> builds tried
        self._failures: Counter = Counter()  # kind -> builds that raised
        self._todo: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def built(self, key: tuple) -> bool:
        return key in self._built

    def kinds_by_threads(self) -> dict[int, int]:
        """Thread count -> kinds of call with a graph built at that count."""
        with self._lock:
            return dict(sorted(Counter(key[0] for key in self._built).items(), reverse=True))

    def claim(self, key: tuple, fb: ForwardBatch, args: tuple, kwargs: dict) -> tuple | None:
        """A call of kind `key` (its thread count first) that found no graph for it, at one of ``counts``, while none
        is being built for that kind and it has had fewer than BUILDS_PER_KIND builds and FAILED_TRIES failures: a
        copy of its inputs to ``submit``; else None."""
        with self._lock:
            if (self._closed or key[0] not in self.counts or key in self._pending
                    or self._attempts[key] >= BUILDS_PER_KIND or self._failures[key] >= FAILED_TRIES):
                return None
            self._attempts[key] += 1
            self._pending.add(key)
            self.stats.kinds_pending += 1
        try:
            return detached_inputs(fb, args, kwargs)
        except Exception:  # noqa: BLE001 - the forward itself must not fail for the compile's sake
            logger.exception("torch.compile in the background: cannot copy a %s forward's inputs; it stays eager",
                             fb.mode.value)
            with self._lock:
                self._pending.discard(key)
                self._failures[key] = FAILED_TRIES
                self.stats.kinds_pending -= 1
                self.stats.kinds_failed += 1
            return None

    def submit(self, key: tuple, forward: CompiledForward, inputs: tuple) -> None:
        """Queue a claimed kind's build (the thread starts if it is not running)."""
        with self._lock:
            self._todo.put((key, forward, inputs))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specserve-compile", daemon=True)
                self._thread.start()

    def idle(self) -> bool:
        """Nothing handed over is still being built."""
        return self.stats.kinds_pending == 0

    def warming(self) -> bool:
        """A child process is still filling the cache (``compile_warm``)."""
        return self.warmer is not None and not self.warmer.done.is_set()

    def wait(self, timeout: float = 3600.0) -> bool:
        """Block until everything claimed so far is built or has failed, or `timeout` seconds pass (tests,
        benchmarks). -> idle()."""
        deadline = time.monotonic() + timeout
        while not self.idle() and time.monotonic() < deadline:
            with self._lock:
                thread = self._thread
            if thread is not None:
                thread.join(max(0.0, min(1.0, deadline - time.monotonic())))
            else:  # claimed, not yet submitted (its eager call is running)
                time.sleep(0.01)
        return self.idle()

    def close(self) -> None:
        """Build nothing more (the cache-filling child is stopped); a graph being built finishes on the (daemon)
        thread."""
        if self.warmer is not None:
            self.warmer.close()
        with self._lock:
            self._closed = True
            while not self._todo.empty():
                self._pending.discard(self._todo.get_nowait()[0])
                self.stats.kinds_pending -= 1

    def build_count(self, threads: int) -> int:
        """The thread count a call running at ``threads`` (``fit_threads``) asks graphs for: its own when the platform
        runs at that count, else (one thread short while a build runs, under a fixed count) the platform's, so a
        call made while a build runs still hands its kind over."""
        return self.target() if self.build_at_target or threads not in self.counts else threads

    def busy(self) -> bool:
        """A graph is being built, or a child process fills the cache: either needs a core."""
        return not self.idle() or self.warming()

    def fit_threads(self) -> int:
        """On the scheduler's thread, before a forward: the platform's count (``target``), one OpenMP thread fewer
        while ``busy``. The compile thread keeps a core busy, and an OpenMP team with a thread on every core waits at
        each barrier for the one the compile holds (the demo's eager decoding on 2 cores: 11-37 tok/s during a
        compile with both threads, 110-118 with one). -> the count set, which the call's kind is keyed by."""
        target = self.target()
        want = max(1, target - 1) if self.busy() else target
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)  # the calling thread's OpenMP count
        return want

    def _run(self) -> None:
        while self.warming() and not self._closed:  # the child's graphs, from the cache, are built in seconds
            self.warmer.done.wait(1.0)
        with torch.inference_mode():  # the scheduler's tensors are inference tensors: the same kind of input
            while True:
                with self._lock:
                    if self._todo.empty() or self._closed:
                        self._thread = None
                        return
                    key, forward, (fb, args, kwargs) = self._todo.get_nowait()
                self._build(key, forward, fb, args, kwargs)

    def _build(self, key: tuple, forward: CompiledForward, fb: ForwardBatch, args: tuple, kwargs: dict) -> None:
        # this thread's OpenMP count, the kind's, which inductor sizes its kernels' teams from and dynamo guards the
        # graph on. Read first: a thread's first read sets its count from the process-wide one, which the
        # scheduler's thread last set
        torch.get_num_threads()
        torch.set_num_threads(key[0])
        before, start = _graph_count(), time.perf_counter()
        try:
            _configure_dynamo()
            mark_varying_dims(fb, args)
            # without onednn_off: the switch is process-wide (it would slow the scheduler's own forwards meanwhile),
            # and a graph reads it when it runs, not when it is built
            forward.compiled(fb, *args, **kwargs)
        except Exception:  # noqa: BLE001 - a failed compile leaves that kind eager; the server keeps serving
            logger.exception("torch.compile in the background failed for %s (%s, batch %d), try %d of %d; "
                             "until it succeeds that kind of forward runs eager",
                             type(getattr(forward.eager, "__self__", forward.eager)).__name__, fb.mode.value,
                             fb.attn.batch_size, self._failures[key] + 1, FAILED_TRIES)
            with self._lock:
                self._failures[key] += 1
                self.stats.kinds_failed += 1
        else:
            with self._lock:
                forward.count_built(_graph_count() - before, time.perf_counter() - start, fb)
                if key not in self._built:
                    self._built.add(key)
                    self.stats.kinds_built += 1
        finally:
            with self._lock:
                self._pending.discard(key)
                self.stats.kinds_pending -= 1


#: tensors of a ForwardBatch (token rows) and of its attention metadata (requests, queries and keys per request)
#: -> their dimensions that change from call to call
BATCH_VARYING_DIMS = {"input_ids": (0,), "positions": (0,), "out_cache_loc": (0,), "logits_indices": (0,),
                      "input_embeds": (0,)}
ATTN_VARYING_DIMS = {"kv_slots": (0, 1), "mask": (0, 2, 3), "q_index": (0, 1), "out_index": (0,)}


def mark_varying_dims(fb: ForwardBatch, args: tuple) -> None:
    """Tell dynamo up front which dimensions of a call's tensors vary (``BATCH_VARYING_DIMS``, ``ATTN_VARYING_DIMS``
    and the token rows of the tensor arguments), so the first graph of each attention variant is already the dynamic
    one. ``maybe_mark_dynamic`` lets a dimension the code needs as a constant, or a size of 1, stay specialized."""
    for holder, varying in ((fb, BATCH_VARYING_DIMS), (fb.attn, ATTN_VARYING_DIMS)):
        for name, dims in varying.items():
            t = getattr(holder, name, None)
            if isinstance(t, torch.Tensor):
                for d in dims:
                    if d < t.dim():
                        torch._dynamo.maybe_mark_dynamic(t, d)
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _with_own_code(method):
    """The function or bound method ``method`` re-made around a copy of its code object. Dynamo keeps compiled
    graphs and their guards on the code object, so without the copy every instance of a class (two engines in one
    process, a STANDALONE draft of the target's architecture) would check its calls against the other instances'
    guards first; with its own code a module's cache holds only its own graphs, and dict-tag guards (one check
    per unchanged module, see ``_configure_dynamo``) never meet another instance's attributes."""
    fn = getattr(method, "__func__", method)
    if not isinstance(fn, types.FunctionType):
        return method
    twin = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__kwdefaults__, twin.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return types.MethodType(twin, method.__self__) if fn is not method else twin


def compile_forward(module: nn.Module, max_bs: int, stats: CompileStats,
                    background: BackgroundCompiler | None = None) -> nn.Module:
    """Replace module.forward (signature forward(fb: ForwardBatch, ...)) by a CompiledForward; returns module."""
    module.forward = CompiledForward(module.forward, max_bs, stats, background=background)
    return module


def _configure_dynamo() -> None:
    """Dynamo's settings for the wrapped forwards: more graphs per function, dict-tag guards."""
    cfg = torch._dynamo.config
    if _configured.done:
        return
    _configured.done = True
    cfg.use_recursive_dict_tags_for_guards = True  # skip unchanged module trees (see the module docstring)
    for name in ("recompile_limit", "cache_size_limit"):  # the knob's name changed across torch versions
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)

"""CUDA graphs for decode, verify and draft forwards (``--cuda-graph-max-bs``, ``--disable-cuda-graph``).

At small batch a decode forward on a GPU is hundreds of tiny kernel launches, and Python issuing them, not the
GPU running them, sets the pace. A CUDA graph records the launches of one forward once and replays them with a
single call. A graph fixes every tensor's shape and address, so a graphed forward runs on *static* buffers:
the live batch is copied into them, the graph is replayed, and the rows that belong to real requests are copied
out.

What is graphed: forwards in DECODE, TARGET_VERIFY and DRAFT_DECODE mode where every request brings the same
number q of new tokens (decode 1, a verify tree N, a draft level topk) and there are at most
``--cuda-graph-max-bs`` requests. Prefill and draft extends (ragged) run eagerly, as with torch.compile.

Shapes are bucketed so a handful of graphs cover every batch:

- requests: 1, 2, 4, 8, then multiples of 8 (``batch_bucket``); pad requests attend to the padding slot 0
  only and write their K/V there (``KVPool`` never hands slot 0 out);
- whatever else the attention backend's metadata fixes (``AttentionMetadata.graph_shape``): with SDPA the key
  count per request, rounded up by ``specserve.attention.sdpa.kv_bucket`` (at most 25% padding, the padded keys
  masked out). The metadata also provides its static buffers and refills them (``static_buffers`` /
  ``copy_into``), so this file never looks inside it.

Graphs are captured lazily, the first time a bucket is met, into one memory pool shared by all of the engine's
graphs (target and draft): captures add little memory and start-up is not slowed. Capture time, graph count
and replays are reported in the server info (``cuda_graph_*``). Outputs are copied out of the graph's buffers,
so a caller may keep them across forwards. A bucket whose capture fails (out of memory, an op a graph cannot
record) is logged and runs eagerly from then on: serving goes on.

``SPECSERVE_CUDA_GRAPH_EMULATE=1`` runs all of this except the capture on a CPU: static buffers, padding and
bucketing, with the recorded function re-run eagerly on the static buffers at each "replay". It exists so the
bookkeeping is tested on machines without a GPU (it is slower than plain eager: padded work, extra copies). Its
capture runs under ``CaptureChecker``, which fails on the ops a real capture cannot record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.attention import ForwardBatch, ForwardMode
from specserve.models.compile import CompiledForward

logger = logging.getLogger(__name__)

GRAPHED_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE})
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (lazy inits, cuBLAS workspaces)
EMULATE_ENV = "SPECSERVE_CUDA_GRAPH_EMULATE"


def batch_bucket(bs: int, max_bs: int) -> int | None:
    """The captured batch size serving `bs` requests: 1, 2, 4, 8, then multiples of 8, never above max_bs;
    None when bs > max_bs (the forward runs eagerly)."""
    if bs < 1 or bs > max_bs:
        return None
    bucket = 1 << (bs - 1).bit_length() if bs <= 8 else -(-bs // 8) * 8
    return min(bucket, max_bs)


def graph_backend(device: torch.device, disabled: bool) -> str | None:
    """"cuda" (real graphs), "emulate" (CPU, SPECSERVE_CUDA_GRAPH_EMULATE=1) or None (eager forwards)."""
    if disabled:
        return None
    if device.type == "cuda":
        return "cuda"
    return "emulate" if os.environ.get(EMULATE_ENV, "") not in ("", "0") else None


@dataclass
class GraphStats:
    graphs: int = 0  # graphs captured
    capture_seconds: float = 0.0  # warm-up runs + capture, all graphs
    replays: int = 0  # forwards served by a graph
    eager_calls: int = 0  # forwards of a wrapped module run eagerly (a mode or batch not graphed)
    capture_failures: int = 0  # buckets whose capture failed: they run eagerly from then on


class _StaticForward:
    """One graph: a forward of fixed shape on static buffers, its recorded outputs and how to refill them."""

    def __init__(self, fb: ForwardBatch, args: tuple[torch.Tensor, ...], bs: int, shape: tuple) -> None:
        rows = bs * fb.attn.max_q_len
        self.rows = rows
        attn = fb.attn.static_buffers(bs, shape)  # the backend's metadata on static buffers
        embeds = None if fb.input_embeds is None else _rows_like(fb.input_embeds, rows)
        self.fb = ForwardBatch(fb.mode, _rows_like(fb.input_ids, rows), _rows_like(fb.positions, rows),
                               _rows_like(fb.out_cache_loc, rows), attn, fb.kv_pool,
                               capture_layers=fb.capture_layers, input_embeds=embeds)
        self.args = tuple(_rows_like(a, rows) for a in args)
        self.outputs: list[torch.Tensor] = []  # flat, each [rows, ...]
        self.spec = None  # their pytree structure
        self.graph = None  # torch.cuda.CUDAGraph (backend "cuda")

    def load(self, fb: ForwardBatch, args: tuple[torch.Tensor, ...]) -> int:
        """Copy a live forward into the static buffers; pad requests see and write slot 0. -> its real rows."""
        n = fb.input_ids.shape[0]
        s = self.fb
        for dst, src in ((s.input_ids, fb.input_ids), (s.positions, fb.positions), (s.out_cache_loc, fb.out_cache_loc),
                         (s.input_embeds, fb.input_embeds), *zip(self.args, args, strict=True)):
            if dst is not None:
                dst[:n].copy_(src)
                dst[n:].zero_()
        fb.attn.copy_into(s.attn)
        return n

    def record(self, out) -> None:
        self.outputs, self.spec = pytree.tree_flatten(out)
        if not all(isinstance(t, torch.Tensor) and t.shape[0] == self.rows for t in self.outputs):
            raise TypeError("a graphed forward must return tensors with one row per token")

    def result(self, n: int):
        """The real rows of the outputs, copied out of the graph's buffers."""
        return pytree.tree_unflatten([t[:n].clone() for t in self.outputs], self.spec)


def _rows_like(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)


class CudaGraphs:
    """The engine's graphs: one memory pool and one set of stats for every wrapped module."""

    def __init__(self, backend: str, max_bs: int, device: torch.device) -> None:
        self.backend, self.max_bs, self.device = backend, max_bs, device
        self.stats = GraphStats()
        self.pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        self._stream = torch.cuda.Stream(device) if backend == "cuda" else None

    def wrap(self, module: nn.Module) -> nn.Module:
        """Replace module.forward (signature forward(fb: ForwardBatch, *tensors)) by a GraphedForward."""
        module.forward = GraphedForward(module.forward, self)
        return module

    def capture(self, static: _StaticForward, fn, check: bool = True) -> None:
        """Record fn (which runs the forward on static's buffers) into static; the buffers hold a loaded batch.
        check (emulation): run it under CaptureChecker (not for compiled forwards: dynamo does not trace under a
        dispatch mode, and inductor's kernels are its own to keep capturable)."""
        start = time.perf_counter()
        if self.backend == "cuda":
            self._capture_cuda(static, fn)
        else:
            with CaptureChecker() if check else contextlib.nullcontext():  # what breaks a real capture fails here
                static.record(fn())
        seconds = time.perf_counter() - start
        self.stats.graphs += 1
        self.stats.capture_seconds += seconds
        logger.info("CUDA graph %d captured (%s, %d requests x %d tokens, %d keys) in %.2fs", self.stats.graphs,
                    static.fb.mode.value, static.fb.attn.batch_size, static.fb.attn.max_q_len,
                    static.fb.attn.kv_slots.shape[1], seconds)

    def _capture_cuda(self, static: _StaticForward, fn) -> None:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                static.fb.rope_rows.clear()
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        static.fb.rope_rows.clear()  # the capture must record the RoPE gather, not reuse the warm-up's rows
        graph = torch.cuda.CUDAGraph()
        # thread_local: the overlap scheduler's other thread may touch CUDA while this one captures
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            out = fn()
        static.graph = graph
        static.record(out)

    def replay(self, static: _StaticForward, fn) -> None:
        self.stats.replays += 1
        if static.graph is not None:
            static.graph.replay()
            return
        static.fb.rope_rows.clear()  # emulation: re-run eagerly on the static buffers, into the recorded outputs
        for dst, src in zip(static.outputs, pytree.tree_flatten(fn())[0], strict=True):
            dst.copy_(src)


class GraphCaptureError(RuntimeError):
    """A graphed forward did something a CUDA graph cannot record."""


class CaptureChecker(TorchDispatchMode):
    """Fails on the ops that cannot run inside a CUDA graph capture, so the emulated capture on CPU finds them:
    reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``), ops whose output
    shape depends on data (``nonzero``, boolean-mask indexing, ``masked_select``, ``repeat_interleave`` without
    ``output_size``) and tensors made from Python data (``torch.tensor(...)``: a host-to-device copy on CUDA).
    Not seen: ``.tolist()`` / ``.numpy()`` of a CPU tensor, which read memory without dispatching an op."""

    SYNCING = {"aten.item", "aten._local_scalar_dense", "aten.nonzero", "aten.nonzero_static", "aten.masked_select",
               "aten.unique_consecutive", "aten._unique2", "aten.lift_fresh"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if name in self.SYNCING:
            raise GraphCaptureError(f"{name} in a graphed forward: it cannot be captured in a CUDA graph")
        tensor_repeats = func._overloadname in ("Tensor", "self_Tensor")  # not self_int: a static size
        if name == "aten.repeat_interleave" and tensor_repeats and kwargs.get("output_size") is None:
            raise GraphCaptureError("aten.repeat_interleave without output_size in a graphed forward")
        if name in ("aten.index", "aten.index_put", "aten.index_put_") and _has_bool_index(args):
            raise GraphCaptureError(f"{name} with a boolean mask in a graphed forward (a data-dependent shape)")
        return func(*args, **kwargs)


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class GraphedForward:
    """Callable replacing ``module.forward``: graphed when the forward fits a bucket, eager otherwise."""

    def __init__(self, eager, graphs: CudaGraphs) -> None:
        self.eager, self.graphs = eager, graphs
        self.entries: dict[tuple, _StaticForward | None] = {}  # None: the bucket's capture failed

    def bucket(self, fb: ForwardBatch, args: tuple) -> tuple | None:
        """The graph key serving this forward, or None when it runs eagerly."""
        md = fb.attn
        shape = md.graph_shape() if fb.mode in GRAPHED_MODES and fb.kv_pool is not None else None
        if shape is None:
            return None
        if not all(isinstance(a, torch.Tensor) and a.shape[0] == fb.input_ids.shape[0] for a in args):
            return None
        bs = batch_bucket(md.batch_size, self.graphs.max_bs)
        if bs is None:
            return None
        embeds = None if fb.input_embeds is None else (fb.input_embeds.shape[1:], fb.input_embeds.dtype)
        return (fb.mode, bs, md.max_q_len, shape, fb.capture_layers, id(fb.kv_pool),
                embeds, tuple((a.shape[1:], a.dtype) for a in args))

    def __call__(self, fb: ForwardBatch, *args):
        key = self.bucket(fb, args)
        static = None if key is None else self.entries.get(key)
        if key is None or (static is None and key in self.entries):  # not graphed, or its capture failed
            self.graphs.stats.eager_calls += 1
            return self.eager(fb, *args)
        fresh = static is None
        if fresh:
            static = _StaticForward(fb, args, key[1], key[3])
        n = static.load(fb, args)
        run = lambda: self.eager(static.fb, *static.args)  # noqa: E731
        if fresh:
            if not self._capture(key, static, run):
                return self.eager(fb, *args)
        if static.graph is not None or not fresh:  # a fresh emulated entry already ran during its capture
            self.graphs.replay(static, run)
        return static.result(n)

    def _capture(self, key: tuple, static: _StaticForward, run) -> bool:
        """Capture a new bucket; on failure (out of memory, an op a graph cannot record) log it and leave the
        bucket eager for good, so serving goes on. -> whether it was captured."""
        try:
            self.graphs.capture(static, run, check=not isinstance(self.eager, CompiledForward))
        except Exception as e:  # noqa: BLE001 - any capture failure: fall back, never fail the request
            self.entries[key] = None
            self.graphs.stats.capture_failures += 1
            logger.warning("CUDA graph capture failed (%s, %d requests x %d tokens, attention shape %s); that bucket "
                           "runs eagerly: %s: %s", key[0].value, key[1], key[2], key[3], type(e).__name__, e)
            return False
        self.entries[key] = static
        return True

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
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from specserve.attention import ForwardBatch, ForwardMode
from specserve.models.one_row import one_row_forward, onednn_off

logger = logging.getLogger(__name__)

COMPILED_MODES = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE,
                            ForwardMode.DRAFT_EXTEND})
RECOMPILE_LIMIT = 64  # graphs per compiled function (dynamo's default of 8 is too few for decode + verify + draft)


class _ThreadFlag(threading.local):
    done = False


_configured = _ThreadFlag()


@dataclass
class CompileStats:
    graphs: int = 0  # graphs dynamo built for the wrapped forwards
    seconds: float = 0.0  # wall time of the calls that built them (tracing + inductor + the run itself)
    compiled_calls: int = 0
    per_module: Counter = field(default_factory=Counter)  # graphs by the wrapped module's class name


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledForward:
    """Callable replacing ``module.forward``: fn(fb, *args) compiled or eager, chosen per call."""

    def __init__(self, eager, max_bs: int, stats: CompileStats, modes=COMPILED_MODES) -> None:
        self.eager, self.max_bs, self.stats, self.modes = eager, max_bs, stats, modes
        self.compiled = torch.compile(_with_own_code(eager), dynamic=None)

    def use_compiled(self, fb: ForwardBatch) -> bool:
        # request-by-request attention (a split prefill catch-up) loops over a varying number of groups: eager
        return fb.mode in self.modes and fb.attn.batch_size <= self.max_bs and fb.attn.groups is None

    def __call__(self, fb: ForwardBatch, *args, **kwargs):
        if not self.use_compiled(fb):
            return self.eager(fb, *args, **kwargs)
        self.stats.compiled_calls += 1
        _configure_dynamo()  # dynamo's config is per thread: set it on the thread that runs the forwards
        mark_varying_dims(fb, args)
        before, start = _graph_count(), time.perf_counter()
        with onednn_off() if one_row_forward(fb.input_ids) else nullcontext():
            out = self.compiled(fb, *args, **kwargs)
        built = _graph_count() - before
        if built:
            elapsed = time.perf_counter() - start
            module = type(getattr(self.eager, "__self__", self.eager)).__name__
            self.stats.graphs += built
            self.stats.per_module[module] += built
            self.stats.seconds += elapsed
            logger.info("torch.compile: %d new graph(s) for %s (%s, batch %d) in %.1fs", built, module,
                        fb.mode.value, fb.attn.batch_size, elapsed)
        return out


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


def compile_forward(module: nn.Module, max_bs: int, stats: CompileStats) -> nn.Module:
    """Replace module.forward (signature forward(fb: ForwardBatch, ...)) by a CompiledForward; returns module."""
    module.forward = CompiledForward(module.forward, max_bs, stats)
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

"""``--enable-torch-compile``: compiled decode, verify and draft forwards (CPU and CUDA).

``torch.compile`` (inductor) fuses the many small element-wise ops of a decoder layer (norms, RoPE, SiLU-gating,
residual adds) into generated kernels; on small-batch decode, where a forward is mostly per-op overhead, that is
where the time goes. Prefill (EXTEND) stays eager: its shapes vary the most and it is compute-bound anyway.

A wrapped module keeps its eager forward and gains a compiled twin; each call picks one from the ForwardBatch
(its first argument): compiled for the modes in ``modes`` when the batch has at most ``--torch-compile-max-bs``
requests, eager otherwise (SGLang's rule for ``--torch-compile-max-bs``). Shapes are compiled static first and
become dynamic (``dynamic=None``) on the first change, so the number of graphs stays small (one per attention
variant: decode without a mask, tree verify with one, draft steps). Compile time is measured per call: a call
during which dynamo built a new graph counts as compile time (``CompileStats``), reported in the server info.

A one-token CPU forward (batch-1 decode, a draft's first step) runs its compiled graph with oneDNN off
(``models.one_row``): its linears then call PyTorch's matrix-vector kernel on the kept plain weights from
inside the graph, the fastest one-row path on CPU (SmolLM2-135M bf16 decode: 12.4 ms a token against 17-18 ms
eager).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

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


_limit_raised = _ThreadFlag()


@dataclass
class CompileStats:
    graphs: int = 0  # graphs dynamo built for the wrapped forwards
    seconds: float = 0.0  # wall time of the calls that built them (tracing + inductor + the run itself)
    compiled_calls: int = 0


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledForward:
    """Callable replacing ``module.forward``: fn(fb, *args) compiled or eager, chosen per call."""

    def __init__(self, eager, max_bs: int, stats: CompileStats, modes=COMPILED_MODES) -> None:
        self.eager, self.max_bs, self.stats, self.modes = eager, max_bs, stats, modes
        self.compiled = torch.compile(eager, dynamic=None)

    def use_compiled(self, fb: ForwardBatch) -> bool:
        # request-by-request attention (a split prefill catch-up) loops over a varying number of groups: eager
        return fb.mode in self.modes and fb.attn.batch_size <= self.max_bs and fb.attn.groups is None

    def __call__(self, fb: ForwardBatch, *args, **kwargs):
        if not self.use_compiled(fb):
            return self.eager(fb, *args, **kwargs)
        self.stats.compiled_calls += 1
        _raise_recompile_limit()  # dynamo's config is per thread: set it on the thread that runs the forwards
        before, start = _graph_count(), time.perf_counter()
        with onednn_off() if one_row_forward(fb.input_ids) else nullcontext():
            out = self.compiled(fb, *args, **kwargs)
        built = _graph_count() - before
        if built:
            elapsed = time.perf_counter() - start
            self.stats.graphs += built
            self.stats.seconds += elapsed
            logger.info("torch.compile: %d new graph(s) for %s (%s, batch %d) in %.1fs", built,
                        type(getattr(self.eager, "__self__", self.eager)).__name__, fb.mode.value,
                        fb.attn.batch_size, elapsed)
        return out


def compile_forward(module: nn.Module, max_bs: int, stats: CompileStats) -> nn.Module:
    """Replace module.forward (signature forward(fb: ForwardBatch, ...)) by a CompiledForward; returns module."""
    module.forward = CompiledForward(module.forward, max_bs, stats)
    return module


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    if _limit_raised.done:
        return
    _limit_raised.done = True
    for name in ("recompile_limit", "cache_size_limit"):  # the knob's name changed across torch versions
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)

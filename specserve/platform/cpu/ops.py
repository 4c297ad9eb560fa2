"""specserve's CPU kernels as operators that compiled graphs call as they are (``torch.ops.specserve.<name>``).

Inductor cannot see inside a ctypes call or oneDNN's packed weights, so each kernel enters a compiled graph as an
opaque operator. They are defined on a ``torch.library.Library`` with one implementation for real tensors and a fake
one for tracing (output shape and dtype). Such an operator dispatched in 1.75 us on a 2-core AMD EPYC, where one
made with ``torch.library.custom_op`` took 3.1 us (its Python wrapper adds a dispatch of its own), and a compiled
decode step calls them over a hundred times. The Python implementations (ctypes) are the fallback: where
``native.native_ops`` loads ``ops.cpp``, its C++ kernels take the CPU calls of small_gemm, int8_gemm and
tree_attention, without Python between the dispatcher and the kernel (``benchmarks/bench_ops.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("specserve", "FRAGMENT")


def cpu_op(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define ``specserve::<schema>`` with ``impl`` for real tensors (CPU ones, and oneDNN's packed weights, a backend
    of their own) and ``fake`` for tracing -> the operator."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"specserve::{name}", fake, lib=_LIB)
    return getattr(torch.ops.specserve, name).default


def registered(name: str) -> bool:
    """``ops.cpp`` registered specserve::name's C++ implementation here (its build has that kernel)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"specserve::{name}", "CPU")

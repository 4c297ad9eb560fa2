"""RMSNorm, SiLU-and-multiply and RoPE of an eager bf16 forward in one operator call each (``elementwise.cpp``).

Eager PyTorch runs a bf16 RMSNorm as about ten operators (the float32 cast, the norm's power, mean, add, reciprocal
square root and multiply, the cast back, the weight's multiply), the gated MLP's activation as two and a rotary
embedding as five, each a dispatch of a few microseconds: on SmolLM2-135M (30 layers) that is hundreds of calls per
decode step, as long as a good share of the step's matmuls. Each operator here is one dispatch and one pass.

They take bf16 tensors in eager forwards without autograd (``takes``); compiled graphs keep inductor's own fused
loops, and float32 and float16 forwards keep PyTorch's operators. Each row is computed on its own, so a row's result
does not depend on how many rows share the call (a verify tree's row equals its one-row decode). RoPE equals PyTorch's
bit for bit; RMSNorm's sum of squares and SiLU's exponential are computed their own way, so a value can differ from
PyTorch's by one bf16 step where the float32 result sits next to a rounding boundary.

Their C++ implementations load with the other operators' (``native.native_ops``; AVX512-BF16 kernels in
``elementwise.cpp``, AVX2 ones in ``elementwise_avx2.cpp``); without them (neither AVX512-BF16 nor AVX2, no
compiler, ``SPECSERVE_CPU_OPS=python``) or with ``SPECSERVE_CPU_ELEMENTWISE=off`` the layers run PyTorch's operators.
The Python implementations below are the eager composites the layers would run, for the operators' tests.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specserve.platform.cpu import native
from specserve.platform.cpu.ops import cpu_op

ENV = "SPECSERVE_CPU_ELEMENTWISE"
MODES = ("on", "off")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] bf16 -> weight * bf16(x * rsqrt(mean(x^2) + eps)), as ``layers.RMSNorm`` computes in bf16."""
    return weight.to(x.dtype) * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2N] -> silu(gate) * up [..., N]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos / sin [T, 1, D] (cos | cos, -sin | sin) -> x * cos + cat(x2, x1) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


def _last_halved(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


rms_norm = cpu_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm_reference,
                  lambda x, weight, eps: torch.empty_like(x, memory_format=torch.contiguous_format))
silu_mul = cpu_op("silu_mul(Tensor gate_up) -> Tensor", silu_mul_reference, _last_halved)
rope = cpu_op("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", rope_reference,
              lambda x, cos, sin: torch.empty(x.shape, dtype=x.dtype, device=x.device))


def race_reference(k1: torch.Tensor, k2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The exponential race's noise, eagerly (``specserve.sampling.race``)."""
    from specserve.sampling.race import _exponentials

    return _exponentials(k1, k2, ids)


# The seeded sampler's noise over a vocabulary (sampling/race.py): k1, k2 [R, 1] int32, ids [R or 1, M] -> [R, M]
# float32, one pass of integer hashing and a polynomial logarithm (``elementwise.cpp``)
race_exponentials = cpu_op("race_exponentials(Tensor k1, Tensor k2, Tensor ids) -> Tensor", race_reference,
                           lambda k1, k2, ids: k1.new_empty((k1.shape[0], ids.shape[-1]), dtype=torch.float32))


def kv_store_reference(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    """k_buf / v_buf [S, Hkv, D] <- k / v [T, Hkv, D] at slots [T] (two index writes)."""
    k_buf[slots] = k
    v_buf[slots] = v


# A layer's K and V writes into the pool in one call, a row copy per token (``KVPool.store``): two index writes cost
# about 13 us each a decode step's layer, eagerly
kv_store = cpu_op("kv_store(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor slots, Tensor k, Tensor v) -> ()",
                  kv_store_reference, lambda k_buf, v_buf, slots, k, v: None)


@functools.cache
def available() -> bool:
    """The operators run their C++ implementations here and SPECSERVE_CPU_ELEMENTWISE is not off."""
    return native.env_mode(ENV, MODES) == "on" and native.native_ops()


def takes(x: torch.Tensor) -> bool:
    """An eager bf16 CPU call without autograd (a layer checks this before calling the operators)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def use_fused_ops(module: torch.nn.Module) -> int:
    """Give module's RMSNorms, SiLU gated MLPs and rotary embeddings (exactly those classes: a subclass may compute
    otherwise, as Gemma's norm does) these operators for their eager bf16 calls -> how many modules got one."""
    from specserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding

    count = 0
    for m in module.modules():
        if type(m) is RMSNorm:
            m.fused = rms_norm
        elif type(m) is GatedMLP and m.act is F.silu:
            m.fused = silu_mul
        elif type(m) is RotaryEmbedding:
            m.fused = rope
        else:
            continue
        count += 1
    return count

"""specserve's AVX2 bf16 kernel (platform/cpu/avx2_gemm.py): its exact sums, a row's bits whatever the call,
Avx2Linear eager and compiled, and the engine where oneDNN packs no bf16 weight (simulated on CPUs where it does)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve import Engine
from specserve.platform.cpu import avx2_gemm, native, packing, upcast_probe
from specserve.platform.cpu.avx2_gemm import Avx2Linear
from specserve.platform.cpu.packing import PackedLinear, UpcastLinear, avx2_linears_for_cpu
from specserve.platform.cpu.small_gemm import pack
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

needs_kernel = pytest.mark.skipif(avx2_gemm.kernel() is None, reason="no AVX2 and FMA or no C++ compiler here")


def sequential_sums(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic written out: each output starts from the float32 bias and adds w[n, k] * x[m, k] for
    k = 0, 1, ... in float32, rounded to bf16 at the end. A product of two bf16 values is exact in float32, so each
    float32 add rounds as the kernel's FMA does."""
    acc = torch.zeros(x.shape[0], w.shape[0]) if bias is None else bias.float().expand(x.shape[0], -1).clone()
    xf, wf = x.float(), w.float()
    for k in range(x.shape[1]):
        acc = acc + xf[:, k:k + 1] * wf[:, k]
    return acc.to(torch.bfloat16)


def test_cpu_supports_reads_the_avx2_flags():
    assert native.cpu_supports("processor: 0\nflags\t\t: fpu sse2 avx avx2 fma\n", isa="avx2")
    assert not native.cpu_supports("processor: 0\nflags\t\t: fpu sse2 avx avx2\n", isa="avx2")
    assert not native.cpu_supports("processor: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")  # no AVX512-BF16


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 70])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_sums_in_order_and_rounds_to_nearest_even(rows, with_bias):
    """Exactly the sequential float32 sums over a weight of two column groups, rounded as PyTorch rounds to bf16;
    70 rows cross a row block (64). A strided input (a view's rows) reads the same."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(128, 18, generator=gen).to(torch.bfloat16)
    bias = torch.randn(128, generator=gen) if with_bias else None
    x = torch.randn(rows, 24, generator=gen).to(torch.bfloat16)[:, 3:21]  # row stride 24
    got = avx2_gemm._avx2_mm(x, pack(w), bias)
    assert torch.equal(got, sequential_sums(x, w, bias))


@needs_kernel
def test_a_row_has_the_same_bits_in_any_call():
    """A row computed alone (a decode step), among 5 (a verify tree) or among 100 (a prefill): the same bits."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(192, 96, generator=gen).to(torch.bfloat16)
    x = torch.randn(100, 96, generator=gen).to(torch.bfloat16)
    packed = pack(w)
    whole = avx2_gemm._avx2_mm(x, packed, None)
    assert torch.equal(avx2_gemm._avx2_mm(x[40:45], packed, None), whole[40:45])
    assert all(torch.equal(avx2_gemm._avx2_mm(x[i:i + 1], packed, None), whole[i:i + 1]) for i in (0, 41, 99))
    torch.testing.assert_close(whole.float(), F.linear(x.float(), w.float()), atol=0.05, rtol=0.02)


@needs_kernel
def test_avx2_linear_eager_and_compiled():
    """Avx2Linear on a 3-d input equals the kernel on its rows; a float32 input is cast in and out; inside a compiled
    graph it runs through the operator with the same bits."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 128, bias=True).to(torch.bfloat16)
    model = nn.Sequential(lin)
    assert avx2_linears_for_cpu(model) == 1
    fast = model[0]
    assert isinstance(fast, Avx2Linear) and fast.bias.dtype == torch.float32
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        want = sequential_sums(x.view(6, 64), lin.weight.detach(), lin.bias.detach()).view(2, 3, 128)
        assert torch.equal(fast(x), want)
        assert torch.equal(fast(x.float()), want.float())
        assert torch.equal(torch.compile(fast)(x), want)


def test_only_bf16_linears_of_the_kernels_shapes_are_replaced():
    """An fp16 linear and one whose output is no multiple of 64 keep nn.Linear."""
    model = nn.Sequential(nn.Linear(64, 128).to(torch.bfloat16), nn.Linear(128, 96).to(torch.bfloat16),
                          nn.Linear(96, 64).half())
    assert avx2_linears_for_cpu(model) == 1
    assert [type(m) for m in model] == [Avx2Linear, nn.Linear, nn.Linear]


@needs_kernel
def test_engine_runs_on_the_kernel_where_onednn_packs_nothing(model_factory, monkeypatch):
    """On a CPU whose oneDNN cannot pack bf16 weights (simulated), every bf16 linear of the kernel's shapes runs on
    it (the server info counts them) and no float32 copy is made; SPECSERVE_CPU_AVX2_GEMM=off keeps PyTorch's kernel,
    and then SPECSERVE_CPU_UPCAST's copies apply as before."""
    monkeypatch.setattr(packing, "_pack", lambda *a, **k: None)
    with Engine(model_path=model_factory("qwen2", dtype=torch.bfloat16), max_total_tokens=2048) as e:
        model = e.scheduler.runner.model
        fast = [m for m in model.modules() if isinstance(m, Avx2Linear)]
        assert fast and not any(isinstance(m, (PackedLinear, UpcastLinear)) for m in model.modules())
        assert e.get_server_info()["cpu_avx2_gemm_linears"] == len(fast)
        assert len(e.generate(PROMPTS[:3], greedy(6))[0]["output_ids"]) == 6
    monkeypatch.setenv(avx2_gemm.ENV, "off")
    monkeypatch.setenv(upcast_probe.ENV, "on")
    with Engine(model_path=model_factory("qwen2", dtype=torch.bfloat16), max_total_tokens=2048) as e:
        modules = list(e.scheduler.runner.model.modules())
        assert not any(isinstance(m, Avx2Linear) for m in modules) and any(isinstance(m, UpcastLinear) for m in modules)
        assert "cpu_avx2_gemm_linears" not in e.get_server_info()


@needs_kernel
def test_speculation_on_the_kernel_is_lossless(model_factory, monkeypatch):
    """A bf16 target and its bf16 STANDALONE draft both on the kernel (oneDNN packing nothing, simulated): greedy
    speculative output equals plain decoding's on the same kernel, for a batch of prompts, with drafts accepted."""
    monkeypatch.setattr(packing, "_pack", lambda *a, **k: None)
    path = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, dtype=torch.bfloat16)
    with Engine(model_path=path, max_total_tokens=4096) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
    with Engine(model_path=path, max_total_tokens=4096, **spec_kwargs("STANDALONE", path, 4, 3, 8)) as e:
        assert any(isinstance(m, Avx2Linear) for m in e.scheduler.decoder.proposer.head.modules())
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, 1.5)
        assert_no_kv_leak(e)


def test_a_bad_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(avx2_gemm.ENV, "yes")
    with pytest.raises(ValueError, match=avx2_gemm.ENV):
        avx2_gemm.available()

"""specserve's int8 weight-only kernels (platform/cpu/int8_gemm.py; AVX512-BF16, else AVX2): the layout, results
against float32 matmuls, the AVX2 kernel's exact sums, row independence, how a quantized linear hands its calls to
the kernel (eager and compiled), and engines on it: greedy output as with PyTorch's int8 kernel, and speculative
decoding over an int8 bf16 target equal to plain decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve import Engine
from specserve.models import quantize as Q
from specserve.platform.cpu import fused_layer, int8_gemm, native, small_gemm, tree_attention
from tests.engine.helpers import PROMPTS, assert_greedy_equal_up_to_ties, greedy, record_rows
from tests.speculative.helpers import (
    REPEATING_PROMPTS,
    assert_drafting_happened,
    assert_ngram_equals_plain,
    spec_kwargs,
)

needs_kernel = pytest.mark.skipif(int8_gemm.kernel() is None,
                                  reason="neither AVX512-BF16 nor AVX2 and FMA, or no C++ compiler here")
needs_avx2 = pytest.mark.skipif(int8_gemm.avx2_kernel() is None, reason="no AVX2 and FMA or no C++ compiler here")


def test_packed_layout_by_hand():
    """[N, K] -> [N / 32, K / 2, 2, 32]: entry (g, j, t, c) is q[32 g + c, 2 j + t]."""
    q = (torch.arange(64 * 6) % 251 - 125).to(torch.int8).view(64, 6)
    p = int8_gemm.pack(q)
    assert p.shape == (2, 3, 2, 32) and p.is_contiguous()
    assert p[1, 2, 1, 5] == q[32 + 5, 2 * 2 + 1] and p[0, 1, 0, 31] == q[31, 2]
    assert int8_gemm.fits(q) and not int8_gemm.fits(q[:, :5]) and not int8_gemm.fits(q[:48])
    assert not int8_gemm.fits(q.float())


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return Q.quantize_int8(torch.randn(n, k, generator=gen))


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("amx_from", [0, 1, 2])
def test_kernel_matches_a_float32_matmul(bias, amx_from):
    """1-16 rows (every row-tile remainder), an odd number of steps (K / 2 = 49; on the vector loop), K = 128 (which the
    tile unit takes where it runs, from amx_from rows: also 17-64 rows, every 16-row block remainder), a strided
    input, with and without bias: within bf16 rounding of the float32 result of the same numbers, extremes of the
    int8 range included."""
    for k in (98, 128):
        q, scales = _weights(96, k, 0)
        q[0, :4] = torch.tensor([127, -127, -128, 0], dtype=torch.int8)
        b = torch.randn(96) if bias else None
        packed = int8_gemm.pack(q)
        more = [17, 31, 32, 33, int8_gemm.AMX_MAX_ROWS] if k % 32 == 0 and amx_from else []
        for rows in [*range(1, int8_gemm.SMALL_MAX_ROWS + 1), *more]:
            wide = torch.randn(rows, k + 30, dtype=torch.bfloat16)
            x = wide[:, 16 : 16 + k]  # a row stride of k + 30
            got = int8_gemm.int8_mm(x, packed, scales, b, amx_from)
            want = F.linear(x.float(), q.float() * scales[:, None], b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


def scaled_sequential_sums(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """The AVX2 kernel's arithmetic written out: each output's float32 sum starts from 0 and adds q[n, k] * x[m, k]
    for k = 0, 1, ... (an int8 times a bf16 is exact in float32, so each add rounds as the kernel's FMA or add does),
    then sum * scale + bias with one rounding (float64 holds the product exactly), rounded to bf16."""
    acc = torch.zeros(x.shape[0], q.shape[0])
    xf, qf = x.float(), q.float()
    for k in range(x.shape[1]):
        acc = acc + xf[:, k:k + 1] * qf[:, k]
    out = acc.double() * scales.double() + (0.0 if bias is None else bias.double())
    return out.float().to(torch.bfloat16)


@needs_avx2
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_kernel_sums_in_order(bias, monkeypatch):
    """The AVX2 kernel (run here even where the AVX512 one would be chosen): exactly the sequential sums above, for
    1-16 rows (every 4-row tile remainder, the one-row path) and a strided input."""
    monkeypatch.setattr(int8_gemm, "kernel", int8_gemm.avx2_kernel)
    gen = torch.Generator().manual_seed(3)
    q, scales = Q.quantize_int8(torch.randn(96, 98, generator=gen))
    q[0, :4] = torch.tensor([127, -127, -128, 0], dtype=torch.int8)
    b = torch.randn(96, generator=gen) if bias else None
    packed = int8_gemm.pack(q)
    for rows in range(1, int8_gemm.SMALL_MAX_ROWS + 1):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)[:, 16:114]  # a row stride of 128
        assert torch.equal(int8_gemm._int8_mm(x, packed, scales, b), scaled_sequential_sums(x, q, scales, b))


@needs_kernel
@pytest.mark.parametrize("amx_from", [0, 1])
def test_a_row_gets_the_same_bits_in_any_call(amx_from):
    """Each row's sums run in the same order whatever the call's row count, on the vector loop (amx_from 0) and on
    the tile unit where it runs (1: every call, up to 16-row blocks and a zero-padded tail), so a token's linear
    outputs in a verify tree equal those of a one-row decode call bit for bit when both take the same path."""
    q, scales = _weights(128, 64, 1)
    packed = int8_gemm.pack(q)
    rows = 37 if amx_from else 13
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    together = int8_gemm.int8_mm(x, packed, scales, None, amx_from)
    for i in range(rows):
        assert torch.equal(int8_gemm.int8_mm(x[i : i + 1], packed, scales, None, amx_from)[0], together[i])


@needs_kernel
def test_amx_setting(monkeypatch):
    """SPECSERVE_INT8_GEMM_AMX: auto sends calls of AMX_AUTO_FROM rows or more to the tile unit where it runs, all
    every call, off none; anything else is an error naming the variable."""
    runs = int8_gemm.amx_runs()
    for mode, want in (("auto", int8_gemm.AMX_AUTO_FROM), ("all", 1), ("off", 0)):
        monkeypatch.setenv(int8_gemm.AMX_ENV, mode)
        assert int8_gemm.amx_from() == (want if runs else 0)
    monkeypatch.setenv(int8_gemm.AMX_ENV, "sometimes")
    with pytest.raises(ValueError, match=int8_gemm.AMX_ENV):
        int8_gemm.amx_from()


def _quantized(dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=True), torch.nn.Linear(96, 64, bias=False)).to(dtype)
    Q.quantize_linears(model, Q.QuantConfig(8))
    return model


@needs_kernel
def test_a_quantized_linear_hands_its_few_row_calls_to_the_kernel(monkeypatch):
    """A bf16 int8 linear: calls of up to SMALL_MAX_ROWS rows run the kernel (its int8 weights are then the kernel's
    alone; up to AMX_MAX_ROWS where the tile unit takes them), larger ones the dense copy, both close to the
    dequantized weights' matmul; a compiled graph calls the same kernel (specserve::int8_gemm) and gets the same bits.
    A float32 linear keeps PyTorch's kernel."""
    model = _quantized(torch.bfloat16)
    ref = [lin.dense.weight.float() for lin in model]  # the dequantized weights
    assert int8_gemm.use_int8_kernel(model) == 2
    assert all(lin.q8 is None and isinstance(lin.few_rows, int8_gemm.Int8Copy) for lin in model)
    most = model[0].few_rows.max_rows
    assert most == (int8_gemm.AMX_MAX_ROWS if int8_gemm.amx_from() else int8_gemm.SMALL_MAX_ROWS)
    calls = record_rows(monkeypatch, int8_gemm, "int8_mm")
    with torch.inference_mode():
        for rows in (1, 16, 17, int8_gemm.AMX_MAX_ROWS + 1):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            want = F.linear(F.linear(x.float(), ref[0], model[0].bias.float()), ref[1])
            torch.testing.assert_close(model(x).float(), want, atol=5e-2, rtol=3e-2)
        assert calls == [r for r in (1, 16, 17) if r <= most for _ in range(2)]
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        assert torch.equal(torch.compile(model)(x), model(x))
    fp32 = _quantized(torch.float32)
    assert int8_gemm.use_int8_kernel(fp32) == 0 and all(lin.few_rows is None for lin in fp32)


@needs_kernel
def test_engines_on_the_kernel(model_factory, monkeypatch):
    """A bf16 model under --torchao-config int8wo: the server info counts its linears on the kernel, decode rows run
    it, greedy output agrees with PyTorch's int8 kernel up to bf16 ties, and with the few-query attention kernel on,
    every row of a verify tree computes what a one-row decode computes, so NGRAM's greedy output over the int8 target
    equals plain decoding's token for token. (Layers run their modules here, the linears' calls recorded; on AVX2 a
    fused layer calls the kernel from C++, with the modules' bits: test_fused_layer.py.)"""
    path = model_factory("llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    monkeypatch.setenv(fused_layer.ENV, "off")
    calls = record_rows(monkeypatch, int8_gemm, "int8_mm")
    prompts = REPEATING_PROMPTS + PROMPTS[:2]
    plain = {}
    for mode in ("on", "off"):
        monkeypatch.setenv(int8_gemm.ENV, mode)
        with Engine(model_path=path, max_total_tokens=2048, torchao_config="int8wo") as e:
            info = e.get_server_info()
            linears = info.get("cpu_int8_gemm_linears", 0)
            plain[mode] = e.generate(prompts, greedy(24), return_logprob=True, top_logprobs_num=2)
        assert (linears > 0) is (mode == "on")
        if mode == "on":  # the operators' implementations in use are reported
            assert info["cpu_ops_in_cpp"] is native.native_ops()
    assert_greedy_equal_up_to_ties([o["output_ids"] for o in plain["on"]], plain["off"])
    assert len(prompts) in calls  # the batch's decode steps
    if not tree_attention.available():  # then verify rows attend in another order than decode rows
        return
    monkeypatch.setenv(int8_gemm.ENV, "on")
    monkeypatch.setenv(tree_attention.ENV, "on")
    monkeypatch.setenv(small_gemm.ENV, "on")
    monkeypatch.setenv(small_gemm.AMX_ENV, "all")  # where AMX runs: decode rows and tree rows on the same path
    monkeypatch.setenv(int8_gemm.AMX_ENV, "all")
    calls.clear()
    assert_ngram_equals_plain(prompts, model_path=path, max_total_tokens=2048, torchao_config="int8wo")
    assert max(calls) > 1  # verify trees ran on the int8 weights


@needs_kernel
def test_speculation_over_an_int8_target_is_lossless(model_factory, monkeypatch):
    """Wherever the int8 kernel runs (the AVX2 one included, with PyTorch's attention): an int8 bf16 target whose
    decode and verify rows both run on the kernel; a STANDALONE draft (the same model, unquantized) gives greedy
    output equal to plain decoding's, with drafts accepted. A one-layer model with unit embeddings keeps its logits
    apart by more than bf16's rounding, so attention's summation order cannot flip a token."""
    path = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, dtype=torch.bfloat16)
    calls = record_rows(monkeypatch, int8_gemm, "int8_mm")
    with Engine(model_path=path, max_total_tokens=4096, torchao_config="int8wo") as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
    calls.clear()
    with Engine(model_path=path, max_total_tokens=4096, torchao_config="int8wo",
                **spec_kwargs("STANDALONE", path, 4, 3, 8)) as e:
        outs = e.generate(PROMPTS, greedy(24))
    assert [o["output_ids"] for o in outs] == plain
    assert_drafting_happened(outs, 1.5)
    assert any(1 < rows <= int8_gemm.SMALL_MAX_ROWS for rows in calls)  # verify trees ran on the int8 weights

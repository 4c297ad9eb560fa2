"""oneDNN-packed bf16 linears: same results as plain linears, same greedy output through the engine."""

from __future__ import annotations

import torch
from torch import nn

from specserve import Engine
from specserve.platform.cpu.packing import (
    FP32_MAX_ROWS,
    MixedLinear,
    PackedLinear,
    mix_linears_for_cpu,
    pack_linears_for_cpu,
)
from tests.engine.helpers import PROMPTS, greedy


def test_packed_linear_matches_plain_linear():
    """Decode-sized and prefill-sized calls alike (the packed layout is chosen for one row count)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    xs = [torch.randn(rows, 64, dtype=torch.bfloat16) for rows in (1, 5, 300)]
    wants = [model(x) for x in xs]
    assert pack_linears_for_cpu(model) == 2
    assert all(isinstance(m, PackedLinear) for m in model)
    for x, want in zip(xs, wants, strict=True):
        torch.testing.assert_close(model(x).float(), want.float(), atol=2e-2, rtol=2e-2)


def test_fp32_is_left_alone():
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears_for_cpu(model) == 0 and isinstance(model[0], nn.Linear)


def test_engine_greedy_same_with_and_without_packing(model_factory):
    path = model_factory("qwen2", dtype=torch.bfloat16)
    outs = []
    for disable in (False, True):
        with Engine(model_path=path, max_total_tokens=2048, disable_cpu_weight_packing=disable) as e:
            packed = sum(isinstance(m, PackedLinear) for m in e.scheduler.runner.model.modules())
            assert (packed > 0) != disable
            outs.append([o["output_ids"] for o in e.generate(PROMPTS[:4], greedy(16))])
    assert outs[0] == outs[1]


def test_packed_linear_under_torch_compile():
    """Compiled graphs call the packed kernel through the specserve::packed_linear custom op (inductor's own
    lowering rejects weights it did not pack itself): same result as the eager packed module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    pack_linears_for_cpu(model)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
        got = torch.compile(model)(x)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_mixed_linear_float32_for_few_rows_packed_bf16_for_many():
    """A float32 draft's linears: up to FP32_MAX_ROWS rows exactly F.linear in float32; more rows the packed bf16
    matmul (so bf16 rounding, float32 out), also compiled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 32, bias=False))
    plain = [nn.Linear(64, 96), nn.Linear(96, 32, bias=False)]
    for p, m in zip(plain, model, strict=True):
        p.load_state_dict(m.state_dict())
    assert mix_linears_for_cpu(model) == 2 and all(isinstance(m, MixedLinear) for m in model)
    assert mix_linears_for_cpu(nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))) == 0  # float32 only
    with torch.inference_mode():
        for rows in (1, FP32_MAX_ROWS, FP32_MAX_ROWS + 1, 32):
            x = torch.randn(rows, 64)
            want = plain[1](plain[0](x))
            got = model(x)
            assert got.dtype == torch.float32
            if rows <= FP32_MAX_ROWS:
                assert torch.equal(got, want)
            else:
                assert not torch.equal(got, want)  # bf16 rounding: the packed path ran
                torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
                torch.testing.assert_close(torch.compile(model)(x), got)

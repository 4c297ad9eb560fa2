"""The one-call element-wise operators of eager bf16 forwards on CPU (platform/cpu/elementwise.py): RMSNorm,
SiLU-and-multiply and RoPE against hand-computed values and against the eager composites the layers run otherwise,
row by row independence, where the policy installs them, and the lossless gate of a bf16 target that uses them."""

from __future__ import annotations

import math

import pytest
import torch

from specserve import Engine
from specserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from specserve.models.loader import load_model
from specserve.platform.cpu import elementwise as ew
from specserve.platform.cpu import native
from specserve.test.tiny import make_eagle3_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

BF16 = torch.bfloat16
needs_ops = pytest.mark.skipif(not ew.available(),
                               reason="neither AVX512-BF16 nor AVX2, or no C++ compiler or no PyTorch headers")


def bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(BF16)


def one_step_at_most(got: torch.Tensor, want: torch.Tensor) -> float:
    """got and want differ by at most one bf16 step (relative 2^-7) anywhere -> the share of values that differ."""
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2**-7 + 1e-30).all(), diff.max()
    return (got != want).float().mean().item()


@needs_ops
def test_the_operators_have_cpu_kernels():
    for name in ("rms_norm", "silu_mul", "rope"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specserve::{name}", "CPU")


@needs_ops
def test_hand_computed_values():
    # x = (3, 4): mean of squares 12.5 -> x / sqrt(12.5 + eps), rounded to bf16, times the weight (2, 0.5)
    inv = 1 / math.sqrt(12.5 + 1e-6)
    want = bf16([[3 * inv, 4 * inv]]) * bf16([2.0, 0.5])
    assert torch.equal(ew.rms_norm(bf16([[3.0, 4.0]]), bf16([2.0, 0.5]), 1e-6), want)
    # gate (0, 1), up (2, 3): silu(0) * 2 = 0, silu(1) * 3 = 3 / (1 + e^-1)
    got = ew.silu_mul(bf16([[0.0, 1.0, 2.0, 3.0]]))
    assert torch.equal(got, bf16([[0.0, 1.0 / (1 + math.exp(-1))]]).float().mul(3).to(BF16).view(1, 2))
    # x = (1, 2), cos = (c, c), sin = (-s, s): (1 c - 2 s, 2 c + 1 s), each product rounded to bf16 first
    c, s = 0.5, 0.25
    got = ew.rope(bf16([[[1.0, 2.0]]]), bf16([[[c, c]]]), bf16([[[-s, s]]]))
    assert torch.equal(got, bf16([[[1 * c - 2 * s, 2 * c + 1 * s]]]))


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 48])
def test_against_the_eager_composites(rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(BF16)
    w = (torch.rand(576, generator=gen) + 0.5).to(BF16)
    assert one_step_at_most(ew.rms_norm(x, w, 1e-5), ew.rms_norm_reference(x, w, 1e-5)) < 1e-3
    w32 = torch.rand(576, generator=gen) + 0.5  # a float32 draft's weight in a bf16 call: scaled in bf16
    assert one_step_at_most(ew.rms_norm(x, w32, 1e-5), ew.rms_norm_reference(x, w32, 1e-5)) < 1e-3
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(BF16)
    assert one_step_at_most(ew.silu_mul(gate_up), ew.silu_mul_reference(gate_up)) < 1e-3
    # q and k heads as the layers pass them: a strided view of the fused q/k/v output; cos / sin gathered rows
    qk = torch.randn(rows, 960, generator=gen).to(BF16)[:, :768].view(rows, 12, 64)
    table = torch.randn(100, 2, 64, generator=gen).to(BF16)
    cos, sin = table[torch.randint(0, 100, (rows,), generator=gen)].unsqueeze(1).unbind(2)
    out = ew.rope(qk, cos, sin)
    assert out.is_contiguous() and torch.equal(out, ew.rope_reference(qk, cos, sin))


@needs_ops
def test_sizes_off_the_vector_width_and_extreme_values():
    """Row lengths that leave a partial vector (40, 37 and a head of 80: halves of 40), leading dimensions kept;
    SiLU of large magnitudes (e^-g overflows or underflows) stays finite and one step from PyTorch's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 40, generator=gen).to(BF16)
    w = torch.randn(40, generator=gen).to(BF16)
    got = ew.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    one_step_at_most(got, ew.rms_norm_reference(x, w, 1e-6))
    gate_up = torch.randn(2, 3, 74, generator=gen).to(BF16)
    gate_up[0, 0, :6] = bf16([-200.0, -90.0, -50.0, 50.0, 90.0, 200.0])
    got = ew.silu_mul(gate_up)
    assert got.shape == (2, 3, 37) and torch.isfinite(got).all()
    one_step_at_most(got, ew.silu_mul_reference(gate_up))
    qk = torch.randn(4, 3, 80, generator=gen).to(BF16)
    cos, sin = torch.randn(4, 2, 80, generator=gen).to(BF16).unsqueeze(1).unbind(2)
    assert torch.equal(ew.rope(qk, cos, sin), ew.rope_reference(qk, cos, sin))


@needs_ops
def test_a_row_gets_the_same_bits_alone_and_among_others():
    """Rows are computed on their own: a verify tree's row equals the one-row decode of it."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 576, generator=gen).to(BF16)
    w = torch.randn(576, generator=gen).to(BF16)
    gate_up = torch.randn(40, 512, generator=gen).to(BF16)
    many, many_act = ew.rms_norm(x, w, 1e-5), ew.silu_mul(gate_up)
    for r in (0, 17, 39):
        assert torch.equal(ew.rms_norm(x[r:r + 1], w, 1e-5), many[r:r + 1])
        assert torch.equal(ew.silu_mul(gate_up[r:r + 1]), many_act[r:r + 1])


@needs_ops
def test_layers_use_them_only_in_eager_bf16_calls_without_autograd():
    norm = RMSNorm(64, 1e-6).to(BF16)
    x = torch.randn(3, 64).to(BF16)
    calls = []
    norm.fused = lambda *a: calls.append(a) or ew.rms_norm(*a)
    with torch.no_grad():
        norm(x)
        norm(x.half())  # float16: PyTorch's operators
    assert len(calls) == 1
    with torch.enable_grad():
        out = norm(x)  # training: autograd needs PyTorch's operators
    assert len(calls) == 1 and out.requires_grad


def test_the_policy_installs_them_on_exact_classes(model_factory, monkeypatch):
    from specserve.config import ServerArgs
    from specserve.platform import platform_policy

    path = model_factory("llama", num_hidden_layers=2, dtype=BF16)
    model, _, _ = load_model(path, "bfloat16")
    policy = platform_policy(ServerArgs(), torch.device("cpu"))
    policy.pack_weights(model)
    fused = [m for m in model.modules() if getattr(m, "fused", None) is not None]
    if not ew.available():
        assert fused == [] and "cpu_fused_elementwise_modules" not in policy.info()
        return
    # 2 layers x (2 norms + MLP) + the final norm + the shared rotary embedding
    assert len(fused) == policy.info()["cpu_fused_elementwise_modules"] == 2 * 3 + 2
    assert {type(m) for m in fused} == {RMSNorm, GatedMLP, RotaryEmbedding}
    monkeypatch.setenv(ew.ENV, "off")
    assert ew.available.__wrapped__() is False
    monkeypatch.setenv(ew.ENV, "fast")
    with pytest.raises(ValueError, match=ew.ENV):
        ew.available.__wrapped__()


@needs_ops
def test_a_bf16_target_using_them_is_lossless_under_eagle3(model_factory, tmp_path):
    """Greedy EAGLE-3 on a bf16 target whose norms, MLPs and RoPE run these operators (verify trees of several rows,
    decode rows of one) gives plain decoding's tokens, with drafts accepted."""
    target = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True, dtype=BF16)
    head = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self")
    with Engine(model_path=target, max_total_tokens=4096) as e:
        assert e.get_server_info()["cpu_fused_elementwise_modules"] > 0
        plain = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
    kw = spec_kwargs("EAGLE3", head, 4, 3, 8, speculative_draft_dtype="bfloat16")
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, 1.2)
        assert_no_kv_leak(e)


def test_native_ops_off_leaves_the_layers_alone(monkeypatch):
    monkeypatch.setattr(native, "native_ops", lambda: False)
    assert ew.available.__wrapped__() is False


@needs_ops
def test_race_noise_operator_is_the_samplers_and_within_float32_ulps_of_eager(monkeypatch):
    """The CPU policy installs the C++ operator as the seeded sampler's noise (no compile at the first sampled
    request): over a whole SmolLM2 vocabulary for 16 keys, within 2 float32 ulps of the eager chain; rows of their
    own ids get the same values as the vocabulary's."""
    from specserve.config import ServerArgs
    from specserve.platform import platform_policy
    from specserve.sampling import race

    monkeypatch.setattr(race, "_kernel", None)
    platform_policy(ServerArgs(), torch.device("cpu"))
    assert race._compiled() is ew.race_exponentials
    keys = race.race_keys(list(range(16)), list(range(16)), "cpu")
    k1, k2 = keys[:, :1].contiguous(), keys[:, 1:].contiguous()
    ids = torch.arange(49152, dtype=torch.int32).view(1, -1)
    got, want = ew.race_exponentials(k1, k2, ids), race._exponentials(k1, k2, ids)
    assert got.shape == (16, 49152) and got.dtype == torch.float32
    assert ((got - want).abs() <= want * 2.4e-7).all()
    some = torch.randint(0, 49152, (16, 37), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    assert torch.equal(ew.race_exponentials(k1, k2, some), got.gather(1, some.long()))


@needs_ops
def test_kv_store_writes_what_the_index_writes_write():
    """k / v as the layers pass them (views of the fused q/k/v output, token stride wider than a row), padding rows
    on slot 0 several times; the pool's store takes the operator for bf16 k / v and index writes for a float32 draft's
    k / v into a bf16 pool."""
    from specserve.cache.kv_pool import KVPool

    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 15 * 64, generator=gen).to(BF16)
    k, v = qkv[:, 9 * 64:12 * 64].view(5, 3, 64), qkv[:, 12 * 64:].view(5, 3, 64)
    slots = torch.tensor([7, 0, 3, 0, 12])
    pools = [(torch.randn(16, 3, 64, generator=gen).to(BF16), torch.randn(16, 3, 64, generator=gen).to(BF16))]
    pools.append((pools[0][0].clone(), pools[0][1].clone()))
    ew.kv_store(*pools[0], slots, k, v)
    ew.kv_store_reference(*pools[1], slots, k, v)
    keep = torch.tensor([i for i in range(16) if i != 0])  # slot 0: padding, last writer unspecified
    assert all(torch.equal(a[keep], b[keep]) for a, b in zip(pools[0], pools[1], strict=True))
    pool = KVPool(2, 15, 3, 64, BF16, "cpu", fused_store=ew.kv_store)
    calls = []
    pool.fused_store = lambda *a: calls.append(a) or ew.kv_store(*a)
    k_buf, v_buf = pool.store(1, slots, k, v)
    assert len(calls) == 1 and torch.equal(k_buf[7], k[0]) and torch.equal(v_buf[12], v[4])
    pool.store(0, slots, k.float(), v.float())  # another dtype: converted by the index writes
    assert len(calls) == 1 and torch.equal(pool.k[0][3], k[2])

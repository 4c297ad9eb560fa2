"""oneDNN-packed bf16 linears: same results as plain linears, same greedy output through the engine; where oneDNN
packs none, float32 copies for calls of several rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve import Engine
from specserve.platform.cpu import avx2_gemm, one_row_probe, packing, upcast_probe
from specserve.platform.cpu.packing import (
    FP32_MAX_ROWS,
    GEMV_MAX_ROWS,
    MixedLinear,
    PackedLinear,
    UpcastLinear,
    cpu_gemv,
    mix_linears_for_cpu,
    pack_linears_for_cpu,
    packable_bytes,
    padded_rows,
    upcast_linears_for_cpu,
)
from specserve.platform.cpu.policy import CpuPolicy
from tests.engine.helpers import PROMPTS, force_one_row_kernel, greedy, needs_onednn_bf16


@needs_onednn_bf16
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


@pytest.mark.parametrize("rows, want", [(1, 1), (16, 16), (17, 32), (32, 32), (250, 256), (256, 256),
                                        (257, 288), (1000, 1024), (1024, 1024), (1025, 1152), (5000, 5120)])
def test_padded_rows_by_hand(rows, want):
    assert padded_rows(rows) == want


def test_padded_rows_are_few_and_waste_little():
    """Prompts of 17-8192 tokens share 95 row counts; past 256 rows none is an eighth above the call's own."""
    counts = {padded_rows(m) for m in range(17, 8193)}
    assert len(counts) == 15 + 24 + 56  # multiples of 16 in 32-256, of 32 in 288-1024, of 128 in 1152-8192
    assert all(0 <= padded_rows(m) - m < 16 for m in range(17, 257))
    assert all(m <= padded_rows(m) < m * 1.125 for m in range(257, 8193))


@needs_onednn_bf16
def test_padded_calls_give_the_rows_of_the_unpadded_call(monkeypatch):
    """A call padded with zero rows returns the call's own rows: what the same kernel gives them unpadded."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(250, 64, dtype=torch.bfloat16)
    model = nn.Sequential(nn.Linear(64, 96, bias=True).to(torch.bfloat16))
    model[0].load_state_dict(lin.state_dict())
    assert pack_linears_for_cpu(model) == 1
    padded = model(x)  # 256 rows under the hood
    assert padded.shape == (250, 96) and padded.is_contiguous()
    monkeypatch.setattr(packing, "PAD_FROM", 10**9)
    exact = model(x)
    torch.testing.assert_close(padded.float(), exact.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(padded.float(), lin(x).float(), atol=2e-2, rtol=2e-2)


@needs_onednn_bf16
def test_one_row_calls_take_the_plain_weight_when_kept(monkeypatch):
    """keep_plain: a one-row call runs cpu_gemv on the plain weight (PyTorch's kernel, oneDNN off for the call
    only); larger calls the packed kernel; both agree with nn.Linear, eager and compiled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    ref = [nn.Linear(64, 96).to(torch.bfloat16), nn.Linear(96, 32, bias=False).to(torch.bfloat16)]
    ref[0].load_state_dict(model[0].state_dict())
    ref[1].load_state_dict(model[2].state_dict())
    assert pack_linears_for_cpu(model, keep_plain=True) == 2
    assert all(m.plain is not None for m in (model[0], model[2]))
    calls = []
    real = packing.cpu_gemv

    def spy(x, w, b):
        calls.append(x.shape[0])
        assert torch._C._get_mkldnn_enabled()  # switched off inside only
        return real(x, w, b)

    monkeypatch.setattr(packing, "cpu_gemv", spy)
    with torch.inference_mode():
        for rows in (1, GEMV_MAX_ROWS + 1, 9):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            want = ref[1](F.silu(ref[0](x)))
            torch.testing.assert_close(model(x).float(), want.float(), atol=2e-2, rtol=2e-2)
        assert calls == [1, 1]  # both linears of the one-row call, none of the larger ones
        assert torch._C._get_mkldnn_enabled()
        x = torch.randn(1, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(torch.compile(model)(x).float(), model(x).float(), atol=2e-2, rtol=2e-2)


def test_cpu_gemv_restores_onednn_after_an_error():
    with pytest.raises(RuntimeError):
        cpu_gemv(torch.randn(1, 3, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16), None)
    assert torch._C._get_mkldnn_enabled()


def test_plain_copies_are_counted_without_tied_weights(monkeypatch):
    """packable_bytes: what keep_plain adds; a head tied to an embedding adds nothing. The policy keeps the copy
    while it fits its share of the memory."""
    emb = nn.Embedding(100, 16).to(torch.bfloat16)
    head = nn.Linear(16, 100, bias=False).to(torch.bfloat16)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "proj": nn.Linear(16, 32).to(torch.bfloat16), "head": head,
                           "fp32": nn.Linear(16, 16)})
    assert packable_bytes(model) == 32 * 16 * 2
    monkeypatch.setattr("specserve.platform.cpu.policy.physical_ram_bytes", lambda: 8 * 32 * 16 * 2)
    assert CpuPolicy.keeps_plain_weights(model)
    monkeypatch.setattr("specserve.platform.cpu.policy.physical_ram_bytes", lambda: 8 * 32 * 16 * 2 - 8)
    assert not CpuPolicy.keeps_plain_weights(model)


def test_fp32_is_left_alone():
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears_for_cpu(model) == 0 and isinstance(model[0], nn.Linear)


@needs_onednn_bf16
def test_engine_greedy_same_with_and_without_packing(model_factory, monkeypatch):
    path = model_factory("qwen2", dtype=torch.bfloat16)
    force_one_row_kernel(monkeypatch, "gemv")
    outs = []
    for disable in (False, True):
        with Engine(model_path=path, max_total_tokens=2048, disable_cpu_weight_packing=disable) as e:
            packed = [m for m in e.scheduler.runner.model.modules() if isinstance(m, PackedLinear)]
            assert (len(packed) > 0) != disable
            assert all(m.plain is not None for m in packed)  # a small model keeps them: one-row calls use them
            outs.append([o["output_ids"] for o in e.generate(PROMPTS[:4], greedy(16))])
    assert outs[0] == outs[1]


@needs_onednn_bf16
def test_packed_one_row_kernel_keeps_no_plain_copies(model_factory, monkeypatch):
    """Where the packed kernel wins one-row calls (the probe's verdict, forced here), no plain copy is kept, the
    server info says which kernel runs, and greedy outputs equal unpacked decoding's."""
    path = model_factory("qwen2", dtype=torch.bfloat16)
    force_one_row_kernel(monkeypatch, "packed")
    calls = []
    monkeypatch.setattr(packing, "cpu_gemv", lambda *a: calls.append(a) or F.linear(*a))
    outs = []
    for disable in (False, True):
        with Engine(model_path=path, max_total_tokens=2048, disable_cpu_weight_packing=disable) as e:
            packed = [m for m in e.scheduler.runner.model.modules() if isinstance(m, PackedLinear)]
            assert (len(packed) > 0) != disable
            assert all(m.plain is None for m in packed)
            outs.append([e.generate(p, greedy(12))["output_ids"] for p in PROMPTS[:2]])  # batch 1: one-row calls
            if not disable:
                verdicts = e.get_server_info()["cpu_one_row_kernel"]
                assert verdicts == {"Qwen2ForCausalLM": {"kernel": "packed", "source": one_row_probe.ENV}}
    assert outs[0] == outs[1] and calls == []


@needs_onednn_bf16
def test_engine_probes_the_one_row_kernel(model_factory, monkeypatch):
    """With SPECSERVE_ONE_ROW_KERNEL=auto the engine times both kernels on its target's linears: the server info gives
    the verdict and the times, and the plain copies are kept exactly where the verdict is gemv."""
    force_one_row_kernel(monkeypatch, "auto")
    with Engine(model_path=model_factory("qwen2", dtype=torch.bfloat16), max_total_tokens=2048) as e:
        verdict = e.get_server_info()["cpu_one_row_kernel"]["Qwen2ForCausalLM"]
        packed = [m for m in e.scheduler.runner.model.modules() if isinstance(m, PackedLinear)]
        assert len(e.generate(PROMPTS[0], greedy(4))["output_ids"]) == 4
    assert verdict["source"] == "probe" and verdict["gemv_ms"] > 0 and verdict["packed_ms"] > 0
    assert packed and all((m.plain is not None) == (verdict["kernel"] == "gemv") for m in packed)


def test_pick_kernel_by_hand():
    """gemv only when its median pass is more than GEMV_MIN_GAIN faster (its plain copies cost memory)."""
    assert one_row_probe.pick_kernel([1.0, 9.0, 1.0], [2.0, 2.0, 0.5], min_gain=0.05) == "gemv"  # 1.0 < 0.95 * 2.0
    assert one_row_probe.pick_kernel([1.0, 1.0, 1.0], [1.02, 1.02, 1.02], min_gain=0.05) == "packed"  # within 5%
    assert one_row_probe.pick_kernel([3.0], [2.0], min_gain=0.0) == "packed"


def test_probed_linears_stop_at_the_byte_budget():
    lins = [SimpleNamespace(plain=torch.empty(10, 10, dtype=torch.bfloat16)) for _ in range(4)]  # 200 bytes each
    assert one_row_probe.probed_linears(lins, max_bytes=450) == lins[:2]
    assert one_row_probe.probed_linears(lins, max_bytes=10) == lins[:1]  # at least one
    assert one_row_probe.probed_linears(lins, max_bytes=10**6) == lins


@needs_onednn_bf16
def test_probe_times_both_kernels_on_the_models_linears(monkeypatch):
    """The probe runs one row through the linears with each kernel and picks by its own timings; the packed verdict
    drops the plain weights, gemv keeps them; SPECSERVE_ONE_ROW_KERNEL skips the probe; a bad value names it."""
    torch.manual_seed(0)

    def model():
        m = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256, bias=False)).to(torch.bfloat16)
        pack_linears_for_cpu(m, keep_plain=True)
        return list(m)

    lins = model()
    got = one_row_probe.probe(lins, reps=3)
    assert got["gemv_ms"] > 0 and got["packed_ms"] > 0
    # the verdict follows the medians, which the report rounds to 1 us: where they sit that close to the 5% margin,
    # the rounded figures cannot tell which side the verdict took
    margin = got["gemv_ms"] - 0.95 * got["packed_ms"]
    if abs(margin) > 1e-3:
        assert got["kernel"] == ("gemv" if margin < 0 else "packed")
    monkeypatch.setattr(one_row_probe, "probe", lambda *a, **k: pytest.fail("probed despite the variable"))
    for kernel in ("gemv", "packed"):
        force_one_row_kernel(monkeypatch, kernel)
        lins = model()
        assert one_row_probe.choose_one_row_kernel(lins) == {"kernel": kernel, "source": one_row_probe.ENV}
        assert all((m.plain is not None) == (kernel == "gemv") for m in lins)
    force_one_row_kernel(monkeypatch, "fastest")
    with pytest.raises(ValueError, match=one_row_probe.ENV):
        one_row_probe.choose_one_row_kernel(model())


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


@needs_onednn_bf16
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
            # a bf16 input (a forward run in half precision as a whole) takes the bf16 path even for one row
            low = model(x.to(torch.bfloat16))
            assert low.dtype == torch.bfloat16
            torch.testing.assert_close(low.float(), want, atol=5e-2, rtol=5e-2)


@needs_onednn_bf16
def test_engine_moves_its_weights_onto_huge_pages(model_factory, monkeypatch):
    """The engine moves the target's weights (and the plain copies the one-row kernel reads) into one mapping
    advised for huge pages and says how much in the server info; SPECSERVE_KEEP_WEIGHT_PAGES=1 leaves them on the
    heap. Greedy outputs are the same either way."""
    from specserve.platform.cpu.policy import KEEP_WEIGHT_PAGES_ENV
    from tests.unit.test_hugepages import vm_flags_at

    path = model_factory("qwen2", dtype=torch.bfloat16)
    force_one_row_kernel(monkeypatch, "gemv")
    outs = []
    for keep in ("1", "0"):
        monkeypatch.setenv(KEEP_WEIGHT_PAGES_ENV, keep)
        with Engine(model_path=path, max_total_tokens=2048) as e:
            model = e.scheduler.runner.model
            info = e.get_server_info()
            outs.append([e.generate(p, greedy(12))["output_ids"] for p in PROMPTS[:2]]
                        + [o["output_ids"] for o in e.generate(PROMPTS[2:6], greedy(12))])
            storages = {t.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, PackedLinear)
                        for t in (m.plain, m.bias) if t is not None}
            flags = vm_flags_at(model.model.embed_tokens.weight.data_ptr())
        if keep == "1":
            assert "cpu_weights_on_huge_pages_mib" not in info and len(storages) > 1
        else:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            assert info["cpu_weights_on_huge_pages_mib"] >= weights / 2**20 and len(storages) == 1 and "hg" in flags
    assert outs[0] == outs[1]


def test_upcast_linear_runs_several_rows_on_its_float32_copy():
    """An UpcastLinear (a CPU where oneDNN packs no half-precision weight): calls of min_rows rows or more are exactly
    F.linear in float32 over the upcast weight, rounded to bf16; fewer rows, or min_rows 0, exactly bf16 F.linear."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    up = UpcastLinear(lin, min_rows=4)
    w, b = lin.weight.detach(), lin.bias.detach()
    with torch.inference_mode():
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            half = F.linear(x, w, b)
            wide = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
            got = up(x)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, wide if rows >= 4 else half)
        x = torch.randn(2, 3, 64).to(torch.bfloat16)  # 6 rows in a 3-d input
        assert torch.equal(up(x), F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16))
        torch.testing.assert_close(torch.compile(up)(x), up(x))  # inside a compiled graph too
        up.min_rows = 0
        assert torch.equal(up(x), F.linear(x, w, b))
    assert "wide" not in up.state_dict()  # the copy is no checkpoint tensor


def _fake_times(float32_wins_from: int | None):
    """interleaved_times' stand-in: the float32 pass takes half the bf16 pass's time from that row count up (None:
    never), double below it."""
    def times(passes, reps):
        rows = next(iter(passes["half"].__defaults__[0].values())).shape[0]
        fast = float32_wins_from is not None and rows >= float32_wins_from
        return {"half": [1.0] * reps, "float32": [0.5 if fast else 2.0] * reps}
    return times


@pytest.mark.parametrize("wins_from, want", [(4, 4), (2, 2), (None, 0)])
def test_upcast_probe_takes_the_copy_from_where_it_wins(monkeypatch, wins_from, want):
    """The probe's verdict: the fewest probed rows from which the float32 copy won at every larger count; where it
    won nowhere, no linear keeps its copy and every call reads the half-precision weight."""
    monkeypatch.setenv(upcast_probe.ENV, "auto")
    monkeypatch.setattr(upcast_probe, "interleaved_times", _fake_times(wins_from))
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    assert upcast_linears_for_cpu(model) == 2
    verdict = upcast_probe.choose_upcast_rows(list(model))
    assert verdict["min_rows"] == want and verdict["source"] == "probe"
    assert sorted(verdict["half_float32_ms"]) == list(upcast_probe.PROBE_ROWS)
    assert all(m.min_rows == want and (m.wide is None) == (want == 0) for m in model)


def test_policy_upcasts_where_onednn_packs_nothing(model_factory, monkeypatch):
    """On a CPU whose oneDNN cannot pack bf16 weights (simulated), with specserve's AVX2 kernel off, the engine's bf16
    linears get float32 copies for calls of several rows; the server info gives the verdict, and greedy decoding
    runs."""
    monkeypatch.setattr(packing, "_pack", lambda *a, **k: None)
    monkeypatch.setenv(avx2_gemm.ENV, "off")
    monkeypatch.setenv(upcast_probe.ENV, "on")
    with Engine(model_path=model_factory("qwen2", dtype=torch.bfloat16), max_total_tokens=2048) as e:
        model = e.scheduler.runner.model
        ups = [m for m in model.modules() if isinstance(m, UpcastLinear)]
        assert ups and not any(isinstance(m, PackedLinear) for m in model.modules())
        assert all(m.min_rows == packing.UPCAST_MIN_ROWS for m in ups)
        assert e.get_server_info()["cpu_upcast_linears"]["Qwen2ForCausalLM"]["source"] == upcast_probe.ENV
        assert len(e.generate(PROMPTS[:3], greedy(6))[0]["output_ids"]) == 6
    monkeypatch.setenv(upcast_probe.ENV, "off")
    with Engine(model_path=model_factory("qwen2", dtype=torch.bfloat16), max_total_tokens=2048) as e:
        assert not any(isinstance(m, UpcastLinear) for m in e.scheduler.runner.model.modules())
        assert "cpu_upcast_linears" not in e.get_server_info()

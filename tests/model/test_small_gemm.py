"""specserve's few-row bf16 kernel (platform/cpu/small_gemm.py): its layout, its results against float32 matmuls,
where PackedLinear sends calls to it, compiled graphs, the load-time probe and the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve import Engine
from specserve.platform.cpu import native, small_gemm
from specserve.platform.cpu.packing import MixedLinear, PackedLinear, mix_linears_for_cpu, pack_linears_for_cpu
from tests.engine.helpers import PROMPTS, greedy, record_rows

needs_kernel = pytest.mark.skipif(small_gemm.kernel() is None, reason="no AVX512-BF16 or no C++ compiler here")


def test_cpu_supports_reads_the_flags():
    line = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl"
    assert not native.cpu_supports(f"processor: 0\n{line}\n")
    assert native.cpu_supports(f"processor: 0\n{line} avx512_bf16 amx_tile\n")
    assert not native.cpu_supports("processor: 0\n")


def test_kernel_wins_by_hand():
    """5% faster to take a row count; at one row, where decoder layers run as one operator call, up to 25% slower."""
    assert small_gemm.kernel_wins(4, 0.94, 1.0) and not small_gemm.kernel_wins(4, 0.96, 1.0)
    assert not small_gemm.kernel_wins(1, 0.96, 1.0) and small_gemm.kernel_wins(1, 0.96, 1.0, whole_layers=True)
    assert small_gemm.kernel_wins(1, 1.25, 1.0, whole_layers=True)
    assert not small_gemm.kernel_wins(1, 1.3, 1.0, whole_layers=True)
    assert not small_gemm.kernel_wins(4, 0.96, 1.0, whole_layers=True)  # the slack is one row's only


def test_winning_rows_by_hand():
    assert small_gemm.winning_rows({1: True, 4: True, 8: False, 16: True}) == (1, 4)
    assert small_gemm.winning_rows({16: True, 1: True, 8: True, 4: True}) == (1, 16)
    assert small_gemm.winning_rows({1: False, 4: True, 8: True, 16: False}) == (2, 8)  # one row keeps its kernel
    assert small_gemm.winning_rows({1: False, 4: False, 8: True}) == (0, 0)
    assert small_gemm.winning_rows({1: True, 4: False}) == (1, 1)


def test_packed_layout_by_hand():
    """[N, K] -> [N / 64, K / 2, 64, 2]: entry (g, j, c, t) is w[64 g + c, 2 j + t]."""
    w = torch.arange(128 * 6, dtype=torch.float32).view(128, 6).to(torch.bfloat16)  # exact integers
    p = small_gemm.pack(w)
    assert p.shape == (2, 3, 64, 2) and p.is_contiguous()
    assert p[1, 2, 5, 1] == w[64 + 5, 2 * 2 + 1] and p[0, 1, 63, 0] == w[63, 2]
    assert small_gemm.packable(w) and not small_gemm.packable(w[:, :5]) and not small_gemm.packable(w[:96])
    assert not small_gemm.packable(w.float())


def _benchmark(name: str):
    """The module benchmarks/<name>.py (the benchmarks build kernel variants the tests compare)."""
    import importlib
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(benchmarks)


@needs_kernel
def test_prefetch_distance_changes_no_bit():
    """Both few-row kernels built without software prefetch (``-DSPECSERVE_PREFETCH_BYTES=0``, as
    benchmarks/bench_prefetch.py builds them) give the default build's exact bits at 1-5 rows."""
    build = _benchmark("bench_prefetch").build
    from specserve.models.quantize import quantize_int8
    from specserve.platform.cpu import int8_gemm

    torch.manual_seed(0)
    w = torch.randn(256, 576, dtype=torch.bfloat16)  # several 4 KiB prefetch distances per column group
    packed, copy = small_gemm.pack(w), int8_gemm.Int8Copy(*quantize_int8(w.float()), None)
    none_bf16, none_int8 = build("bf16", 0), build("int8", 0)
    for rows in range(1, 6):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        y_bf16, y_int8 = torch.empty(rows, 256, dtype=torch.bfloat16), torch.empty(rows, 256, dtype=torch.bfloat16)
        none_bf16(x.data_ptr(), rows, 576, 576, packed.data_ptr(), 256, None, y_bf16.data_ptr(), 256, 2, 0)
        none_int8(x.data_ptr(), rows, 576, 576, copy.packed.data_ptr(), 256, copy.scales.data_ptr(), None,
                  y_int8.data_ptr(), 256, 2)
        assert torch.equal(y_bf16, small_gemm.small_mm(x, packed, None))
        assert torch.equal(y_int8, int8_gemm.int8_mm(x, copy.packed, copy.scales, None))


def test_prefetch_loses_by_hand():
    """Prefetch goes off when the median round's off / on ratio is PREFETCH_MIN_GAIN (3%) below 1, not for less, and
    rounds pair up in order (one slow round does not decide)."""
    assert small_gemm.prefetch_loses([1.0, 1.0, 1.0], [0.96, 0.96, 0.96])
    assert not small_gemm.prefetch_loses([1.0, 1.0, 1.0], [0.98, 0.98, 0.98])
    assert small_gemm.prefetch_loses([1.0, 2.0, 1.0], [0.9, 1.0, 1.5])  # ratios 0.9, 0.5, 1.5: median 0.9
    assert not small_gemm.prefetch_loses([2.0, 1.0, 1.0], [1.0, 1.5, 1.2])  # 0.5, 1.5, 1.2: median 1.2


@pytest.fixture
def default_prefetch():
    """Puts the kernel's prefetch distance (a process-wide setting) at its default, and forgets any probe's verdict,
    before and after the test."""
    small_gemm._prefetch_probed.clear()
    if small_gemm.kernel() is not None:
        small_gemm.set_prefetch(small_gemm.PREFETCH_BYTES)
    yield
    small_gemm._prefetch_probed.clear()
    small_gemm.set_prefetch(small_gemm.PREFETCH_BYTES)


@needs_kernel
def test_prefetch_set_at_run_time_changes_no_bit(default_prefetch):
    """set_prefetch reaches both copies of the kernel (the ctypes library's and the operators'), and a call's bits do
    not depend on it (1-16 rows, through the operator and through ctypes, with a bias)."""
    ops_distance = native.ops_function("small_gemm_prefetch", (), restype=small_gemm.ctypes.c_int64)
    assert small_gemm.prefetch_distance() == small_gemm.PREFETCH_BYTES
    torch.manual_seed(0)
    w, bias = torch.randn(256, 576, dtype=torch.bfloat16), torch.randn(256)
    packed = small_gemm.pack(w)
    for rows in range(1, 17):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        outs = []
        for nbytes in (small_gemm.PREFETCH_BYTES, 0, 1024):
            small_gemm.set_prefetch(nbytes)
            assert small_gemm.prefetch_distance() == nbytes
            assert ops_distance is None or ops_distance() == nbytes
            outs += [small_gemm.small_mm(x, packed, bias), small_gemm._small_mm(x, packed, bias)]
        assert all(torch.equal(outs[0], y) for y in outs[1:])


@needs_kernel
def test_prefetch_choice_forced_timed_or_left(monkeypatch, default_prefetch):
    """SPECSERVE_SMALL_GEMM_PREFETCH on / off sets the distance without timing; auto times one-row passes both ways
    over linears holding PREFETCH_PROBE_MIN_BYTES (leaving smaller ones' distance as it is, and timing nothing where
    SPECSERVE_SMALL_GEMM=on); anything else is refused naming the variable."""
    model = _two_linears()
    pack_linears_for_cpu(model, keep_small=True)
    linears = [model[0], model[2]]
    for forced, nbytes in (("off", 0), ("on", small_gemm.PREFETCH_BYTES)):
        monkeypatch.setenv(small_gemm.PREFETCH_ENV, forced)
        assert small_gemm.choose_prefetch(linears) == {"bytes": nbytes, "source": small_gemm.PREFETCH_ENV}
        assert small_gemm.prefetch_distance() == nbytes
    monkeypatch.setenv(small_gemm.PREFETCH_ENV, "auto")
    small_gemm.set_prefetch(1024)
    assert small_gemm.choose_prefetch(linears) is None and small_gemm.prefetch_distance() == 1024  # 24 KiB of weights
    monkeypatch.setattr(small_gemm, "PREFETCH_PROBE_MIN_BYTES", 0)
    verdict = small_gemm.choose_prefetch(linears)
    assert verdict["source"] == "probe" and verdict["bytes"] in (0, small_gemm.PREFETCH_BYTES)
    assert small_gemm.prefetch_distance() == verdict["bytes"] and all(ms > 0 for ms in verdict["on_off_ms"])
    small_gemm.set_prefetch(1024)  # a second model: the first verdict stands, untimed
    from specserve.platform.cpu import one_row_probe

    monkeypatch.setattr(one_row_probe, "interleaved_times", None)  # timing anything now would fail
    assert small_gemm.choose_prefetch([model[2]]) is verdict and small_gemm.prefetch_distance() == verdict["bytes"]
    small_gemm._prefetch_probed.clear()
    monkeypatch.setenv(small_gemm.ENV, "on")
    small_gemm.set_prefetch(1024)
    assert small_gemm.choose_prefetch(linears) is None and small_gemm.prefetch_distance() == 1024
    monkeypatch.setenv(small_gemm.PREFETCH_ENV, "sometimes")
    with pytest.raises(ValueError, match=small_gemm.PREFETCH_ENV):
        small_gemm.choose_prefetch(linears)


@needs_kernel
def test_pass_sizes_change_no_bit():
    """Both few-row kernels built with passes of at most 4 rows (``-DSPECSERVE_SMALL_GEMM_PASS_ROWS=4`` and
    ``-DSPECSERVE_INT8_GEMM_PASS_ROWS=4``, as benchmarks/bench_small_gemm_passes.py builds them) give the default
    builds' (6) exact bits at 1-16 rows, with a bias and a strided input: which pass takes a row does not change its
    sums (the int8 kernel's lone last row, on its float32 path, included)."""
    from specserve.models.quantize import quantize_int8
    from specserve.platform.cpu import int8_gemm

    build = _benchmark("bench_small_gemm_passes").build
    torch.manual_seed(2)
    w = torch.randn(192, 96, dtype=torch.bfloat16)
    bias = torch.randn(192)
    packed, copy = small_gemm.pack(w), int8_gemm.Int8Copy(*quantize_int8(w.float()), None)
    bf16_four, int8_four = build(4), build(4, "int8")
    for rows in range(1, small_gemm.SMALL_MAX_ROWS + 1):
        wide = torch.randn(rows, 128, dtype=torch.bfloat16)
        x = wide[:, :96]  # row stride 128
        y_bf16, y_int8 = torch.empty(rows, 192, dtype=torch.bfloat16), torch.empty(rows, 192, dtype=torch.bfloat16)
        bf16_four(x.data_ptr(), rows, 96, 128, packed.data_ptr(), 192, bias.data_ptr(), y_bf16.data_ptr(), 192, 2, 0)
        int8_four(x.data_ptr(), rows, 96, 128, copy.packed.data_ptr(), 192, copy.scales.data_ptr(), bias.data_ptr(),
                  y_int8.data_ptr(), 192, 2, 0)
        assert torch.equal(y_bf16, small_gemm.small_mm(x, packed, bias, 0)), rows
        assert torch.equal(y_int8, int8_gemm.int8_mm(x, copy.packed, copy.scales, bias, 0)), rows


needs_amx = pytest.mark.skipif(not small_gemm.amx_runs(), reason="no AMX here (or Linux refused its tile state)")


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("amx_from", [0, 1])
def test_kernel_matches_a_float32_matmul(bias, amx_from):
    """1-16 rows (every row-tile remainder), a strided input, with and without bias, on the vector loop and (where it
    runs) the tile unit: within bf16 rounding of the float32 result of the same bf16 numbers."""
    torch.manual_seed(0)
    w = torch.randn(192, 96, dtype=torch.bfloat16)
    b = torch.randn(192) if bias else None
    packed = small_gemm.pack(w)
    for rows in range(1, small_gemm.SMALL_MAX_ROWS + 1):
        wide = torch.randn(rows, 128, dtype=torch.bfloat16)
        x = wide[:, 16:112]  # a row stride of 128
        got = small_gemm.small_mm(x, packed, b, amx_from)
        want = F.linear(x.float(), w.float(), b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("amx_from", [0, 1])
def test_a_row_gets_the_same_bits_in_any_call(amx_from):
    """Each row's sums run in the same order whatever the call's row count, on either path, so a token's linear
    outputs in a verify tree equal those of a one-row decode call bit for bit where both take the same path."""
    torch.manual_seed(1)
    w = torch.randn(256, 64, dtype=torch.bfloat16)
    packed = small_gemm.pack(w)
    x = torch.randn(13, 64, dtype=torch.bfloat16)
    together = small_gemm.small_mm(x, packed, None, amx_from)
    for i in range(13):
        assert torch.equal(small_gemm.small_mm(x[i : i + 1], packed, None, amx_from)[0], together[i])


@needs_amx
def test_the_tile_unit_takes_up_to_amx_max_rows_in_blocks_of_16():
    """17-64 rows (full blocks of 16 and a zero-padded remainder, or full blocks only), bias and a strided input:
    within bf16 rounding of float32, and every row with the bits it gets alone (the padding changes no row)."""
    torch.manual_seed(3)
    w = torch.randn(192, 96, dtype=torch.bfloat16)
    b = torch.randn(192)
    packed = small_gemm.pack(w)
    for rows in (17, 23, 32, 47, small_gemm.AMX_MAX_ROWS):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)[:, 16:112]
        got = small_gemm.small_mm(x, packed, b, 1)
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b), atol=5e-2, rtol=1e-2)
        for i in range(rows):
            assert torch.equal(small_gemm.small_mm(x[i : i + 1], packed, b, 1)[0], got[i])


@needs_amx
def test_the_tile_unit_takes_the_calls_from_amx_from_rows():
    """amx_from = 5: calls of 1-4 rows give the vector loop's bits, 5-16 the tile unit's (which differ from the
    vector loop's somewhere in a large enough product, so the path taken shows); K not a multiple of 32 keeps the
    vector loop."""
    torch.manual_seed(2)
    w = torch.randn(1024, 576, dtype=torch.bfloat16)
    packed = small_gemm.pack(w)
    for rows in (1, 4, 5, 16):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        vector, tile = small_gemm.small_mm(x, packed, None, 0), small_gemm.small_mm(x, packed, None, 1)
        assert not torch.equal(vector, tile)  # a few outputs in 10,000 round the other way
        assert torch.equal(small_gemm.small_mm(x, packed, None, 5), tile if rows >= 5 else vector)
    w = torch.randn(1024, 592, dtype=torch.bfloat16)  # K = 592: not a multiple of 32
    x = torch.randn(8, 592, dtype=torch.bfloat16)
    packed = small_gemm.pack(w)
    assert torch.equal(small_gemm.small_mm(x, packed, None, 1), small_gemm.small_mm(x, packed, None, 0))


def test_amx_start_by_hand():
    assert small_gemm.amx_start({1: False, 4: False, 8: True, 16: True}) == 8
    assert small_gemm.amx_start({16: True, 1: True, 8: True, 4: True}) == 1
    assert small_gemm.amx_start({1: True, 4: False, 8: True, 16: True}) == 8  # won from 8 on at every count
    assert small_gemm.amx_start({1: False, 4: True, 8: True, 16: False}) == 0  # lost at the largest


def _two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=True), nn.SiLU(), nn.Linear(128, 64, bias=False)).to(torch.bfloat16)


@needs_kernel
def test_packed_linear_sends_calls_up_to_its_rows_to_the_kernel(monkeypatch):
    """The row counts the copy takes (min_rows to max_rows): the kernel; other calls: the packed oneDNN kernel (or
    gemv); both agree with nn.Linear, eager and compiled (the specserve::small_gemm op)."""
    model = _two_linears()
    ref = _two_linears()
    assert pack_linears_for_cpu(model, keep_small=True) == 2
    for m in (model[0], model[2]):
        assert m.small is not None and m.small.max_rows == 0  # until the policy sets it
        m.small.max_rows = 8
    calls = record_rows(monkeypatch, small_gemm, "small_mm")
    with torch.inference_mode():
        for rows in (1, 8, 9):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            torch.testing.assert_close(model(x).float(), ref(x).float(), atol=3e-2, rtol=3e-2)
        assert calls == [1, 1, 8, 8]
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        assert torch.equal(torch.compile(model)(x), model(x))  # the same kernel inside the graph
        calls.clear()
        for m in (model[0], model[2]):
            m.small.min_rows = 2  # one-row calls keep their own kernel (the probe's verdict where it lost there)
        model(torch.randn(1, 64, dtype=torch.bfloat16))
        model(torch.randn(2, 64, dtype=torch.bfloat16))
        assert calls == [2, 2]


@needs_kernel
def test_a_float32_drafts_bf16_path_takes_the_kernel_for_few_rows(monkeypatch):
    """MixedLinear (a float32 draft's linear): its bf16 path runs the kernel up to the copy's max_rows rows (float32
    in and out, bf16 rounding), the packed kernel above; the float32 path is untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128))
    ref = nn.Linear(64, 128)
    ref.load_state_dict(model[0].state_dict())
    assert mix_linears_for_cpu(model, keep_small=True) == 1
    mixed = model[0]
    assert isinstance(mixed, MixedLinear) and mixed.small is not None
    mixed.small.max_rows = 4
    calls = record_rows(monkeypatch, small_gemm, "small_mm")
    with torch.inference_mode():
        for rows in (3, 5):
            x = torch.randn(rows, 64)
            got = mixed.bf16(x)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, ref(x), atol=3e-2, rtol=3e-2)
        assert torch.equal(mixed.fp32(x), ref(x))
    assert calls == [3]


@needs_kernel
def test_the_probe_times_both_kernels_and_sets_the_rows(monkeypatch):
    """auto: every probed row count timed against the kernel it would use otherwise (and, where AMX runs, the tile
    unit against the vector loop); the linears take the kernel up to the verdict's rows, the tile unit from its
    amx_from, and give up their plain copies where it won at one row. on: all rows, no timing."""
    model = _two_linears()
    pack_linears_for_cpu(model, keep_plain=True, keep_small=True)
    linears = [model[0], model[2]]
    monkeypatch.setenv(small_gemm.ENV, "auto")
    verdict = small_gemm.choose_small_rows(linears)
    amx = small_gemm.amx_runs()
    probed = set(small_gemm.PROBE_ROWS) | (set(small_gemm.AMX_PROBE_ROWS) if verdict["amx_from"] else set())
    assert verdict["source"] == "probe" and set(verdict["small_other_ms"]) == probed
    assert all(s > 0 and o > 0 for s, o in verdict["small_other_ms"].values())
    assert verdict["max_rows"] <= (small_gemm.AMX_MAX_ROWS if verdict["amx_from"] else small_gemm.SMALL_MAX_ROWS)
    assert ("vector_tile_ms" in verdict) == amx and (amx or verdict["amx_from"] == 0)
    if amx:
        assert verdict["amx_from"] in (0, *small_gemm.PROBE_ROWS)
        assert set(verdict["vector_tile_ms"]) == set(small_gemm.PROBE_ROWS)
        assert all(v > 0 and t > 0 for v, t in verdict["vector_tile_ms"].values())
    for m in linears:
        assert (m.small is None) == (verdict["max_rows"] == 0)
        assert m.small is None or (m.small.min_rows, m.small.max_rows, m.small.amx_from) == (
            verdict["min_rows"], verdict["max_rows"], verdict["amx_from"])
        assert (m.plain is None) == (verdict["max_rows"] > 0 and verdict["min_rows"] == 1)
    monkeypatch.setenv(small_gemm.ENV, "on")
    for amx_mode, want in (("auto", small_gemm.AMX_UNTIMED_FROM if amx else 0), ("all", 1 if amx else 0),
                           ("off", 0)):
        monkeypatch.setenv(small_gemm.AMX_ENV, amx_mode)
        model = _two_linears()
        pack_linears_for_cpu(model, keep_plain=True, keep_small=True)
        assert small_gemm.choose_small_rows([model[0]]) == {"min_rows": 1, "max_rows": small_gemm.SMALL_MAX_ROWS,
                                                            "amx_from": want, "source": small_gemm.ENV}
        assert model[0].plain is None and model[0].small.max_rows == small_gemm.SMALL_MAX_ROWS
        assert model[0].small.amx_from == want
    monkeypatch.setenv(small_gemm.AMX_ENV, "sometimes")
    with pytest.raises(ValueError, match=small_gemm.AMX_ENV):
        small_gemm.choose_small_rows([model[0]])


@needs_kernel
def test_engine_runs_the_kernel_when_on(model_factory, monkeypatch):
    """A bf16 engine with SPECSERVE_SMALL_GEMM=on: its linears hold the kernel's layout, the server info gives the
    verdict, decode calls run the kernel, and greedy outputs agree with the kernel off (a small random model's logits
    are far apart next to bf16 rounding)."""
    path = model_factory("qwen2", dtype=torch.bfloat16)
    calls = record_rows(monkeypatch, small_gemm, "small_mm")
    outs = []
    for mode in ("on", "off"):
        monkeypatch.setenv(small_gemm.ENV, mode)
        with Engine(model_path=path, max_total_tokens=2048) as e:
            packed = [m for m in e.scheduler.runner.model.modules() if isinstance(m, PackedLinear)]
            info = e.get_server_info().get("cpu_small_gemm")
            outs.append([e.generate(p, greedy(12))["output_ids"] for p in PROMPTS[:2]])
        if mode == "on":
            assert info == {"Qwen2ForCausalLM": {
                "min_rows": 1, "max_rows": small_gemm.SMALL_MAX_ROWS, "source": small_gemm.ENV,
                "amx_from": small_gemm.AMX_UNTIMED_FROM if small_gemm.amx_runs() else 0}}
            assert packed and all(m.small is not None for m in packed if m.out_features % small_gemm.COLS == 0)
            assert 1 in calls  # batch-1 decode rows
        else:
            assert info is None and all(m.small is None for m in packed)
    assert outs[0] == outs[1]


@needs_kernel
def test_engine_sets_the_kernels_prefetch(model_factory, monkeypatch, default_prefetch):
    """SPECSERVE_SMALL_GEMM_PREFETCH reaches an engine's kernel at load and its server info; greedy outputs are the
    same either way."""
    path = model_factory("qwen2", dtype=torch.bfloat16)
    monkeypatch.setenv(small_gemm.ENV, "on")
    outs = []
    for forced, nbytes in (("off", 0), ("on", small_gemm.PREFETCH_BYTES)):
        monkeypatch.setenv(small_gemm.PREFETCH_ENV, forced)
        with Engine(model_path=path, max_total_tokens=2048) as e:
            info = e.get_server_info()["cpu_small_gemm"]["Qwen2ForCausalLM"]
            assert info["prefetch"] == {"bytes": nbytes, "source": small_gemm.PREFETCH_ENV}
            assert small_gemm.prefetch_distance() == nbytes
            outs.append([e.generate(p, greedy(12))["output_ids"] for p in PROMPTS[:2]])
    assert outs[0] == outs[1]

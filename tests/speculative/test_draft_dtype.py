"""``--speculative-draft-dtype``: a separate draft model may run in another dtype than the target (auto: the
target's). The draft only proposes, so greedy output stays plain decoding's: the lossless gate with its vacuity
guard for each kind of draft, both ways round (a float32 draft under a bf16 target on CPU with its mixed linears),
and the auto rule."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.config import ServerArgs
from specserve.models.loader import count_parameters, load_model
from specserve.platform import platform_policy
from specserve.platform.cpu.packing import MixedLinear, PackedLinear
from specserve.speculative.heads.eagle3 import Eagle3Head
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy, needs_onednn_bf16
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("target,device,params,want", [
    (BF16, "cpu", 2_000_000, BF16),  # on CPU a small draft too: its forwards take the bf16 kernels
    (F16, "cpu", 20_000_000, F16),
    (BF16, "cuda", 1000, BF16),
    (F32, "cpu", 1000, F32),
])
def test_auto_draft_dtype(target, device, params, want):
    assert platform_policy(ServerArgs(), torch.device(device)).draft_dtype(target, params) == want


@pytest.mark.parametrize("draft,target,device,packing,mixed", [
    (F32, BF16, "cpu", True, True),  # a float32 draft under a half-precision target on CPU
    (F32, F16, "cpu", True, True),
    (F32, BF16, "cpu", False, False),  # --disable-cpu-weight-packing: no packed copies
    (F32, F32, "cpu", True, False),
    (BF16, BF16, "cpu", True, False),
    (F32, BF16, "cuda", True, False),
])
def test_mixed_linears_and_the_draft_kv_dtype(draft, target, device, packing, mixed):
    """Where a draft gets MixedLinears its KV is bf16 (the dtype of its large calls); elsewhere the draft's own."""
    policy = platform_policy(ServerArgs(disable_cpu_weight_packing=not packing), torch.device(device))
    assert policy.mixed_linears(draft, target) is mixed
    assert policy.draft_kv_dtype(draft, target) == (BF16 if mixed else draft)


@pytest.mark.parametrize("tied", [True, False])
def test_count_parameters_matches_the_loaded_model(model_factory, tmp_path, tied):
    path = model_factory("llama", tie_word_embeddings=tied)
    model, _, _ = load_model(path)
    assert count_parameters(path) == sum(p.numel() for p in model.parameters())
    head_dir = make_eagle3_head_dir(str(tmp_path / "h3"), path, kind="random", draft_vocab=list(range(64)))
    head, _, _ = load_model(head_dir, registry={"LlamaForCausalLMEagle3": Eagle3Head})
    assert count_parameters(head_dir, registry={"LlamaForCausalLMEagle3": Eagle3Head}) == \
        sum(p.numel() for p in head.parameters())


def _gate(target: str, kw: dict, want_dtype: torch.dtype, min_accept_length: float, kv_dtype=None,
          **target_kw) -> None:
    """Greedy output with the draft in want_dtype (its KV in kv_dtype, default the same) == plain decoding's, drafts
    accepted, no KV leak."""
    with Engine(model_path=target, max_total_tokens=4096, **target_kw) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
    with Engine(model_path=target, max_total_tokens=4096, **target_kw, **kw) as e:
        proposer = e.scheduler.decoder.proposer
        assert proposer.draft_dtype == want_dtype
        assert {p.dtype for p in proposer.head.parameters()} == {want_dtype}
        assert proposer.kv_pool.dtype == (kv_dtype or want_dtype)
        assert e.get_server_info()["speculative_draft_dtype"] == str(want_dtype).removeprefix("torch.")
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length)
        assert_no_kv_leak(e)


@pytest.fixture(scope="module")
def bigram_target(model_factory):
    """The target an EAGLE-3 "self" head mirrors (make_eagle3_head_dir)."""
    return model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3", "STANDALONE"])
def test_bf16_draft_under_a_float32_target_is_lossless(target, self_head, bigram_target, tmp_path, algo):
    if algo == "EAGLE3":
        target = bigram_target
        draft = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self")
    else:
        draft = self_head if algo == "EAGLE" else target  # STANDALONE: the target drafts for itself
    kw = spec_kwargs(algo, draft, 4, 3, 8, speculative_draft_dtype="bfloat16")
    _gate(target, kw, BF16, min_accept_length=1.2)


@needs_onednn_bf16
def test_float32_draft_under_a_bf16_target_is_lossless(model_factory, tmp_path):
    """bf16 target on CPU, a float32 draft: the EAGLE head and its FR-Spec hot head (a float32 copy of the target's
    LM head rows, a MixedLinear like the head's linears) run in float32, the head's KV in bf16; the target's own LM
    head stays packed bf16."""
    from specserve.speculative.token_map import save_token_map

    path = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, dtype=BF16)
    head = make_eagle_head_dir(str(tmp_path / "head"), path, kind="self")
    save_token_map(torch.arange(64), str(tmp_path / "map.pt"))
    kw = spec_kwargs("EAGLE", head, 4, 3, 8, speculative_token_map=str(tmp_path / "map.pt"),
                     speculative_draft_dtype="float32")
    _gate(path, kw, F32, min_accept_length=1.2, kv_dtype=BF16)
    with Engine(model_path=path, max_total_tokens=4096, **kw) as e:
        assert isinstance(e.scheduler.runner.model.lm_head, PackedLinear)
        hot = e.scheduler.decoder.proposer.hot_head.proj
        assert isinstance(hot, MixedLinear) and hot.weight.dtype == F32


@pytest.mark.parametrize("compiled", [False, True])
@needs_onednn_bf16
def test_float32_standalone_under_a_bf16_target_is_lossless(model_factory, compiled):
    """The float32 draft's linears are MixedLinear (float32 up to FP32_MAX_ROWS rows, packed bf16 beyond): a
    batch of 8 drafts 24 rows per level, a lone request 3; both paths, eager and compiled (compared with compiled
    plain decoding: in bf16 a compiled forward may round differently from an eager one)."""
    path = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, dtype=BF16)
    target_kw = {"enable_torch_compile": compiled}
    kw = spec_kwargs("STANDALONE", path, 4, 3, 8, speculative_draft_dtype="float32")
    _gate(path, kw, F32, min_accept_length=1.5, **target_kw)
    with Engine(model_path=path, max_total_tokens=4096, **target_kw) as e:
        want = e.generate(PROMPTS[0], greedy(24))["output_ids"]
    with Engine(model_path=path, max_total_tokens=4096, **target_kw, **kw) as e:
        assert any(isinstance(m, MixedLinear) for m in e.scheduler.decoder.proposer.head.modules())
        out = e.generate(PROMPTS[0], greedy(24))
    assert out["output_ids"] == want
    assert_drafting_happened([out], min_accept_length=1.5)


@pytest.mark.parametrize("compiled", [False, True])
@needs_onednn_bf16
def test_float32_head_runs_large_calls_in_bf16_losslessly(model_factory, tmp_path, compiled):
    """A float32 EAGLE-3 head under a bf16 target keeps its KV in bf16 and runs forwards of more than
    FP32_MAX_ROWS tokens in bf16 (prompt catch-ups; at batch 8 the tree levels of 8 x 3 rows and the catch-ups after
    verification), smaller ones (a lone request's levels of 3 rows) in float32. Both kinds must have run, and the
    greedy output is plain decoding's at batch 8 and for a lone request, eager and compiled."""
    target = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True, dtype=BF16)
    head = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self")
    target_kw = {"enable_torch_compile": compiled}
    kw = spec_kwargs("EAGLE3", head, 4, 3, 8, speculative_draft_dtype="float32")
    with Engine(model_path=target, max_total_tokens=4096, **target_kw) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
        lone = e.generate(PROMPTS[0], greedy(24))["output_ids"]
    with Engine(model_path=target, max_total_tokens=4096, **target_kw, **kw) as e:
        proposer = e.scheduler.decoder.proposer
        assert proposer.draft_dtype == F32 and proposer.kv_pool.dtype == BF16 and proposer.half_dtype == BF16
        seen = []
        pick = proposer.compute_dtype
        proposer.compute_dtype = lambda rows: seen.append(pick(rows)) or seen[-1]
        outs = e.generate(PROMPTS, greedy(24))
        one = e.generate(PROMPTS[0], greedy(24))
        assert [o["output_ids"] for o in outs] == plain and one["output_ids"] == lone
        assert_drafting_happened(outs, min_accept_length=1.5)
        assert_drafting_happened([one], min_accept_length=1.5)
        assert {F32, BF16} <= set(seen)
        assert_no_kv_leak(e)


@pytest.mark.parametrize("fp32_ms,bf16_ms,want", [
    ({1: 1.0, 2: 1.0, 3: 1.0}, {1: 2.0, 2: 2.0, 3: 2.0}, 3),  # float32 faster throughout: all probed rows
    ({1: 1.0, 2: 3.0, 3: 1.0}, {1: 2.0, 2: 2.0, 3: 2.0}, 1),  # the first loss ends it, later wins aside
    ({1: 2.0, 2: 1.0}, {1: 1.0, 2: 2.0}, 0),  # bf16 faster from one row: always bf16
    ({1: 2.0}, {1: 2.0}, 0),  # a tie goes to bf16 (half the bytes between calls)
    ({1: 1.94, 2: 1.0}, {1: 2.0, 2: 2.0}, 0),  # 3% faster is a near tie: bf16, whatever follows
    ({1: 1.8, 2: 1.94}, {1: 2.0, 2: 2.0}, 1),  # 10% faster keeps the row count
])
def test_pick_crossover(fp32_ms, bf16_ms, want):
    from specserve.platform.cpu.mixed_probe import pick_crossover

    def passes(ms: dict[int, float]) -> dict[int, list[float]]:  # three passes a row count, the median in the middle
        return {r: [v * 0.9, v, v * 5] for r, v in ms.items()}

    assert pick_crossover(passes(fp32_ms), passes(bf16_ms)) == want


@needs_onednn_bf16
def test_engine_probes_the_float32_crossover(model_factory, tmp_path, monkeypatch):
    """With SPECSERVE_DRAFT_FP32_MAX_ROWS=auto the first float32 draft times its own linears at 1..8 rows both ways:
    the server info gives the crossover and the times, every MixedLinear and the draft's forwards follow it."""
    from specserve.platform.cpu import mixed_probe

    monkeypatch.setenv(mixed_probe.ENV, "auto")
    target = model_factory("llama", num_hidden_layers=2, unit_embeddings=True, dtype=BF16)
    head = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self")
    kw = spec_kwargs("EAGLE3", head, 4, 3, 8, speculative_draft_dtype="float32")
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        verdict = e.get_server_info()["cpu_draft_fp32_rows"]
        proposer = e.scheduler.decoder.proposer
        mixed = [m for m in proposer.head.modules() if isinstance(m, MixedLinear)]
        assert len(e.generate(PROMPTS[0], greedy(6))["output_ids"]) == 6
    assert verdict["source"] == "probe" and 0 <= verdict["fp32_max_rows"] <= 8
    assert sorted(verdict["fp32_ms"]) == sorted(verdict["bf16_ms"]) == list(range(1, 9))
    assert all(t > 0 for t in [*verdict["fp32_ms"].values(), *verdict["bf16_ms"].values()])
    assert mixed and all(m.fp32_max_rows == verdict["fp32_max_rows"] for m in mixed)
    rows = verdict["fp32_max_rows"]
    assert proposer.compute_dtype(rows + 1) == BF16
    assert rows == 0 or proposer.compute_dtype(rows) == F32


@pytest.mark.parametrize("algo", ["EAGLE3", "STANDALONE"])
@needs_onednn_bf16
def test_a_crossover_of_zero_runs_every_draft_call_in_bf16_losslessly(model_factory, tmp_path, monkeypatch, algo):
    """SPECSERVE_DRAFT_FP32_MAX_ROWS=0 (what the probe picks where bf16 wins from one row): a float32 draft's
    linears run their packed bf16 copies at every row count, the EAGLE-3 head's forwards in bf16 throughout, and
    greedy outputs stay plain decoding's, batch 1 and batch 4, drafting checked."""
    from specserve.platform.cpu import mixed_probe, packing

    monkeypatch.setenv(mixed_probe.ENV, "0")
    target = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True, dtype=BF16)
    draft = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self") if algo == "EAGLE3" else target
    with Engine(model_path=target, max_total_tokens=4096) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS[:4], greedy(20))]
        lone = e.generate(PROMPTS[0], greedy(20))["output_ids"]
    fp32_calls = []
    real = packing.F.linear
    monkeypatch.setattr(packing.F, "linear",  # a float32 weight's call is a MixedLinear's float32 path
                        lambda x, w, b=None: (w.dtype == F32 and fp32_calls.append(x.shape)) or real(x, w, b))
    kw = spec_kwargs(algo, draft, 4, 3, 8, speculative_draft_dtype="float32")
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        proposer = e.scheduler.decoder.proposer
        assert e.get_server_info()["cpu_draft_fp32_rows"] == {"fp32_max_rows": 0, "source": mixed_probe.ENV}
        assert proposer.draft_dtype == F32
        seen = []
        pick = proposer.compute_dtype
        proposer.compute_dtype = lambda rows: seen.append(pick(rows)) or seen[-1]
        outs = e.generate(PROMPTS[:4], greedy(20))
        one = e.generate(PROMPTS[0], greedy(20))
    assert [o["output_ids"] for o in outs] == plain and one["output_ids"] == lone
    assert_drafting_happened(outs, min_accept_length=1.5)
    assert_drafting_happened([one], min_accept_length=1.5)
    if algo == "EAGLE3":  # a STANDALONE draft keeps float32 activations between its linears
        assert set(seen) == {BF16}
    assert fp32_calls == []  # no MixedLinear took its float32 path

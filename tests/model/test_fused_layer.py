"""A decoder layer in one operator call (platform/cpu/fused_layer.py): the C++ operator against its steps called one
by one, the engine's outputs and logprobs with and without it (plain, batched, int8 weights), speculation through it
lossless with verify trees taking it, and where the policy installs it."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.models.layers import DecoderLayer
from specserve.platform.cpu import fused_layer, native, packing, small_gemm
from specserve.platform.cpu.fused_layer import FusedLayer, decoder_layer, decoder_layer_reference
from specserve.platform.cpu.int8_gemm import pack as pack_int8
from specserve.platform.cpu.ops import registered
from specserve.platform.cpu.small_gemm import pack
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

BF16 = torch.bfloat16
# tiny models with heads of 32 (the attention kernel's smallest)
WIDE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
needs_op = pytest.mark.skipif(not fused_layer.available(),
                              reason="ops.cpp does not build here (a CPU with AVX2 or AVX512-BF16, and a compiler)")


def kernel_linears(monkeypatch) -> None:
    """bf16 linears on the few-row kernel the operator calls: on the AVX2 build oneDNN packs nothing (the AVX2
    kernel's linears); on AVX512-BF16 the few-row kernel takes calls of 1 to 16 rows, untimed (its probe's verdict
    would depend on the machine's load)."""
    native.native_ops()
    if registered("avx2_gemm"):
        monkeypatch.setattr(packing, "_pack", lambda *a, **k: None)
    else:
        monkeypatch.setenv(small_gemm.ENV, "on")


def random_layer(gen: torch.Generator, hidden: int, heads: int, kv_heads: int, dim: int, inter: int, int8: bool,
                 bias: bool) -> list:
    """The 12 linear entries of a layer with random weights: bf16 packed, or int8 packed with scales."""
    entries = []
    for n, k in (((heads + 2 * kv_heads) * dim, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter)):
        w = torch.randn(n, k, generator=gen) / k**0.5
        b = torch.randn(n, generator=gen) if bias else None
        if int8:
            q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
            entries += [pack_int8(q), torch.rand(n, generator=gen) / 200, b]
        else:
            entries += [pack(w.to(BF16)), None, b]
    return entries


@needs_op
@pytest.mark.parametrize("int8,eagle3", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("bsz,queries", [(1, 1), (3, 1), (2, 4)])
def test_the_operator_gives_its_steps_bits(int8, eagle3, bsz, queries):
    """Decode rows of 1 and 3 requests and trees of 4 queries under a mask: the output and the K and V written equal
    those of the single operators called one by one, bit for bit (biases on the bf16 layers; an EAGLE-3 layer's
    embeddings beside its hidden)."""
    gen = torch.Generator().manual_seed(bsz * 10 + queries + int8 + 2 * eagle3)
    hidden, heads, kv_heads, dim, inter, keys = 128, 4, 2, 64, 192, 20
    linears = random_layer(gen, (1 + eagle3) * hidden, heads, kv_heads, dim, inter, int8, bias=not int8)
    if eagle3:  # the other linears read hidden-wide inputs
        linears[3:] = random_layer(gen, hidden, heads, kv_heads, dim, inter, int8, bias=True)[3:]
    tokens = bsz * queries
    x = torch.randn(tokens, hidden, generator=gen).to(BF16)
    norm1, norm2, norm0 = ((torch.rand(hidden, generator=gen) + 0.5).to(BF16) for _ in range(3))
    extra = (torch.randn(tokens, hidden, generator=gen).to(BF16), norm0) if eagle3 else ()
    table = torch.randn(64, 2, dim, generator=gen).to(BF16)
    cos, sin = table[torch.randint(0, 64, (tokens,), generator=gen)].unsqueeze(1).unbind(2)
    pool = (torch.randn(2, 100, kv_heads, dim, generator=gen) / 2).to(BF16)
    kv_slots = torch.randperm(99, generator=gen)[: bsz * keys].view(bsz, keys) + 1  # [B, K]; slot 0 is padding
    out_slots = kv_slots[:, -queries:].reshape(-1)  # the new tokens are each request's last keys
    mask = None
    if queries > 1:  # each query sees the prefix and itself and the queries before it
        mask = torch.ones(bsz, 1, queries, keys, dtype=torch.bool)
        mask[..., keys - queries :] = torch.tril(torch.ones(queries, queries, dtype=torch.bool))
    args = (norm1, norm2, 1e-5, cos, sin)
    k1, v1 = pool.clone().unbind(0)
    k2, v2 = pool.clone().unbind(0)
    # on AVX512-BF16 with AMX, the bf16 linears of 4 rows or more on the tile unit (elsewhere amx_from is ignored)
    amx = {"amx_from": 4}
    got = decoder_layer(x, linears, *args, k1, v1, out_slots, kv_slots, mask, heads, 0.125, *extra, **amx)
    want = decoder_layer_reference(x, linears, *args, k2, v2, out_slots, kv_slots, mask, heads, 0.125, *extra, **amx)
    assert got.shape == x.shape and torch.equal(got, want)
    assert torch.equal(k1, k2) and torch.equal(v1, v2) and not torch.equal(k1, pool[0])


def fused_calls(monkeypatch) -> list[tuple[str, int, int]]:
    """Records (the layer's class, token count, request count) of every forward whose first layer ran through the
    operator."""
    calls: list[tuple[str, int, int]] = []
    original = FusedLayer.__call__

    def counting(self, x, positions, fb, embeds=None):
        out = original(self, x, positions, fb, embeds)
        if out is not None and self.layer_id == 0:
            calls.append((type(self.layer).__name__, x.shape[0], fb.attn.kv_slots.shape[0]))
        return out

    monkeypatch.setattr(FusedLayer, "__call__", counting)
    return calls


def outputs(path: str, n: int = 12, **kwargs) -> list[tuple]:
    """Greedy ids and their logprobs for a batch of prompts, then for one alone."""
    with Engine(model_path=path, max_total_tokens=4096, **kwargs) as e:
        outs = e.generate(PROMPTS, greedy(n), return_logprob=True)
        outs += e.generate(PROMPTS[-1:], greedy(n), return_logprob=True)
        assert_no_kv_leak(e)
        info = e.get_server_info()
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs], info


@needs_op
@pytest.mark.parametrize("quant", [None, "int8wo"])
def test_the_engine_gives_the_same_tokens_and_logprobs_with_it(model_factory, monkeypatch, quant):
    """bf16 models (Llama; Qwen2 with q/k/v biases) and int8 weights: a batch's greedy tokens and their logprobs are
    the same with fused layers as with the modules, and decode forwards of one and of several requests took them."""
    kernel_linears(monkeypatch)
    kw = {} if quant is None else {"torchao_config": quant}
    for arch in ("llama", "qwen2"):
        path = model_factory(arch, num_hidden_layers=2, dtype=BF16, **WIDE)
        calls = fused_calls(monkeypatch)
        fused, info = outputs(path, **kw)
        decodes = {("DecoderLayer", n, n) for n in (1, len(PROMPTS))}  # one request's and the batch's decode rows
        assert info["cpu_fused_layers"] == 2 and decodes <= set(calls)
        monkeypatch.setenv(fused_layer.ENV, "off")
        modules, info = outputs(path, **kw)
        monkeypatch.delenv(fused_layer.ENV)
        assert "cpu_fused_layers" not in info
        assert fused == modules


@needs_op
@pytest.mark.parametrize("algo", ["EAGLE3", "STANDALONE"])
def test_speculation_through_fused_layers_is_lossless(model_factory, tmp_path, monkeypatch, algo):
    """Greedy and seeded sampled EAGLE-3 and STANDALONE over a bf16 target whose layers run the operator (the drafts'
    too: the EAGLE-3 head's layer, the STANDALONE model's; the EAGLE-3 head's rankings, raced or not, through
    draft_topk) give plain decoding's tokens, with drafts accepted and verify trees of several queries per request
    through it."""
    from specserve.test.tiny import make_eagle3_head_dir

    kernel_linears(monkeypatch)
    target = model_factory("llama", num_hidden_layers=2, unit_embeddings=True, identity_layers=True, dtype=BF16,
                           **WIDE)
    seeded = [greedy(24, temperature=0.8, seed=s) for s in range(len(PROMPTS))]
    with Engine(model_path=target, max_total_tokens=4096) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24)) + e.generate(PROMPTS[:1], greedy(24))]
        plain_sampled = [o["output_ids"] for o in e.generate(PROMPTS, seeded)]
    draft = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self") if algo == "EAGLE3" else target
    calls = fused_calls(monkeypatch)
    kw = spec_kwargs(algo, draft, 4, 3, 8, speculative_draft_dtype="bfloat16", disable_speculative_auto_off=True)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        # the batch, then one request alone: its verify trees fit the AVX512-BF16 kernel's 16 rows
        outs = e.generate(PROMPTS, greedy(24)) + e.generate(PROMPTS[:1], greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, 1.2)
        ranked = e.loop.call(lambda s: s.decoder.proposer.one_call_rankings)
        # seeded sampled requests: each position's race noise drafts their candidates (through draft_topk too)
        sampled = e.generate(PROMPTS, seeded)
        assert [o["output_ids"] for o in sampled] == plain_sampled
        assert_drafting_happened(sampled, 1.0)
        raced = e.loop.call(lambda s: s.decoder.proposer.one_call_rankings) - ranked
        assert_no_kv_leak(e)
    assert any(n > bsz for name, n, bsz in calls if name == "DecoderLayer")  # verify trees: several a request
    if algo == "EAGLE3":  # the head's draft levels, ranked by the draft_topk operator
        assert any(name == "Eagle3MidLayer" for name, _, _ in calls)
        assert ranked > 0 and raced > 0


@needs_op
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_constrained_drafting_ranks_through_the_operator_losslessly(model_factory, tmp_path, monkeypatch, backend):
    """Constrained requests (a regex, a JSON schema) beside a free one, greedy EAGLE-3 over a bf16 target with fused
    layers, with either grammar engine (their bitmasks share a layout): the head's draft levels under the grammars are
    ranked by draft_topk with their bitmask rows, and the outputs are constrained plain decoding's."""
    from specserve.platform.cpu.draft_topk import HeadTopk
    from specserve.test.tiny import make_eagle3_head_dir

    kernel_linears(monkeypatch)
    target = model_factory("llama", num_hidden_layers=2, unit_embeddings=True, identity_layers=True, dtype=BF16,
                           **WIDE)
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    params = [greedy(24, regex="[a-m ]{0,40}"), greedy(24, json_schema=schema), greedy(24)]
    with Engine(model_path=target, max_total_tokens=4096, grammar_backend=backend) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS[:3], params)]
    banned: list[int] = []
    original = HeadTopk.__call__

    def counting(self, x, k, scale, to_target, race=None, allowed=None):
        if allowed is not None:
            banned.append(x.shape[0])
        return original(self, x, k, scale, to_target, race, allowed)

    monkeypatch.setattr(HeadTopk, "__call__", counting)
    draft = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self")
    kw = spec_kwargs("EAGLE3", draft, 4, 3, 8, speculative_draft_dtype="bfloat16", disable_speculative_auto_off=True,
                     grammar_backend=backend)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        outs = e.generate(PROMPTS[:3], params)
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in outs] == plain
    assert_drafting_happened(outs[:2], 1.0)
    assert banned  # draft levels under a grammar went through the operator


@needs_op
def test_compiled_forwards_trace_the_modules(model_factory, monkeypatch, fresh_dynamo):
    """Under --enable-torch-compile the graphs trace the layers' modules (the hook steps aside while compiling) and
    decode what the eager engine with fused layers does, up to the ties its decode attention breaks otherwise."""
    from tests.engine.helpers import assert_greedy_equal_up_to_ties

    kernel_linears(monkeypatch)
    path = model_factory("llama", num_hidden_layers=2, dtype=BF16, **WIDE)
    params = greedy(12, return_logprob=True, top_logprobs_num=2)
    outs = []
    for compiled in (False, True):
        with Engine(model_path=path, max_total_tokens=2048, enable_torch_compile=compiled) as e:
            assert e.get_server_info()["cpu_fused_layers"] == 2
            outs.append(e.generate(PROMPTS[:3], params) + [e.generate(PROMPTS[3], params)])
            graphs = e.get_server_info()["torch_compile_graphs"] if compiled else None
    assert graphs > 0
    assert_greedy_equal_up_to_ties([o["output_ids"] for o in outs[1]], outs[0])


def test_the_policy_installs_it_on_exact_classes_only(model_factory, monkeypatch):
    """Llama's layers take it; Qwen3's (q/k norms) keep their modules; SPECSERVE_CPU_FUSED_LAYER=off and a bad value
    (named in the error) as for the other kernels."""
    from specserve.config import ServerArgs
    from specserve.models.loader import load_model
    from specserve.platform import platform_policy

    kernel_linears(monkeypatch)

    def installed(arch: str) -> list:
        model, _, _ = load_model(model_factory(arch, num_hidden_layers=2, dtype=BF16, **WIDE), "bfloat16")
        platform_policy(ServerArgs(), torch.device("cpu")).pack_weights(model)
        return [m for m in model.modules() if isinstance(m, DecoderLayer) and m.fused is not None]

    assert len(installed("llama")) == (2 if fused_layer.available() else 0)
    assert installed("qwen3") == []
    monkeypatch.setenv(fused_layer.ENV, "off")
    assert installed("llama") == []
    monkeypatch.setenv(fused_layer.ENV, "yes")
    with pytest.raises(ValueError, match=fused_layer.ENV):
        fused_layer.available()

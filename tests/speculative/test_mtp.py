"""MTP (MiMo): the Qwen2 body against transformers, the MTP layer against the published formula, drafter
selection, and the lossless gate (greedy output with the model's own MTP layer drafting == plain decoding)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specserve import Engine
from specserve.attention import ForwardBatch, ForwardMode
from specserve.attention.sdpa import build_attn_metadata
from specserve.cache.kv_pool import KVPool
from specserve.config import ConfigError
from specserve.models.loader import load_model
from specserve.test.tiny import make_eagle_head_dir, make_mimo_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import (
    assert_chunked_radix_and_retraction_lossless,
    assert_drafting_happened,
    spec_kwargs,
)

TREES = [(1, 1, 2), (3, 1, 4), (3, 2, 5), (5, 4, 8)]  # (num_steps, topk, num_draft_tokens); (1, 1, 2) = the seed's


@pytest.fixture(scope="module")
def mimo(tmp_path_factory, tokenizer_dir):
    d = tmp_path_factory.mktemp("mimo")
    return {kind: make_mimo_dir(str(d / kind), kind=kind, tokenizer_dir=tokenizer_dir, max_position_embeddings=1024)
            for kind in ("self", "random")}


@pytest.fixture(scope="module")
def plain(mimo):
    with Engine(model_path=mimo["self"], max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


def _fb(ids, positions, slots, kv_slots, kv_len, pool, mode=ForwardMode.EXTEND):
    md = build_attn_metadata(kv_slots[None], [kv_len], [len(ids)])
    return ForwardBatch(mode, torch.tensor(ids), torch.tensor(positions), slots, md, pool)


# ---------------------------------------------------------------------- the model
def test_mimo_body_matches_transformers_qwen2_and_keeps_the_mtp_tensors(tmp_path, tokenizer_dir, caplog):
    path = make_mimo_dir(str(tmp_path / "m"), kind="random", tokenizer_dir=tokenizer_dir, num_hidden_layers=2)
    with caplog.at_level(logging.WARNING, logger="specserve"):
        ours, spec, _ = load_model(path, "float32")
    assert not [r for r in caplog.records if "ignored" in r.getMessage()], "MTP tensors reported as unexpected"
    ref = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # MiMo's body is Qwen2
    torch.manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (30,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]  # [30, V]
    pool = KVPool(spec.num_layers, 64, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    slots = torch.randperm(64)[:30] + 1
    with torch.inference_mode():
        prefill = ours(_fb(ids[:25], range(25), slots[:25], slots, 25, pool)).logits
        torch.testing.assert_close(prefill, expected[:25], atol=2e-5, rtol=1e-4)
        for p in range(25, 30):  # decode on the cached prefix
            step = ours(_fb(ids[p : p + 1], [p], slots[p : p + 1], slots, p + 1, pool, ForwardMode.DECODE)).logits
            torch.testing.assert_close(step[0], expected[p], atol=2e-5, rtol=1e-4)
    # every MTP tensor of the checkpoint landed in the kept MTP layer (q/k/v and gate/up fused)
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    mtp = ours.mtp_layers[0]
    assert len(ours.mtp_layers) == 1
    for name in ("input_proj", "token_layernorm", "hidden_layernorm", "final_layernorm", "self_attn.o_proj"):
        torch.testing.assert_close(mtp.get_parameter(f"{name}.weight"), ckpt[f"model.mtp_layers.0.{name}.weight"])
    qkv = torch.cat([ckpt[f"model.mtp_layers.0.self_attn.{x}_proj.bias"] for x in "qkv"])
    torch.testing.assert_close(mtp.self_attn.qkv_proj.bias, qkv)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _mtp_reference(path: str, ids: list[int]) -> torch.Tensor:
    """MTP logits per the published definition, built from transformers: the target's post-norm hidden h_i and
    token i + 1 (embedding zeroed at position 0) -> input_proj(cat(hidden_layernorm(h), token_layernorm(e))) ->
    a Qwen2 decoder layer (transformers' own, run as a one-layer Qwen2 fed inputs_embeds) -> final_layernorm ->
    the shared LM head. -> [len(ids) - 1, V]."""
    target = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = target.config
    ck = load_file(os.path.join(path, "model.safetensors"))
    p = "model.mtp_layers.0."
    with torch.no_grad():
        hidden = target(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, :-1]  # [T-1, h]
        emb = target.model.embed_tokens(torch.tensor(ids[1:]))  # token i + 1 at position i
        emb[0] = 0.0
        both = torch.cat([_rms(hidden, ck[p + "hidden_layernorm.weight"], cfg.rms_norm_eps),
                          _rms(emb, ck[p + "token_layernorm.weight"], cfg.rms_norm_eps)], dim=-1)  # [T-1, 2h]
        x = both @ ck[p + "input_proj.weight"].T  # [T-1, h]
        block_cfg = transformers.Qwen2Config(**{**cfg.to_dict(), "num_hidden_layers": 1, "layer_types": None})
        block = transformers.Qwen2ForCausalLM(block_cfg).eval()
        state = {k.replace(p, "model.layers.0."): v for k, v in ck.items() if k.startswith(p)}
        state.update({"model.norm.weight": ck[p + "final_layernorm.weight"], "lm_head.weight": ck["lm_head.weight"],
                      "model.embed_tokens.weight": ck["model.embed_tokens.weight"]})
        missing, _ = block.load_state_dict(state, strict=False)  # the MTP-only tensors are the unexpected ones
        assert not missing, missing
        return block(inputs_embeds=x[None]).logits[0]


def test_mtp_layer_matches_the_published_formula(tmp_path, tokenizer_dir):
    """Random MTP weights (norm weights not all ones), a 2-layer body: our MTP layer, fed our target's hidden
    states with the EAGLE shift, prefill then decode on its own KV, gives the reference's logits."""
    path = make_mimo_dir(str(tmp_path / "m"), kind="random", tokenizer_dir=tokenizer_dir, num_hidden_layers=2)
    ours, spec, _ = load_model(path, "float32")
    torch.manual_seed(2)
    ids = torch.randint(0, spec.vocab_size, (21,)).tolist()
    expected = _mtp_reference(path, ids)  # [20, V]
    n = len(ids) - 1
    slots = torch.randperm(64)[:n] + 1
    target_pool = KVPool(spec.num_layers, 64, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    pool = KVPool(1, 64, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    mtp = ours.mtp_layers[0]
    with torch.inference_mode():
        target_slots = torch.randperm(64)[: n + 1] + 1
        hidden = ours(_fb(ids, range(n + 1), target_slots, target_slots, n + 1, target_pool)).hidden  # [n + 1, h]
        fb = _fb(ids[1:16], range(15), slots[:15], slots, 15, pool)
        got = [ours.compute_logits(mtp(fb, ours.embed(fb.input_ids), hidden[:15]))]
        for p in range(15, n):
            fb = _fb(ids[p + 1 : p + 2], [p], slots[p : p + 1], slots, p + 1, pool, ForwardMode.DECODE)
            got.append(ours.compute_logits(mtp(fb, ours.embed(fb.input_ids), hidden[p : p + 1])))
    torch.testing.assert_close(torch.cat(got), expected, atol=5e-5, rtol=1e-4)


# ---------------------------------------------------------------------- drafter selection
def _proposer_name(engine) -> str:
    return engine.loop.call(lambda s: type(s.decoder.proposer).__name__)


def test_eagle_without_draft_path_needs_mtp_layers(tmp_path, tokenizer_dir, model_factory, caplog):
    plain_qwen2 = model_factory("qwen2", num_hidden_layers=1)
    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):
        Engine(model_path=plain_qwen2, max_total_tokens=512, speculative_algorithm="EAGLE")
    # a config that announces MTP layers over a checkpoint without their tensors: a plain target, no MTP drafting
    path = make_mimo_dir(str(tmp_path / "m"), kind="self", tokenizer_dir=tokenizer_dir)
    weights = os.path.join(path, "model.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if ".mtp_layers." not in k}, weights, {"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="specserve"):
        model, _, _ = load_model(path, "float32")
    assert len(model.mtp_layers) == 0
    assert any("no model.mtp_layers." in r.getMessage() for r in caplog.records)
    with Engine(model_path=path, max_total_tokens=512) as e:
        assert len(e.generate(PROMPTS[0], greedy(4))["output_ids"]) == 4
    with pytest.raises(ConfigError, match="--speculative-draft-model-path"):
        Engine(model_path=path, max_total_tokens=512, speculative_algorithm="EAGLE")


def test_selection_mtp_without_path_eagle_head_with_path(mimo, tmp_path):
    with Engine(model_path=mimo["self"], max_total_tokens=512, speculative_algorithm="NEXTN") as e:
        assert _proposer_name(e) == "MtpProposer"
    head = make_eagle_head_dir(str(tmp_path / "head"), mimo["self"], kind="random")
    with Engine(model_path=mimo["self"], max_total_tokens=512,
                **spec_kwargs("EAGLE", head, 3, 1, 4)) as e:
        assert _proposer_name(e) == "EagleProposer"


# ---------------------------------------------------------------------- the lossless gate
@pytest.mark.parametrize("tree", TREES)
def test_greedy_batch_of_8_equals_plain(mimo, plain, tree):
    with Engine(model_path=mimo["self"], max_total_tokens=4096, **spec_kwargs("EAGLE", None, *tree)) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=1.5)
        assert_no_kv_leak(e)


def test_draft_dtype_flag_is_ignored_with_a_warning(mimo, plain, caplog):
    """The MTP layer is part of the target and runs in its dtype: --speculative-draft-dtype cannot apply."""
    kw = spec_kwargs("EAGLE", None, 3, 1, 4, speculative_draft_dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="specserve.speculative.mtp"), \
            Engine(model_path=mimo["self"], max_total_tokens=4096, **kw) as e:
        proposer = e.scheduler.decoder.proposer
        assert proposer.draft_dtype == e.scheduler.runner.dtype == torch.float32
        assert proposer.kv_pool.dtype == torch.float32
        outs = e.generate(PROMPTS, greedy(24))
    assert "--speculative-draft-dtype bfloat16 is ignored with MTP" in caplog.text
    assert [o["output_ids"] for o in outs] == plain
    assert_drafting_happened(outs, min_accept_length=1.5)


@pytest.mark.parametrize("tree", [(3, 1, 4), (3, 2, 5)])
def test_greedy_batch_of_1_equals_plain(mimo, plain, tree):
    with Engine(model_path=mimo["self"], max_total_tokens=4096, **spec_kwargs("NEXTN", None, *tree)) as e:
        outs = [e.generate(p, greedy(24)) for p in PROMPTS[:3]]
    assert [o["output_ids"] for o in outs] == plain[:3]
    assert_drafting_happened(outs, min_accept_length=1.5)


def test_random_mtp_weights_still_lossless(mimo):
    with Engine(model_path=mimo["random"], max_total_tokens=4096) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS, greedy(16))]
    with Engine(model_path=mimo["random"], max_total_tokens=4096, **spec_kwargs("EAGLE", None, 4, 3, 8)) as e:
        outs = e.generate(PROMPTS, greedy(16))
        assert [o["output_ids"] for o in outs] == want
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
        assert_no_kv_leak(e)


def test_chunked_prefill_radix_reuse_and_retraction(mimo, plain):
    assert_chunked_radix_and_retraction_lossless(mimo["self"], spec_kwargs("EAGLE", None, 3, 2, 5), PROMPTS,
                                                 greedy(24), plain, min_accept_length=1.5, retraction_tokens=128)

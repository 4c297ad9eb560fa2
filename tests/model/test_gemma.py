"""Gemma (``GemmaForCausalLM``): logits and greedy tokens against transformers, loading a save_pretrained folder
(tied head, released-style configs, config errors), and the lossless gate for NGRAM and STANDALONE drafting."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers

from specserve import Engine
from specserve.attention import ForwardMode
from specserve.cache.kv_pool import KVPool
from specserve.models.gemma import GemmaForCausalLM, GemmaRMSNorm
from specserve.models.loader import load_model
from specserve.models.spec import UnsupportedModelError
from specserve.speculative.accept_stats import accept_length
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy, hf_greedy
from tests.model.helpers import assert_logits_match_transformers, forward_tokens
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs


def make_gemma_dir(out_dir: str, tokenizer_dir: str, seed: int = 0, logit_scale: float = 4.0, **overrides) -> str:
    """A random tiny Gemma as an HF folder (transformers' GemmaForCausalLM, save_pretrained, safetensors).

    head_dim 24 is not hidden_size / heads (16). Norm weights are random around 0 (transformers starts them at 0,
    where ``1 + weight`` and ``weight`` would be told apart only by the zero output of the latter), and the final
    norm scales by about logit_scale so greedy choices are clear-cut."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out_dir)
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
              pad_token_id=6)
    kw.update(overrides)
    cfg = transformers.GemmaConfig(**kw)
    cfg.architectures = ["GemmaForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.GemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
        model.model.norm.weight.add_(logit_scale - 1.0)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def gemma_factory(tmp_path_factory, tokenizer_dir):
    cache: dict = {}

    def make(**overrides) -> str:
        key = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
        if key not in cache:
            cache[key] = make_gemma_dir(str(tmp_path_factory.mktemp("gemma")), tokenizer_dir, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def gemma(gemma_factory) -> str:
    return gemma_factory()


@pytest.fixture(scope="module")
def served(gemma_factory) -> str:
    """The model the engine tests serve: weights with std 0.2, not transformers' 0.02. At 0.02 the layers barely
    change the residual stream, which the tied head then maps back to the current token: the greedy continuation
    repeats one token, and every draft of it would be right."""
    return gemma_factory(initializer_range=0.2)


CASES = {
    "tied-gqa-headdim24": {},
    "untied-mha-bias": {"tie_word_embeddings": False, "num_key_value_heads": 4, "attention_bias": True},
    "mqa-rope-theta": {"num_key_value_heads": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_logits_match_transformers(gemma_factory, case):
    path = gemma_factory(**CASES[case])
    ours, spec, _ = load_model(path, "float32")
    assert isinstance(ours, GemmaForCausalLM) and spec.head_dim == 24 and spec.hidden_act == "gelu_pytorch_tanh"
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_logits_match_transformers(ours, spec, ref)


def test_scaled_embeddings_and_norms_match_transformers_in_bfloat16(gemma_factory):
    """sqrt(48) = 6.928... is 6.9375 in bfloat16: the first layer's input equals transformers' bit for bit only with
    the factor rounded to the model dtype first; every hidden state stays close."""
    path = gemma_factory(hidden_size=48, head_dim=16)
    ours, spec, _ = load_model(path, "bfloat16")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = list(range(5, 25))
    with torch.no_grad():
        hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states  # L+1 x [1, T, h]
    pool = KVPool(spec.num_layers, 32, spec.num_kv_heads, spec.head_dim, torch.bfloat16, "cpu")
    out = forward_tokens(ours, pool, ids, 0, torch.arange(1, 21), ForwardMode.EXTEND, capture_layers=(0, 1))
    assert torch.equal(out.aux_hidden[0], hs[0][0])
    raw = ours.embed(torch.tensor(ids))  # embed() gives the unscaled table rows
    assert torch.equal(raw, ours.model.embed_tokens.weight[ids])
    assert not torch.equal(out.aux_hidden[0], (raw.float() * 48**0.5).to(torch.bfloat16))
    torch.testing.assert_close(out.aux_hidden[1], hs[1][0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(out.hidden, hs[-1][0], atol=0.05, rtol=0.02)  # after the final norm


def test_rms_norm_scales_by_one_plus_weight_in_float32():
    norm = GemmaRMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)).to(torch.bfloat16)
    torch.testing.assert_close(norm(x), want, atol=0, rtol=0)
    assert GemmaRMSNorm(4, 1e-6).weight.eq(0).all()  # the identity scale


def test_mlp_activation_is_transformers_gelu_tanh(gemma):
    """Inputs large enough for the tanh approximation to differ from the exact GELU (which the random model's small
    activations barely show)."""
    ours, _, _ = load_model(gemma, "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32).eval()
    x = 20 * torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref.model.layers[0].mlp(x)
        torch.testing.assert_close(ours.model.layers[0].mlp(x), want, atol=1e-6, rtol=1e-5)
        exact = ref.model.layers[0].mlp.down_proj(torch.nn.functional.gelu(ref.model.layers[0].mlp.gate_proj(x))
                                                  * ref.model.layers[0].mlp.up_proj(x))
    assert (exact - want).abs().max() > 1e-4


def test_engine_greedy_tokens_match_transformers_generate(served):
    tok = transformers.AutoTokenizer.from_pretrained(served)
    with Engine(model_path=served, max_total_tokens=2048) as e:
        for prompt in PROMPTS[:3]:
            ids = tok.encode(prompt)
            out = e.generate(input_ids=ids, sampling_params=greedy(16))["output_ids"]
            assert out == hf_greedy(served, ids, 16), prompt


# ---------------------------------------------------------------------------------------------------- loading
def test_save_pretrained_folder_loads_every_tensor_and_ties_the_head(gemma):
    ours, spec, _ = load_model(gemma, "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    assert spec.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    params = dict(ours.named_parameters())
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight":
            continue
        for piece, fused, i in ((".q_proj.", ".qkv_proj.", 0), (".k_proj.", ".qkv_proj.", 1),
                                (".v_proj.", ".qkv_proj.", 2), (".gate_proj.", ".gate_up_proj.", 0),
                                (".up_proj.", ".gate_up_proj.", 1)):
            if piece in name:
                sizes = [spec.num_heads * 24, spec.num_kv_heads * 24, spec.num_kv_heads * 24] if fused == ".qkv_proj." \
                    else [spec.intermediate_size] * 2
                got = params[name.replace(piece, fused)].split(sizes)[i]
                break
        else:
            got = params[name]
        assert torch.equal(got, t), name


def _edit_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_released_style_config_loads(gemma, tmp_path):
    """The released configs: hidden_act "gelu" (meaning the tanh approximation) next to hidden_activation, and no
    tie_word_embeddings (tied by default)."""
    d = _edit_config(gemma, tmp_path / "m", hidden_act="gelu", hidden_activation="gelu_pytorch_tanh",
                     tie_word_embeddings=None)
    ours, spec, _ = load_model(d, "float32")
    base, _, _ = load_model(gemma, "float32")
    assert spec.hidden_act == "gelu_pytorch_tanh" and spec.tie_word_embeddings
    ids = list(range(3, 19))
    pool = KVPool(spec.num_layers, 32, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    a = forward_tokens(ours, pool, ids, 0, torch.arange(1, 17), ForwardMode.EXTEND).logits
    b = forward_tokens(base, pool, ids, 0, torch.arange(1, 17), ForwardMode.EXTEND).logits
    assert torch.equal(a, b)
    legacy = _edit_config(gemma, tmp_path / "legacy", hidden_act="gelu")  # "gelu" alone: still the tanh form
    assert load_model(legacy, "float32")[1].hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("changes, field", [
    ({"hidden_activation": "gelu"}, "hidden_activation"),  # exact GELU: not what Gemma's MLP runs here
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"hidden_act": "gelu_new"}, "hidden_act"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_unsupported_config_values_name_the_field(gemma, tmp_path, changes, field):
    d = _edit_config(gemma, tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError, match=field):
        load_model(d, "float32")


# ---------------------------------------------------------------------------------------------------- speculative
REPETITIVE = [
    "def f(x):\n    return x\ndef f(x):\n    return x\ndef f(",
    "a b c d e f a b c d e f a b c",
    "x = 1\ny = 2\nx = 1\ny = 2\nx =",
] + PROMPTS[:3]


@pytest.fixture(scope="module")
def plain(served):
    with Engine(model_path=served, max_total_tokens=4096) as e:
        outs = [o["output_ids"] for o in e.generate(REPETITIVE, greedy(32))]
    assert all(len(set(o)) > 3 for o in outs)  # not one token repeated: drafts can be wrong
    return outs


def test_ngram_greedy_equals_plain(served, plain):
    with Engine(model_path=served, max_total_tokens=4096, speculative_algorithm="NGRAM",
                speculative_num_draft_tokens=8) as e:
        outs = e.generate(REPETITIVE, greedy(32))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=1.2)
        assert_no_kv_leak(e)


def test_standalone_gemma_drafts_equal_plain(served, gemma_factory, plain):
    """A self-draft (the target drafting for itself) accepts every chain; a foreign one-layer Gemma draft, whose
    drafts are partly accepted and partly rejected, still gives plain decoding's tokens."""
    with Engine(model_path=served, max_total_tokens=4096, **spec_kwargs("STANDALONE", served, 3, 1, 4)) as e:
        outs = e.generate(REPETITIVE, greedy(32))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=2.5)
        assert_no_kv_leak(e)
    other = gemma_factory(num_hidden_layers=1, seed=5, initializer_range=0.2)
    with Engine(model_path=served, max_total_tokens=4096, **spec_kwargs("STANDALONE", other, 3, 2, 5)) as e:
        outs = e.generate(REPETITIVE, greedy(32))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs)
        assert accept_length([o["meta_info"] for o in outs]) < 3.0  # of at most 4: rejections happened
        assert_no_kv_leak(e)

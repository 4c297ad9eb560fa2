"""Our model code vs transformers' implementation: logits parity for prefill and step-by-step decode."""

from __future__ import annotations

import pytest
import torch
import transformers

from specserve.attention import ForwardBatch, ForwardMode
from specserve.attention.sdpa import build_attn_metadata
from specserve.cache.kv_pool import KVPool
from specserve.models.loader import load_model
from tests.model.helpers import assert_logits_match_transformers, forward_tokens

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied-llama3rope": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True,
                                            "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-headdim16-mqa": ("qwen3", {"head_dim": 16, "num_key_value_heads": 1}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_logits_match_transformers(model_factory, case):
    arch, overrides = CASES[case]
    path = model_factory(arch, **overrides)
    ours, spec, _ = load_model(path, "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_logits_match_transformers(ours, spec, ref)


def test_hidden_state_capture_matches_transformers(model_factory):
    path = model_factory("llama", num_hidden_layers=4)
    ours, spec, _ = load_model(path, "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(range(5, 25))
    with torch.no_grad():
        hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states  # L+1 x [1, T, h]
    pool = KVPool(spec.num_layers, 32, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    slots = torch.arange(1, 21)
    fb = ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids), torch.arange(20), slots,
                      build_attn_metadata(slots[None], [20], [20]), pool, capture_layers=(0, 2, 3))
    with torch.inference_mode():
        out = ours(fb)
    for got, layer in zip(out.aux_hidden, (0, 2, 3), strict=True):  # input of layer i = HF hidden_states[i]
        torch.testing.assert_close(got, hs[layer][0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.hidden, hs[-1][0], atol=2e-5, rtol=1e-4)  # after the final norm


def test_batched_mixed_lengths_match_single(model_factory):
    """Three requests with different prefixes and chunk lengths in one padded forward == each alone."""
    path = model_factory("qwen2")
    model, spec, _ = load_model(path, "float32")
    pool = KVPool(spec.num_layers, 256, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    torch.manual_seed(0)
    seqs = [torch.randint(0, spec.vocab_size, (n,)).tolist() for n in (7, 19, 12)]
    prefixes = [3, 0, 11]
    slot_rows = torch.stack([torch.arange(1, 21) + 20 * i for i in range(3)])  # [3, 20]
    singles = []
    for s, p, row in zip(seqs, prefixes, slot_rows, strict=True):
        if p:
            forward_tokens(model, pool, s[:p], 0, row, ForwardMode.EXTEND)
        singles.append(forward_tokens(model, pool, s, p, row, ForwardMode.EXTEND).logits)
    q_lens = [len(s) - p for s, p in zip(seqs, prefixes, strict=True)]
    ids = torch.tensor([t for s, p in zip(seqs, prefixes, strict=True) for t in s[p:]])
    pos = torch.cat([torch.arange(p, len(s)) for s, p in zip(seqs, prefixes, strict=True)])
    out_loc = torch.cat([row[p: len(s)] for s, p, row in zip(seqs, prefixes, slot_rows, strict=True)])
    md = build_attn_metadata(slot_rows, [len(s) for s in seqs], q_lens)
    fb = ForwardBatch(ForwardMode.EXTEND, ids, pos, out_loc, md, pool)
    with torch.inference_mode():
        batched = model(fb).logits
    torch.testing.assert_close(batched, torch.cat(singles), atol=2e-5, rtol=1e-4)

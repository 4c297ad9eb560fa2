"""What the model tests share: running tokens through a model on a KV pool, and the logits parity check against
transformers that every architecture passes (prefill, then decode step by step on the cached prefix)."""

from __future__ import annotations

import torch

from specserve.attention import ForwardBatch, ForwardMode
from specserve.attention.sdpa import build_attn_metadata
from specserve.cache.kv_pool import KVPool


def forward_tokens(model, pool, ids: list[int], start: int, slots: torch.Tensor, mode: ForwardMode,
                   capture_layers: tuple[int, ...] = ()):
    """Run tokens ids[start:] of one request whose first `start` tokens are cached at slots[:start] -> ModelOutput."""
    n = len(ids) - start
    md = build_attn_metadata(slots[None], [len(ids)], [n])
    fb = ForwardBatch(mode, torch.tensor(ids[start:]), torch.arange(start, len(ids)), slots[start:len(ids)], md, pool,
                      capture_layers=capture_layers)
    with torch.inference_mode():
        return model(fb)


def assert_logits_match_transformers(ours, spec, ref, length: int = 40, prefix: int = 30) -> None:
    """ours (a specserve model of `spec`) against ref (transformers' model of the same folder), float32: the logits
    of a prefill of `length` random tokens, then of decoding tokens prefix.. one at a time after a cached prefix, at
    scattered pool slots (the pool is not contiguous)."""
    torch.manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (length,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]  # [length, V]
    pool = KVPool(spec.num_layers, 64, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    slots = torch.randperm(64)[:length] + 1
    prefill = forward_tokens(ours, pool, ids, 0, slots, ForwardMode.EXTEND).logits
    torch.testing.assert_close(prefill, expected, atol=2e-5, rtol=1e-4)
    forward_tokens(ours, pool, ids[:prefix], 0, slots, ForwardMode.EXTEND)
    for p in range(prefix, length):
        step = forward_tokens(ours, pool, ids[: p + 1], p, slots, ForwardMode.DECODE).logits
        torch.testing.assert_close(step[0], expected[p], atol=2e-5, rtol=1e-4)

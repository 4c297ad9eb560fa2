"""Pool-free forwards for training: B equal-length sequences, no KV pool, autograd-friendly.

The serving models run unchanged on such a batch (``train_batch``): attention sees the new tokens of each
sequence only, causally. For the EAGLE-3 training-time test (several draft steps unrolled on the head's own
outputs) a ``StepKV`` keeps the K/V of the earlier steps: in step s, the query of anchor a (position a + s)
sees step 0's keys at anchors <= a (the verified prefix, written by the target-feature pass) and, of every
later step, only its own anchor's key (its chain of draft ancestors). That is the attention a draft token at
tree depth s has at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.batch import ForwardBatch, ForwardMode
from specserve.attention.sdpa import AttnMetadata


class StepKV:
    """K/V of the unrolled steps so far, per layer: lists of [B, L, Hkv, D]."""

    def __init__(self) -> None:
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def add(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append this step's k/v [B, L, Hkv, D]; -> all steps' keys, values [B, S*L, Hkv, D] and S."""
        ks = self.keys.setdefault(layer_id, [])
        vs = self.values.setdefault(layer_id, [])
        ks.append(k)
        vs.append(v)
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1), len(ks)


def step_mask(seq_len: int, steps: int, device) -> torch.Tensor:
    """[L, steps*L] bool: block 0 causal over anchors, blocks 1.. the diagonal (each anchor's own chain)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    eye = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (steps - 1), dim=1)


def train_batch(input_ids: torch.Tensor, position_offset: int = 0, step_kv: StepKV | None = None,
                input_embeds: torch.Tensor | None = None, capture_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """ForwardBatch over input_ids [B, L] (flattened to T = B*L rows), positions offset..offset+L-1."""
    bsz, seq_len = input_ids.shape
    device = input_ids.device
    positions = (torch.arange(seq_len, device=device) + position_offset).repeat(bsz)  # [T]
    attn = AttnMetadata(bsz, seq_len, None, None, True, None, None)
    return ForwardBatch(ForwardMode.EXTEND, input_ids.reshape(-1), positions, None, attn, None,
                        capture_layers=capture_layers, input_embeds=input_embeds, step_kv=step_kv)


def poolless_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch,
                       scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] with T = B*L -> [T, H*D], causal within each sequence (or the step mask)."""
    bsz, seq_len = fb.attn.batch_size, fb.attn.max_q_len
    n_heads, head_dim = q.shape[1], q.shape[2]
    qb = q.view(bsz, seq_len, n_heads, head_dim)
    kb = k.view(bsz, seq_len, k.shape[1], head_dim)
    vb = v.view(bsz, seq_len, v.shape[1], head_dim)
    mask, causal = None, True
    if fb.step_kv is not None:
        kb, vb, steps = fb.step_kv.add(layer_id, kb, vb)
        if steps > 1:
            mask, causal = step_mask(seq_len, steps, q.device), False
    out = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                         attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=kb.shape[2] != n_heads)  # [B, H, L, D]
    return out.transpose(1, 2).reshape(bsz * seq_len, n_heads * head_dim)

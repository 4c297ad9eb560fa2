"""An EAGLE-3 head's whole draft tree after its root's children in one operator call (``draft_levels`` in
``ops.cpp``).

Each draft level after the first is a handful of rows through the head: the live branches' token embeddings, the
head's layer (``decoder_layer``), its ranking (``draft_topk``), then the candidates' bookkeeping (scores, the best K
live branches, their tokens, hidden states and ancestors, the attention mask of the next level, whether drafting can
stop). With each of those an operator or numpy call from Python, a level of the demo's 8/3/12 tree spent about as
long in Python between the calls as in the two operators (docs/benchmarks.md, "Draft levels in one call"). The
operator runs the same operators in the same order from C++ and keeps the bookkeeping in C++ (tree.py's float32
products and stable ranking), so it drafts the tree the level-by-level path drafts, candidate for candidate.

A head takes it (``HeadLevels.for_head``) where its layer runs ``decoder_layer`` (``fused_layer.FusedLayer``), its
ranking ``draft_topk`` (``draft_topk.HeadTopk``) and the target's token embeddings are a plain bf16 table; a drafting
takes it (``EagleProposer._one_call_levels``) where every request drafts K live branches with one score scale, or
every one races without filters, and no grammar (a grammar's rows come from its matcher level by level, in Python).
``SPECSERVE_CPU_FUSED_LAYER=off`` keeps the level-by-level path.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.models.direct_call import Embedding
from specserve.platform.cpu import tree_attention
from specserve.platform.cpu.draft_topk import HeadTopk, draft_topk
from specserve.platform.cpu.draft_topk import native as draft_topk_native
from specserve.platform.cpu.fused_layer import FusedLayer, decoder_layer
from specserve.platform.cpu.ops import cpu_op, registered

BF16 = torch.bfloat16


def draft_levels_reference(root_p, root_ids, hidden, embed, linears, norm1, norm2, embed_norm, eps, heads, attn_scale,
                           amx_from, cos, sin, k_buf, v_buf, scratch, kv_slots, base, head_norm, head_eps,
                           head_linear, rank_scale, to_target=None, rank_amx_from=0, noise=None, inv_temps=None,
                           keep=1, threshold=0.0):
    """The operator's steps one call at a time: ``decoder_layer``, ``draft_topk``, and the bookkeeping of
    ``speculative/tree.py``'s ``EagleCandidates`` in numpy (see ``draft_levels`` below)."""
    B, K = root_p.shape
    L = cos.shape[0]
    live = root_p.float().numpy().copy()  # [B, K] the live branches' scores
    live_index = np.broadcast_to(np.arange(K), (B, K))  # [B, K] their candidate indices
    seen = [live]  # every level's candidate scores [B, *]
    scores, tokens_out, parents = [], [], []
    count, rows = K, np.arange(B)[:, None]
    tokens, x = root_ids.reshape(-1), hidden.repeat_interleave(K, 0)  # [B K], [B K, h]
    ancestors = torch.zeros(B, K, 0, dtype=torch.bool)  # [B, K, (j - 1) K] over the levels' columns
    eye = torch.eye(K, dtype=torch.bool).expand(B, K, K)
    for j in range(1, L + 1):
        best_live = live.max(axis=1)  # [B]; drafting_can_stop
        if count < keep:
            stop = threshold > 0 and bool(best_live.max() < threshold)
        else:
            exact = (np.concatenate(seen, axis=1) >= best_live[:, None]).sum(axis=1) >= keep
            stop = bool((exact | (best_live < threshold) if threshold > 0 else exact).all())
        if stop:
            break
        tree = torch.cat([ancestors, eye], dim=2)  # [B, K, j K]
        mask = torch.zeros(B, K, max(base) + j * K, dtype=torch.bool)  # prefix visible, then the tree
        for b in range(B):
            mask[b, :, : base[b]] = True
            mask[b, :, base[b] : base[b] + j * K] = tree[b]
        out = decoder_layer(x, linears, norm1, norm2, eps, cos[j - 1], sin[j - 1], k_buf, v_buf,
                            scratch[:, j - 1].reshape(-1), kv_slots[:, : mask.shape[2]], mask.unsqueeze(1), heads,
                            attn_scale, torch.embedding(embed, tokens), embed_norm, amx_from)  # [B K, h]
        race = {} if noise is None else dict(noise=noise[:, j].contiguous(), inv_temps=inv_temps, rows_per_group=K)
        p, ids = draft_topk(out, head_norm, head_eps, head_linear, rank_scale if noise is None else 1.0, K, to_target,
                            rank_amx_from, **race)  # [B K, K] each
        level = (live[:, :, None] * p.numpy().reshape(B, K, K)).reshape(B, K * K)  # float32 products
        best = np.argsort(-level, axis=1, kind="stable")[:, :K]  # [B, K]: score desc, the earlier first
        scores.append(level)
        tokens_out.append(ids.numpy().reshape(B, K * K))
        parents.append(np.repeat(live_index, K, axis=1))
        seen.append(level)
        live, live_index, count = level[rows, best], count + best, count + K * K
        if j == L:
            break
        branch = torch.from_numpy(best // K)  # [B, K] the live branch each new one extends
        tokens = ids.view(B, K * K).gather(1, torch.from_numpy(best)).reshape(-1)
        x = out.view(B, K, -1).gather(1, branch.unsqueeze(-1).expand(B, K, out.shape[-1])).reshape(B * K, -1)
        ancestors = tree.gather(1, branch.unsqueeze(-1).expand(B, K, j * K))
    if not scores:
        return torch.empty(B, 0), torch.empty(B, 0, dtype=torch.int64), torch.empty(B, 0, dtype=torch.int64)
    return tuple(torch.from_numpy(np.ascontiguousarray(np.concatenate(a, axis=1)))
                 for a in (scores, tokens_out, parents))


def _fake(root_p, *args, **kwargs):
    B, K = root_p.shape
    return root_p.new_empty(B, 0), root_p.new_empty(B, 0, dtype=torch.int64), root_p.new_empty(B, 0, dtype=torch.int64)


# root_p / root_ids [B, K]: the root's children (level 0); hidden [B, h] bf16: the root's draft hidden; embed [V, h]:
# the target's token embeddings; linears, norms, eps, heads, attn_scale, amx_from: the head's layer as decoder_layer's
# (norm1 of the hidden, embed_norm of the embeddings); cos / sin [L, B K, 1, D]: each level's rows;
# k_buf / v_buf: the draft's pool, written at scratch [B, L, K]; kv_slots [B, max(base) + L K]: request b's base[b]
# prefix keys, then the levels' scratch slots; head_norm, head_eps, head_linear, rank_scale, to_target, rank_amx_from:
# the ranking as draft_topk's; noise [B, S, V] and inv_temps [B]: each request's race (level j's noise at [:, j]);
# keep = N - 1 and threshold: when drafting stops (drafting_can_stop) -> (scores [B, n K K] float32, tokens and
# parents [B, n K K] int64) of the n levels drafted, in candidate order after level 0's K candidates
draft_levels = cpu_op(
    "draft_levels(Tensor root_p, Tensor root_ids, Tensor hidden, Tensor embed, Tensor?[] linears, Tensor norm1, "
    "Tensor norm2, Tensor embed_norm, float eps, int heads, float attn_scale, int amx_from, Tensor cos, Tensor sin, "
    "Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor scratch, Tensor kv_slots, int[] base, Tensor head_norm, "
    "float head_eps, Tensor?[] head_linear, float rank_scale, Tensor? to_target=None, int rank_amx_from=0, "
    "Tensor? noise=None, Tensor? inv_temps=None, int keep=1, float threshold=0.0) -> (Tensor, Tensor, Tensor)",
    draft_levels_reference, _fake)


def native() -> bool:
    """``ops.cpp`` registered the operator's C++ implementation (with draft_topk's, which it calls)."""
    return draft_topk_native() and registered("draft_levels")


class HeadLevels:
    """A head's draft levels through the operator: its layer's operator arguments, its ranking and the embeddings."""

    def __init__(self, layer: FusedLayer, ranker: HeadTopk, embed: torch.Tensor) -> None:
        self.layer, self.ranker, self.embed = layer, ranker, embed

    @classmethod
    def for_head(cls, layer: FusedLayer | None, ranker: HeadTopk | None, embedding) -> HeadLevels | None:
        """The head's levels through the operator, or None where a piece does not take it (see the module's
        docstring): layer, the head layer's ``fused`` hook; ranker, its ``draft_topk`` ranking; embedding, the
        target's token embedding module."""
        if (type(layer) is not FusedLayer or layer.embed_norm is None or type(ranker) is not HeadTopk
                or type(embedding) is not Embedding or embedding.max_norm is not None
                or embedding.weight.dtype != BF16 or not native()):
            return None
        return cls(layer, ranker, embedding.weight)

    def fits(self, rows: int, k: int, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
        """Levels of `rows` = B x k rows over this pool take the operator: rows the layer's and the LM head's kernels
        take, k queries a request the attention kernel takes."""
        x = torch.empty(rows, self.embed.shape[1], dtype=BF16)
        layer = self.layer
        return (self.ranker.fits(x) and all(c.takes(x) for c in layer.smalls + layer.int8s)
                and tree_attention.fits(k, layer.heads, layer.head_dim, k_buf, v_buf))

    def __call__(self, root_p: torch.Tensor, root_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 k_buf: torch.Tensor, v_buf: torch.Tensor, scratch: torch.Tensor, kv_slots: torch.Tensor,
                 base: list[int], scale: float, to_target: torch.Tensor | None,
                 race: tuple[torch.Tensor, torch.Tensor] | None, keep: int, threshold: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """positions [L, B K]: each level's draft positions; race: (noise [B, S, V], inv_temps [B]) -> the operator's
        (scores, tokens, parents)."""
        layer, ranker = self.layer, self.ranker
        L, rows = positions.shape
        cos, sin = (t.view(L, rows, 1, -1) for t in layer.rotary.cos_sin(positions.reshape(-1), hidden))
        norm1, norm2, embed_norm = layer.norm_weights()
        noise, inv_temps = (None, None) if race is None else race
        return draft_levels(root_p, root_ids, hidden, self.embed, layer.weights(), norm1, norm2, embed_norm, layer.eps,
                            layer.heads, layer.scale, layer.amx_from, cos, sin, k_buf, v_buf, scratch, kv_slots, base,
                            ranker.norm, ranker.eps, ranker.linear, scale, to_target, ranker.amx_from, noise, inv_temps,
                            keep, threshold)

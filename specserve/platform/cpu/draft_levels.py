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
every one races without filters. Under a grammar, whose rows come from its matcher in Python once a level's live
paths are known, the levels run one ``draft_level`` call each (the same steps and bookkeeping in C++, its state
handed back between levels), the grammar's rows asked between the calls (``run_levels``' allowed_rows).
``SPECSERVE_CPU_FUSED_LAYER=off`` keeps the engine's level-by-level path.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specserve.models.direct_call import Embedding
from specserve.platform.cpu import tree_attention
from specserve.platform.cpu.draft_topk import HeadTopk, draft_topk
from specserve.platform.cpu.draft_topk import native as draft_topk_native
from specserve.platform.cpu.fused_layer import FusedLayer, decoder_layer
from specserve.platform.cpu.ops import cpu_op, registered

BF16 = torch.bfloat16


def draft_level_reference(x, tokens, live, live_index, anc, seen, j, embed, linears, norm1, norm2, embed_norm, eps,
                          heads, attn_scale, amx_from, cos, sin, k_buf, v_buf, scratch, kv_slots, base, head_norm,
                          head_eps, head_linear, rank_scale, to_target=None, rank_amx_from=0, noise=None,
                          inv_temps=None, allowed=None, keep=1, threshold=0.0):
    """The operator's steps one call at a time: ``decoder_layer``, ``draft_topk``, and the bookkeeping of
    ``speculative/tree.py``'s ``EagleCandidates`` in numpy (see ``draft_level`` below)."""
    B, K = live.shape
    L, done, max_base = anc.shape[2] // K, (j - 1) * K, max(base)
    tree = torch.cat([anc[:, :, :done], torch.eye(K, dtype=torch.bool).expand(B, K, K)], dim=2)  # [B, K, j K]
    bases = torch.tensor(base)  # [B]
    mask = torch.zeros(B, K, max_base + j * K, dtype=torch.bool)  # each request's prefix visible, then its tree
    mask[:, :, :max_base] = (torch.arange(max_base) < bases[:, None]).unsqueeze(1)
    mask.scatter_(2, (bases[:, None, None] + torch.arange(j * K)).expand(B, K, j * K), tree)
    out = decoder_layer(x, linears, norm1, norm2, eps, cos, sin, k_buf, v_buf, scratch.reshape(-1),
                        kv_slots[:, : mask.shape[2]], mask.unsqueeze(1), heads, attn_scale,
                        torch.embedding(embed, tokens.reshape(-1)), embed_norm, amx_from)  # [B K, h]
    p, ids = draft_topk(out, head_norm, head_eps, head_linear, rank_scale if noise is None else 1.0, K, to_target,
                        rank_amx_from, noise, inv_temps, K, allowed)  # [B K, K] each
    level = (live.float().numpy()[:, :, None] * p.numpy().reshape(B, K, K)).reshape(B, K * K)  # float32 products
    best = np.argsort(-level, axis=1, kind="stable")[:, :K]  # [B, K]: score desc, the earlier first
    count = seen.shape[1]
    next_live = torch.from_numpy(level[np.arange(B)[:, None], best])
    next_index = torch.from_numpy(count + best)
    scores = torch.from_numpy(level)
    next_seen = torch.cat([seen.float(), scores], dim=1)
    parents = torch.from_numpy(np.repeat(live_index.numpy(), K, axis=1))
    level_tokens = ids.view(B, K * K)
    if j == L:
        return (x.new_empty(0), ids.new_empty(0), next_live, next_index, anc.new_empty(0), next_seen, scores,
                level_tokens, parents, torch.ones(1, dtype=torch.bool))
    branch = torch.from_numpy(best // K)  # [B, K] the live branch each new one extends
    next_anc = torch.zeros_like(anc)
    next_anc[:, :, : j * K] = tree.gather(1, branch.unsqueeze(-1).expand(B, K, j * K))
    next_x = out.view(B, K, -1).gather(1, branch.unsqueeze(-1).expand(B, K, out.shape[-1])).reshape(B * K, -1)
    next_tokens = level_tokens.gather(1, torch.from_numpy(best)).reshape(-1)
    stop = levels_can_stop(next_live, next_seen, keep, threshold)
    return (next_x, next_tokens, next_live, next_index, next_anc, next_seen, scores, level_tokens, parents,
            torch.tensor([stop]))


def levels_can_stop(live: torch.Tensor, seen: torch.Tensor, keep: int, threshold: float) -> bool:
    """``EagleCandidates.can_stop`` over live [B, K] and seen [B, n] (float32): with fewer than ``keep`` candidates a
    positive threshold above every live score; else each request's best live score ranks below ``keep`` candidates
    already, or below a positive threshold."""
    live, seen = live.numpy(), seen.numpy()
    if seen.shape[1] < keep:
        return bool(threshold > 0 and live.max() < threshold)
    best = live.max(axis=1)  # [B]
    exact = (seen >= best[:, None]).sum(axis=1) >= keep
    return bool((exact | (best < threshold) if threshold > 0 else exact).all())


def _fake_level(x, tokens, live, live_index, anc, seen, *args, **kwargs):
    B, K = live.shape
    scores = live.new_empty(B, K * K)
    return (x.new_empty(x.shape), tokens.new_empty(tokens.shape), live.new_empty(live.shape),
            live_index.new_empty(live_index.shape), anc.new_empty(anc.shape), live.new_empty(B, seen.shape[1] + K * K),
            scores, live_index.new_empty(B, K * K), live_index.new_empty(B, K * K), anc.new_empty(1))


# One level j (1 .. L) from the state the level before left: x [B K, h] the live branches' hidden states (bf16), tokens
# [B K] their tokens, live [B, K] float32 their scores, live_index [B, K] their candidate indices, anc [B, K, L K] bool
# their ancestors over the levels' columns, seen [B, n] every candidate's score so far; embed [V, h]: the target's
# token embeddings; linears, norms, eps, heads, attn_scale, amx_from: the head's layer as decoder_layer's (norm1 of the
# hidden, embed_norm of the embeddings); cos / sin [B K, 1, D]: the level's rows; k_buf / v_buf: the draft's pool,
# written at scratch [B, K]; kv_slots [B, max(base) + L K]: request b's base[b] prefix keys, then the levels' scratch
# slots; head_norm, head_eps, head_linear, rank_scale, to_target, rank_amx_from: the ranking as draft_topk's; noise
# [B, V] and inv_temps [B]: each request's race at this level; allowed [B K, W] int32: what each live branch's children
# may be (a grammar's bitmask rows); keep = N - 1 and threshold: when drafting stops (drafting_can_stop) -> (the next
# level's x, tokens, live, live_index and anc (x, tokens and anc empty after level L), seen with this level's scores,
# this level's scores [B, K K] float32, tokens and parents [B, K K] int64, whether no further level can change the
# tree: bool [1])
draft_level = cpu_op(
    "draft_level(Tensor x, Tensor tokens, Tensor live, Tensor live_index, Tensor anc, Tensor seen, int j, "
    "Tensor embed, Tensor?[] linears, Tensor norm1, Tensor norm2, Tensor embed_norm, float eps, int heads, "
    "float attn_scale, int amx_from, Tensor cos, Tensor sin, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor scratch, "
    "Tensor kv_slots, int[] base, Tensor head_norm, float head_eps, Tensor?[] head_linear, float rank_scale, "
    "Tensor? to_target=None, int rank_amx_from=0, Tensor? noise=None, Tensor? inv_temps=None, Tensor? allowed=None, "
    "int keep=1, float threshold=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
    "Tensor)", draft_level_reference, _fake_level)


def run_levels(level, root_p, root_ids, hidden, embed, linears, norm1, norm2, embed_norm, eps, heads, attn_scale,
               amx_from, cos, sin, k_buf, v_buf, scratch, kv_slots, base, head_norm, head_eps, head_linear,
               rank_scale, to_target=None, rank_amx_from=0, noise=None, inv_temps=None, keep=1, threshold=0.0,
               allowed_rows: Callable | None = None):
    """Levels 1 .. L from the root's children (``draft_levels``' arguments), each a call of ``level`` (``draft_level``
    or its reference), until no further level can change the tree -> (scores, tokens, parents) [B, n K K] of the n
    levels drafted. allowed_rows(branch, tokens) -> int32 bitmask [B K, W] or None: what each live branch's children
    may be (a grammar's rows, ``draft_level``'s allowed), asked before each level; branch [B, K] (the live branch each
    live one extends, None at level 1, whose live branches are the root's children) and tokens [B, K] (the live
    branches' last tokens) say how the live paths grew since the last call."""
    B, K = root_p.shape
    L = cos.shape[0]
    live = seen = root_p.float().contiguous()  # [B, K]
    live_index = torch.arange(K).expand(B, K).contiguous()  # [B, K]
    tokens, x = root_ids.reshape(-1).long(), hidden.repeat_interleave(K, 0)  # [B K], [B K, h]
    anc = torch.zeros(B, K, L * K, dtype=torch.bool)
    out, branch = [], None
    stop = levels_can_stop(live, seen, keep, threshold)
    for j in range(1, L + 1):
        if stop:
            break
        allowed = None if allowed_rows is None else allowed_rows(branch, tokens.view(B, K))
        count = seen.shape[1]
        x, tokens, live, next_index, anc, seen, scores, level_tokens, parents, done = level(
            x, tokens, live, live_index, anc, seen, j, embed, linears, norm1, norm2, embed_norm, eps, heads,
            attn_scale, amx_from, cos[j - 1], sin[j - 1], k_buf, v_buf, scratch[:, j - 1], kv_slots, base, head_norm,
            head_eps, head_linear, rank_scale, to_target, rank_amx_from, None if noise is None else noise[:, j],
            inv_temps, allowed, keep, threshold)
        branch, live_index = (next_index - count) // K, next_index
        out.append((scores, level_tokens, parents))
        stop = bool(done)
    if not out:
        return torch.empty(B, 0), torch.empty(B, 0, dtype=torch.int64), torch.empty(B, 0, dtype=torch.int64)
    return tuple(torch.cat(t, dim=1) for t in zip(*out, strict=True))


def draft_levels_reference(root_p, root_ids, hidden, embed, linears, norm1, norm2, embed_norm, eps, heads, attn_scale,
                           amx_from, cos, sin, k_buf, v_buf, scratch, kv_slots, base, head_norm, head_eps,
                           head_linear, rank_scale, to_target=None, rank_amx_from=0, noise=None, inv_temps=None,
                           keep=1, threshold=0.0):
    """The operator's steps one call at a time: ``draft_level_reference`` level by level (see ``draft_levels``)."""
    return run_levels(draft_level_reference, root_p, root_ids, hidden, embed, linears, norm1, norm2, embed_norm, eps,
                      heads, attn_scale, amx_from, cos, sin, k_buf, v_buf, scratch, kv_slots, base, head_norm,
                      head_eps, head_linear, rank_scale, to_target, rank_amx_from, noise, inv_temps, keep, threshold)


def _fake(root_p, *args, **kwargs):
    B, K = root_p.shape
    return root_p.new_empty(B, 0), root_p.new_empty(B, 0, dtype=torch.int64), root_p.new_empty(B, 0, dtype=torch.int64)


# root_p / root_ids [B, K]: the root's children (level 0); hidden [B, h] bf16: the root's draft hidden; the layer's,
# ranking's and pool's arguments as draft_level's; cos / sin [L, B K, 1, D]: each level's rows; scratch [B, L, K]: each
# level's K and V slots; noise [B, S, V]: each request's race (level j's noise at [:, j]) -> (scores [B, n K K]
# float32, tokens and parents [B, n K K] int64) of the n levels drafted, in candidate order after level 0's K
# candidates
draft_levels = cpu_op(
    "draft_levels(Tensor root_p, Tensor root_ids, Tensor hidden, Tensor embed, Tensor?[] linears, Tensor norm1, "
    "Tensor norm2, Tensor embed_norm, float eps, int heads, float attn_scale, int amx_from, Tensor cos, Tensor sin, "
    "Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor scratch, Tensor kv_slots, int[] base, Tensor head_norm, "
    "float head_eps, Tensor?[] head_linear, float rank_scale, Tensor? to_target=None, int rank_amx_from=0, "
    "Tensor? noise=None, Tensor? inv_temps=None, int keep=1, float threshold=0.0) -> (Tensor, Tensor, Tensor)",
    draft_levels_reference, _fake)


def native() -> bool:
    """``ops.cpp`` registered the operators' C++ implementations (with draft_topk's, which they call)."""
    return draft_topk_native() and registered("draft_levels") and registered("draft_level")


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
                 race: tuple[torch.Tensor, torch.Tensor] | None, keep: int, threshold: float,
                 allowed_rows: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """positions [L, B K]: each level's draft positions; race: (noise [B, S, V], inv_temps [B]) -> the operator's
        (scores, tokens, parents). allowed_rows (a grammar's rows for each level, see ``run_levels``): the levels one
        ``draft_level`` call each, the rows asked for between them."""
        layer, ranker = self.layer, self.ranker
        L, rows = positions.shape
        cos, sin = (t.view(L, rows, 1, -1) for t in layer.rotary.cos_sin(positions.reshape(-1), hidden))
        norm1, norm2, embed_norm = layer.norm_weights()
        noise, inv_temps = (None, None) if race is None else race
        args = (root_p, root_ids, hidden, self.embed, layer.weights(), norm1, norm2, embed_norm, layer.eps, layer.heads,
                layer.scale, layer.amx_from, cos, sin, k_buf, v_buf, scratch, kv_slots, base, ranker.norm, ranker.eps,
                ranker.linear, scale, to_target, ranker.amx_from, noise, inv_temps, keep, threshold)
        if allowed_rows is not None:
            return run_levels(draft_level, *args, allowed_rows=allowed_rows)
        return draft_levels(*args)

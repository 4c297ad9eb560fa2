"""ForwardBatch and the torch SDPA attention backend.

A forward runs over T flattened tokens belonging to B requests. Request b contributes ``q_len[b]`` new tokens
that attend to ``kv_len[b]`` keys: its prefix (KV already in the pool) followed by the new tokens themselves
(their KV is written to the pool first, then read back with the prefix). Which new tokens see which is, by
default, causal; a request can instead give an arbitrary boolean mask over its new tokens (a draft tree),
so verifying a whole tree is one forward.

Attention runs as one padded SDPA call per layer: queries gathered to ``[B, Qmax, H, D]``, keys/values
gathered from the slot pool to ``[B, Kmax, Hkv, D]``, a boolean mask ``[B, 1, Qmax, Kmax]`` where needed.
A mixed batch (``--enable-mixed-chunk``: the running requests' decode tokens and a prefill chunk in one forward)
carries GROUPS of consecutive rows instead, each with its own metadata and SDPA call, so one-token decode rows
are not padded to the prefill's query length (``mixed_attn_metadata``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from specserve.attention.training import StepKV
    from specserve.cache.kv_pool import KVPool
    from specserve.platform import PlatformPolicy


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly a chunk, possibly after a cached prefix)
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # a draft tree per request, arbitrary mask
    DRAFT_EXTEND = "draft_extend"
    DRAFT_DECODE = "draft_decode"


@dataclass
class AttnMetadata:
    """How the T new tokens of a forward attend (built by ``build_attn_metadata``)."""

    batch_size: int
    max_q_len: int
    kv_slots: torch.Tensor  # [B, Kmax] int64 pool slots per request (prefix then new tokens); padding = slot 0
    mask: torch.Tensor | None  # [B, 1, Qmax, Kmax] bool, True = may attend; None = all keys visible
    is_causal: bool  # plain causal over keys == queries (no prefix, equal lengths)
    q_index: torch.Tensor | None  # [B, Qmax] row of q (T = an all-zero pad row); None = q is [B*Qmax] already
    out_index: torch.Tensor | None  # [T] row of the flattened [B*Qmax] output for each token; None = identity
    # mixed batches: (row count, metadata) per group of consecutive rows, attended separately; the fields
    # above then describe the whole batch only loosely (batch_size, max_q_len) and kv_slots is None
    groups: list[tuple[int, AttnMetadata]] | None = None


@dataclass
class ForwardBatch:
    """Everything one model forward needs."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 slots receiving this forward's K/V
    attn: AttnMetadata
    kv_pool: KVPool | None  # None: a pool-free training forward (see specserve.attention.training)
    logits_indices: torch.Tensor | None = None  # [R] token rows that need logits; None = every row
    capture_layers: tuple[int, ...] = field(default_factory=tuple)  # residual stream at the INPUT of these layers
    input_embeds: torch.Tensor | None = None  # [T, h] optional, replaces the embedding lookup
    step_kv: StepKV | None = None  # pool-free forwards only: K/V of earlier unrolled draft steps
    rope_rows: dict = field(default_factory=dict)  # RoPE cos/sin rows of this forward's positions, per rotary module
    # the runner's tuning policy (set by ModelRunner.forward and the proposers): picks the attention path
    # (folding query heads); None: the default path throughout
    platform: PlatformPolicy | None = None


def build_attn_metadata(
    kv_slots: torch.Tensor,
    kv_lens: list[int],
    q_lens: list[int],
    custom_masks: list[torch.Tensor | None] | None = None,
) -> AttnMetadata:
    """Build attention metadata for B requests.

    kv_slots: [B, >=Kmax] slots of each request's keys (prefix then new tokens), e.g. rows of req_to_token.
    kv_lens[b]: keys of request b (prefix + new); q_lens[b]: its new tokens (the last q_lens[b] keys).
    custom_masks[b]: optional [q_len, t] bool mask (t >= q_len) over request b's LAST t keys, which end with its
    q_len new tokens: a verify tree uses t == q_len (its nodes among themselves); a draft tree step uses t > q_len
    (the new branch tokens see their ancestors written by earlier draft steps). Keys before those t are the
    visible prefix. Default: causal.
    """
    device = kv_slots.device
    bsz = len(q_lens)
    max_q, max_kv = max(q_lens), max(kv_lens)
    kv_slots = kv_slots[:, :max_kv]
    same_q = all(q == max_q for q in q_lens)
    same_kv = all(k == max_kv for k in kv_lens)
    no_custom = custom_masks is None or all(m is None for m in custom_masks)
    q_index = out_index = None
    if not same_q:
        q_index, out_index = _padding_indices(q_lens, max_q, device)
    if no_custom and max_q == 1 and same_kv:
        return AttnMetadata(bsz, max_q, kv_slots, None, False, q_index, out_index)
    if no_custom and same_q and same_kv and max_q == max_kv:
        return AttnMetadata(bsz, max_q, kv_slots, None, True, q_index, out_index)
    if same_q and same_kv and (no_custom or len({None if m is None else m.shape[-1] for m in custom_masks}) == 1):
        # equal lengths, every request with the same rule over its last t keys after a visible prefix: causal
        # over its new tokens (a batch-1 prefill chunk or draft extend) or its own mask (verify trees: t = q; a
        # draft level: t > q)
        if no_custom:
            own = torch.ones(max_q, max_q, dtype=torch.bool, device=device).tril().expand(bsz, max_q, max_q)
        else:
            own = torch.stack(custom_masks).to(device)  # [B, Q, t]
        mask = prefix_visible(own, max_kv)  # [B, Q, Kmax]
        return AttnMetadata(bsz, max_q, kv_slots, mask.unsqueeze(1), False, q_index, out_index)
    if no_custom and max_q == 1:  # decode with unequal lengths: each query sees its request's keys
        mask = torch.arange(max_kv, device=device) < torch.tensor(kv_lens, device=device)[:, None]  # [B, Kmax]
        return AttnMetadata(bsz, max_q, kv_slots, mask[:, None, None, :], False, q_index, out_index)
    mask = _causal_padded_mask(kv_lens, q_lens, max_q, max_kv, device)
    if not no_custom:
        for b, custom in enumerate(custom_masks):
            if custom is not None:
                tail = custom.shape[-1]
                mask[b, : q_lens[b], kv_lens[b] - tail : kv_lens[b]] = custom.to(device)
    return AttnMetadata(bsz, max_q, kv_slots, mask.unsqueeze(1), False, q_index, out_index)


def decode_attn_metadata(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                         kv_lens: list[int]) -> AttnMetadata:
    """Plain decode, one new token per request: rows [B] of req_to_token [R, C] whose requests hold kv_lens[b]
    keys, the new one at positions[b] (= kv_lens[b] - 1, as a [B] tensor) -> AttnMetadata.

    build_attn_metadata's one-query case in two or three tensor ops instead of about eight: between two forwards
    every op costs ~10-20 us on the CPU, so this is part of what a small model's decode step costs."""
    max_kv = max(kv_lens)
    kv_slots = table[rows, :max_kv]  # [B, Kmax]
    if min(kv_lens) == max_kv:
        return AttnMetadata(len(kv_lens), 1, kv_slots, None, False, None, None)
    mask = torch.arange(max_kv, device=table.device) <= positions[:, None]  # [B, Kmax]: each request's own keys
    return AttnMetadata(len(kv_lens), 1, kv_slots, mask[:, None, None, :], False, None, None)


def prefix_visible(custom: torch.Tensor, kv_len: int) -> torch.Tensor:
    """custom [B, Q, t] bool over each request's last t keys -> [B, Q, kv_len]: the kv_len - t keys before them
    (the prefix) visible to every query, then custom."""
    B, Q, t = custom.shape
    return torch.cat([custom.new_ones(1, 1, 1).expand(B, Q, kv_len - t), custom], dim=2)


def mixed_attn_metadata(parts: list[tuple[int, AttnMetadata]]) -> AttnMetadata:
    """Groups of consecutive rows [(rows, metadata), ...] in forward order -> one metadata attending each group
    on its own (e.g. B one-token decode rows, then a prefill chunk). A part that is itself grouped is flattened."""
    flat = [g for rows, md in parts for g in (md.groups if md.groups is not None else [(rows, md)])]
    return AttnMetadata(sum(md.batch_size for _, md in flat), max(md.max_q_len for _, md in flat), None, None,
                        False, None, None, groups=flat)


#: A prefill batch attends request by request (one SDPA call each) when padding every request to the longest one
#: would waste, on average, at least this many (query, key) scores per request. Inside a forward, a request's own
#: call costs about as much as 10-16K padded scores of a small model on the CPU, so prompts of similar lengths stay
#: padded (the split measured no faster there); one long prompt padded beside short ones costs far more: 4.5-22x
#: the split prefill's time (docs/benchmarks.md).
MIN_PADDING_PER_REQUEST = 16384


def padding_waste(kv_lens: list[int], q_lens: list[int]) -> int:
    """(query, key) scores a padded [B, Qmax, Kmax] attention computes beyond each request's own q_len x kv_len."""
    return len(q_lens) * max(q_lens) * max(kv_lens) - sum(q * k for q, k in zip(q_lens, kv_lens, strict=True))


def per_request_metadata(kv_slots: torch.Tensor, kv_lens: list[int], q_lens: list[int]) -> AttnMetadata:
    """build_attn_metadata's causal case, one group per request: no padding, and a request without a prefix runs
    SDPA's causal kernel, which skips the blocks above the diagonal."""
    return mixed_attn_metadata([(q, build_attn_metadata(kv_slots[b : b + 1], [k], [q]))
                                for b, (k, q) in enumerate(zip(kv_lens, q_lens, strict=True))])


def extend_inputs(table: torch.Tensor, rows: list[int], starts: list[int], tokens: list[list[int]],
                  may_split: bool = False):
    """The pieces of an extend forward: requests that each append tokens[b] at positions starts[b].. of row
    rows[b] of the req_to_token table (whose slots there are already written), attending causally over the row's
    earlier slots -> (ids [T], positions [T], out_cache_loc [T], AttnMetadata).

    may_split: attend request by request where padding would waste more (``MIN_PADDING_PER_REQUEST``); for
    eager forwards only (a compiled one would unroll a loop whose length varies with the batch)."""
    device = table.device
    q_lens = [len(t) for t in tokens]
    pieces = list(zip(rows, starts, q_lens, strict=True))
    ids = torch.tensor([t for row in tokens for t in row], dtype=torch.int64, device=device)  # [T]
    positions = torch.cat([torch.arange(s, s + n) for _, s, n in pieces]).to(device)  # [T]
    out_loc = torch.cat([table[r, s : s + n] for r, s, n in pieces])  # [T]
    kv_lens = [s + n for _, s, n in pieces]
    kv_slots = attended_slots(table, torch.tensor(rows, device=device), kv_lens)
    if may_split and padding_waste(kv_lens, q_lens) >= MIN_PADDING_PER_REQUEST * len(q_lens):
        return ids, positions, out_loc, per_request_metadata(kv_slots, kv_lens, q_lens)
    return ids, positions, out_loc, build_attn_metadata(kv_slots, kv_lens, q_lens)


def attended_slots(table: torch.Tensor, rows: torch.Tensor, kv_lens: list[int]) -> torch.Tensor:
    """req_to_token [R, C], rows [B], kv_lens [B] -> [B, max(kv_lens)]: the slots of the requests' keys, the
    kv_slots of build_attn_metadata. Only the attended columns are gathered: a row is as wide as the context
    length (16 requests: 7 us instead of 32 us at a 2K context, 1.7 ms at 128K)."""
    return table[rows, : max(kv_lens)]


def extend_batch(mode: ForwardMode, table: torch.Tensor, rows: list[int], starts: list[int], tokens: list[list[int]],
                 kv_pool: KVPool, may_split: bool = False, **extra) -> ForwardBatch:
    """ForwardBatch over ``extend_inputs`` (may_split as there); used for target prefill chunks and draft extends
    alike. extra: ForwardBatch's optional fields."""
    return ForwardBatch(mode, *extend_inputs(table, rows, starts, tokens, may_split), kv_pool, **extra)


def last_token_rows(q_lens: list[int], device) -> torch.Tensor:
    """[B] row of each request's last token in a forward's flattened [T] rows."""
    return torch.tensor(q_lens, device=device).cumsum(0) - 1


def _padding_indices(q_lens: list[int], max_q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """q_index [B, Qmax] into the T flat rows (T = pad row); out_index [T] into the flat [B*Qmax] output."""
    lens = torch.tensor(q_lens, device=device)
    starts = torch.cumsum(lens, 0) - lens  # [B]
    total = int(lens.sum())
    col = torch.arange(max_q, device=device)
    valid = col[None, :] < lens[:, None]  # [B, Qmax]
    q_index = torch.where(valid, starts[:, None] + col[None, :], torch.full_like(valid, total, dtype=torch.long))
    out_index = (torch.arange(len(q_lens), device=device)[:, None] * max_q + col[None, :])[valid]
    return q_index, out_index


def _causal_padded_mask(kv_lens: list[int], q_lens: list[int], max_q: int, max_kv: int, device) -> torch.Tensor:
    """[B, Qmax, Kmax] bool: query i of request b sees keys j <= prefix_b + i within kv_len_b.

    Padded query rows see key 0 only, so no row is fully masked (SDPA would return NaN there); their
    outputs are dropped.
    """
    kv = torch.tensor(kv_lens, device=device)[:, None, None]  # [B,1,1]
    q = torch.tensor(q_lens, device=device)[:, None, None]
    qi = torch.arange(max_q, device=device)[None, :, None]  # [1,Q,1]
    kj = torch.arange(max_kv, device=device)[None, None, :]  # [1,1,K]
    mask = (kj <= kv - q + qi) & (kj < kv)
    pad_row = qi >= q
    return torch.where(pad_row, kj == 0, mask)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch, scale: float
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the new tokens -> output [T, H*D].

    Writes the new K/V into the pool at fb.out_cache_loc, then attends over each request's slots. Attention runs
    in the pool's dtype: a float32 draft keeps its KV in bf16 (``EagleProposer``), so its float32 queries are cast
    to it and the output back.
    """
    if fb.kv_pool is None:
        from specserve.attention.training import poolless_attention

        return poolless_attention(q, k, v, layer_id, fb, scale)
    k_buf, v_buf = fb.kv_pool.layer(layer_id)  # [S, Hkv, D]
    k_buf[fb.out_cache_loc] = k.to(k_buf.dtype)
    v_buf[fb.out_cache_loc] = v.to(v_buf.dtype)
    out_dtype, q = q.dtype, q.to(k_buf.dtype)
    if fb.attn.groups is None:
        return _attend(q, k_buf, v_buf, fb.attn, scale, fb.platform).to(out_dtype)
    outs, start = [], 0
    for n_rows, md in fb.attn.groups:
        outs.append(_attend(q[start : start + n_rows], k_buf, v_buf, md, scale, fb.platform))
        start += n_rows
    return torch.cat(outs).to(out_dtype)


def _attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, md: AttnMetadata, scale: float,
            platform: PlatformPolicy | None) -> torch.Tensor:
    """q [T, H, D] of md's requests; k_buf/v_buf [S, Hkv, D] the layer's pool (new K/V already written)
    -> [T, H*D]. platform: whether several queries per request fold their query heads (``_attend_folded``)."""
    n_tok, n_heads, head_dim = q.shape
    bsz, max_q = md.batch_size, md.max_q_len
    flat = md.kv_slots.reshape(-1)
    kb = k_buf.index_select(0, flat).view(bsz, -1, k_buf.shape[1], head_dim)  # [B, Kmax, Hkv, D]
    vb = v_buf.index_select(0, flat).view(bsz, -1, v_buf.shape[1], head_dim)
    if max_q == 1:
        return _attend_one_query(q, kb, vb, md, scale)
    if md.q_index is None:
        qb = q.view(bsz, max_q, n_heads, head_dim)
    else:
        qb = torch.cat([q, q.new_zeros(1, n_heads, head_dim)])[md.q_index]  # [B, Qmax, H, D]
    masked = md.mask is not None and not md.is_causal
    if platform is not None and platform.folds_query_heads(qb, kb.shape[2], masked):
        out = _attend_folded(qb, kb, vb, md.mask, scale)
    else:
        out = F.scaled_dot_product_attention(
            qb.transpose(1, 2),
            kb.transpose(1, 2),
            vb.transpose(1, 2),
            attn_mask=md.mask,
            is_causal=md.is_causal,
            scale=scale,
            enable_gqa=kb.shape[2] != n_heads,
        ).transpose(1, 2).reshape(bsz * max_q, n_heads * head_dim)  # [B*Qmax, H*D]
    if md.out_index is not None:
        out = out.index_select(0, md.out_index)
    return out  # [T, H*D]


def _attend_folded(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Several queries per request, each KV head's G query heads stacked as G * Q rows of that head (the decode
    fold of ``_attend_one_query`` for Q > 1): qb [B, Q, H, D], kb/vb [B, K, Hkv, D], mask [B, 1, Q, K]
    -> [B*Q, H*D]. Query head h uses KV head h // G (SDPA's enable_gqa grouping); row g*Q + q of KV head kv is
    query q of head kv*G + g, so the mask is repeated G times along the rows."""
    bsz, max_q, n_heads, head_dim = qb.shape
    n_kv, n_keys = kb.shape[2], kb.shape[1]
    group = n_heads // n_kv
    q = qb.view(bsz, max_q, n_kv, group, head_dim).permute(0, 2, 3, 1, 4).reshape(bsz, n_kv, group * max_q, head_dim)
    rows_mask = mask.unsqueeze(2).expand(bsz, 1, group, max_q, n_keys).reshape(bsz, 1, group * max_q, n_keys)
    out = F.scaled_dot_product_attention(q, kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=rows_mask,
                                         scale=scale)  # [B, Hkv, G*Q, D]
    return out.view(bsz, n_kv, group, max_q, head_dim).permute(0, 3, 1, 2, 4).reshape(bsz * max_q, n_heads * head_dim)


def _attend_one_query(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, md: AttnMetadata,
                      scale: float) -> torch.Tensor:
    """One query token per request (decode): q [B, H, D], kb/vb [B, Kmax, Hkv, D] -> [B, H*D].

    The G = H / Hkv query heads that share a KV head (heads kv*G .. kv*G+G-1, the grouping of SDPA's
    enable_gqa) become G query rows of that KV head: q viewed as [B, Hkv, G, D], no copy. Every row of a request
    sees the same keys, so the mask [B, 1, 1, Kmax] broadcasts. SDPA then runs B*Hkv blocks of G rows instead of
    B*H blocks of one row: 30-37% less time per call at batch 16 on the CPU kernel (docs/benchmarks.md)."""
    bsz, n_heads, head_dim = q.shape
    n_kv = kb.shape[2]
    out = F.scaled_dot_product_attention(
        q.view(bsz, n_kv, n_heads // n_kv, head_dim),
        kb.transpose(1, 2),
        vb.transpose(1, 2),
        attn_mask=md.mask,
        scale=scale,
    )  # [B, Hkv, G, D]
    return out.reshape(bsz, n_heads * head_dim)

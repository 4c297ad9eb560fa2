"""The PyTorch SDPA attention backend (``--attention-backend torch_native``, alias ``sdpa``; CPU and CUDA).

Attention runs as one padded SDPA call per layer: queries gathered to ``[B, Qmax, H, D]``, keys/values gathered
from the slot pool to ``[B, Kmax, Hkv, D]``, a boolean mask ``[B, 1, Qmax, Kmax]`` where needed. Request b's
keys are its prefix (KV already in the pool) followed by its new tokens; which new tokens see which is causal by
default, or an arbitrary mask over them (a draft tree), so verifying a whole tree is one forward. A mixed batch
(``--enable-mixed-chunk``: the running requests' decode tokens and a prefill chunk in one forward) carries GROUPS
of consecutive rows instead, each with its own metadata and SDPA call, so one-token decode rows are not padded to
the prefill's query length (``mixed_attn_metadata``). A compiled CPU forward's decode rows skip the gather and the
SDPA call: their attention is written as sums that inductor fuses with the reads from the pool slots
(``_attend_one_query_by_slot``).

CUDA graphs fix a forward's shapes; with SDPA the key count is part of them, so graphed forwards pad it to
``kv_bucket`` sizes (a backend reading K/V by slot would not need to).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.attention.backend import AttentionBackend, AttentionMetadata, AttentionTuning, DraftTreeKeys

MIN_KV_BUCKET = 128  # keys per request of the smallest graphed bucket (a power of two)
KV_STEPS_PER_OCTAVE = 4  # bucket sizes per doubling of the key count: padding <= 1 / KV_STEPS_PER_OCTAVE


@dataclass
class AttnMetadata(AttentionMetadata):
    """How the T new tokens of a forward attend under SDPA (built by ``build_attn_metadata``)."""

    batch_size: int
    max_q_len: int
    kv_slots: torch.Tensor | None  # [B, Kmax] int64 pool slots per request (prefix then new tokens); padding = slot 0
    mask: torch.Tensor | None  # [B, 1, Qmax, Kmax] bool, True = may attend; None = all keys visible
    is_causal: bool  # plain causal over keys == queries (no prefix, equal lengths)
    q_index: torch.Tensor | None  # [B, Qmax] row of q (T = an all-zero pad row); None = q is [B*Qmax] already
    out_index: torch.Tensor | None  # [T] row of the flattened [B*Qmax] output for each token; None = identity
    # mixed batches: (row count, metadata) per group of consecutive rows, attended separately; the fields
    # above then describe the whole batch only loosely (batch_size, max_q_len) and kv_slots is None
    groups: list[tuple[int, AttnMetadata]] | None = None
    platform: AttentionTuning | None = None  # the host's tuning rules (query-head folding); None = defaults
    # max_q_len == 1 (decode rows), kept apart so a compiled graph reads a flag rather than the int, which would pin
    # the graph to one query count (one verify graph per tree size)
    one_query: bool = field(init=False)

    def __post_init__(self) -> None:
        self.one_query = self.max_q_len == 1

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> torch.Tensor:
        if self.groups is None:
            return _attend(q, k_buf, v_buf, self, scale, self.platform)
        outs, start = [], 0
        for n_rows, md in self.groups:
            outs.append(_attend(q[start : start + n_rows], k_buf, v_buf, md, scale, self.platform))
            start += n_rows
        return torch.cat(outs)

    # ------------------------------------------------------------------ CUDA graphs
    def graph_shape(self) -> tuple | None:
        """(queries per request, key bucket): forwards whose requests all have max_q_len new tokens and a
        non-causal layout (decode, verify trees, draft levels)."""
        if self.groups is not None or self.q_index is not None or self.is_causal or self.kv_slots is None:
            return None
        return self.max_q_len, kv_bucket(self.kv_slots.shape[1])

    def static_buffers(self, batch_size: int, shape: tuple) -> AttnMetadata:
        q, kv = shape
        dev = self.kv_slots.device
        mask = torch.zeros(batch_size, 1, q, kv, dtype=torch.bool, device=dev)  # [Bb, 1, q, Kb]
        slots = torch.zeros(batch_size, kv, dtype=torch.int64, device=dev)  # [Bb, Kb]
        return AttnMetadata(batch_size, q, slots, mask, False, None, None, platform=self.platform)

    def copy_into(self, static: AttentionMetadata) -> None:
        """Pad requests see and write slot 0 only (a fully masked row would give NaN); padded keys are masked."""
        assert isinstance(static, AttnMetadata)
        bsz, keys = self.batch_size, self.kv_slots.shape[1]
        slots, mask = static.kv_slots, static.mask
        slots.zero_()
        slots[:bsz, :keys].copy_(self.kv_slots)
        mask.zero_()
        if self.mask is None:  # every key visible (a decode step whose requests have equal lengths)
            mask[:bsz, :, :, :keys] = True
        else:
            mask[:bsz, :, :, :keys].copy_(self.mask)
        mask[bsz:, :, :, 0] = True


def kv_bucket(n: int, min_bucket: int = MIN_KV_BUCKET, steps: int = KV_STEPS_PER_OCTAVE) -> int:
    """Keys per request in the graph serving a forward whose requests have at most n keys: min_bucket, then
    `steps` evenly spaced sizes per doubling (128, 160, 192, 224, 256, 320, ... with the defaults)."""
    if n <= min_bucket:
        return min_bucket
    octave = 1 << ((n - 1).bit_length() - 1)  # the largest power of two below n
    step = max(octave // steps, 1)
    return octave + -(-(n - octave) // step) * step


class SdpaBackend(AttentionBackend):
    name = "torch_native"

    def decode(self, table, rows, positions, kv_lens) -> AttnMetadata:
        return self._own(decode_attn_metadata(table, rows, positions, kv_lens))

    def extend(self, table, rows, kv_lens, q_lens, may_split=False) -> AttnMetadata:
        kv_slots = attended_slots(table, torch.tensor(rows, device=table.device), kv_lens)
        if may_split and padding_waste(kv_lens, q_lens) >= MIN_PADDING_PER_REQUEST * len(q_lens):
            return self._own(per_request_metadata(kv_slots, kv_lens, q_lens))
        return self._own(build_attn_metadata(kv_slots, kv_lens, q_lens))

    def tree(self, table, rows, kv_lens, q_lens, masks) -> AttnMetadata:
        return self._own(build_attn_metadata(attended_slots(table, rows, kv_lens), kv_lens, q_lens,
                                             custom_masks=masks))

    def draft_tree(self, table, rows, base, scratch) -> TreeKeys:
        return TreeKeys.build(table, rows, base, scratch, self.platform)

    def mixed(self, parts) -> AttnMetadata:
        return self._own(mixed_attn_metadata(parts))

    def _own(self, md: AttnMetadata) -> AttnMetadata:
        md.platform = self.platform
        return md


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


def attended_slots(table: torch.Tensor, rows: torch.Tensor, kv_lens: list[int]) -> torch.Tensor:
    """req_to_token [R, C], rows [B], kv_lens [B] -> [B, max(kv_lens)]: the slots of the requests' keys, the
    kv_slots of build_attn_metadata. Only the attended columns are gathered: a row is as wide as the context
    length (16 requests: 7 us instead of 32 us at a 2K context, 1.7 ms at 128K)."""
    return table[rows, : max(kv_lens)]


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


def _attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, md: AttnMetadata, scale: float,
            platform: AttentionTuning | None) -> torch.Tensor:
    """q [T, H, D] of md's requests; k_buf/v_buf [S, Hkv, D] the layer's pool (new K/V already written)
    -> [T, H*D]. platform: whether several queries per request fold their query heads (``_attend_folded``)."""
    n_tok, n_heads, head_dim = q.shape
    # sizes from the tensors and the one_query flag, not md's ints: in a compiled graph an int pins the tensor
    # dimension it meets to its value (one verify graph per batch size and tree size; ``models/compile.py``)
    bsz = md.kv_slots.shape[0]
    if md.one_query and q.is_cpu and torch.compiler.is_compiling():
        return _attend_one_query_by_slot(q, k_buf, v_buf, md, scale)
    if md.q_index is None:
        qb = q.view(bsz, -1, n_heads, head_dim)  # [B, Qmax, H, D]
    else:
        qb = torch.cat([q, q.new_zeros(1, n_heads, head_dim)])[md.q_index]  # [B, Qmax, H, D]
    kernel = None if platform is None or md.is_causal else platform.few_query_attention(qb, k_buf, v_buf)
    if kernel is not None:  # the host's own: keys and values read by slot, no gathered copies
        out = kernel(qb, k_buf, v_buf, md.kv_slots, md.mask, scale)  # [B*Qmax, H*D]
        return out if md.out_index is None else out.index_select(0, md.out_index)
    flat = md.kv_slots.reshape(-1)
    kb = k_buf.index_select(0, flat).view(bsz, -1, k_buf.shape[1], head_dim)  # [B, Kmax, Hkv, D]
    vb = v_buf.index_select(0, flat).view(bsz, -1, v_buf.shape[1], head_dim)
    if md.one_query:
        return _attend_one_query(q, kb, vb, md, scale)
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
        ).transpose(1, 2).reshape(-1, n_heads * head_dim)  # [B*Qmax, H*D]
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


def _attend_one_query_by_slot(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, md: AttnMetadata,
                              scale: float) -> torch.Tensor:
    """``_attend_one_query`` for a compiled CPU forward: q [B, H, D], k_buf/v_buf [S, Hkv, D] the layer's pool
    -> [B, H*D].

    Written as a broadcast product summed over the head dimension, a softmax over the keys and a weighted sum over
    them, which inductor turns into a few fused loops that read each key and value straight from its pool slot:
    no gathered [B, Kmax, Hkv, D] copy and no SDPA call. Scores, probabilities and sums stay float32 (SDPA's CPU
    kernel rounds the probabilities to a 16-bit pool's dtype before multiplying V, so in bf16 the two paths can
    break an exact tie between two logits differently). Over SmolLM2's 30 layers (2 CPU threads) this took 0.56 ms
    against 1.03 ms for the gather and SDPA at 100 keys, 6.6 against 11.3 ms at 2000, and 12 against 25 ms for 16
    requests of 300 keys. With several queries per request (verify trees) SDPA stays faster (7.9 against 3.9 ms for
    8 queries at 300 keys), so only decode rows take this path."""
    bsz, n_heads, head_dim = q.shape
    n_kv = k_buf.shape[1]
    qb = q.float().view(bsz, 1, n_kv, n_heads // n_kv, head_dim)  # [B, 1, Hkv, G, D]
    kb = k_buf[md.kv_slots].float().unsqueeze(3)  # [B, K, Hkv, 1, D]
    vb = v_buf[md.kv_slots].float().unsqueeze(3)
    scores = (qb * kb).sum(-1) * scale  # [B, K, Hkv, G]
    if md.mask is not None:  # [B, 1, 1, K]: padded keys of shorter requests
        scores = scores.masked_fill(~md.mask.view(bsz, -1, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1).unsqueeze(-1)  # [B, K, Hkv, G, 1]
    return (probs * vb).sum(1).reshape(bsz, n_heads * head_dim).to(q.dtype)  # [B, H*D]


@dataclass
class TreeKeys(DraftTreeKeys):
    """The keys a draft tree's levels attend to, laid out once per tree.

    Request b's keys are its prefix (req_to_token columns [0, base[b])) followed by the scratch slots of the
    levels drafted so far: level j's K branches sit at columns base[b] + (j-1)*K .. base[b] + j*K - 1. All
    levels' scratch slots are written into req_to_token up front (columns past a request's tokens are scratch
    anyway: the verify step rewrites them), so each level only needs its mask.
    """

    kv_slots: torch.Tensor  # [B, Wmax] slot of each key column, Wmax = max(base) + all levels' columns
    base: list[int]  # [B] prefix keys per request
    rel: torch.Tensor | None  # [B, Wmax] column - base[b] (None when every base is equal: the usual batch 1)
    platform: AttentionTuning | None = None

    @classmethod
    def build(cls, table: torch.Tensor, rows: list[int], base: list[int], scratch: torch.Tensor,
              platform: AttentionTuning | None = None) -> TreeKeys:
        """table: req_to_token; rows [B] its rows; base [B]; scratch [B, L] every level's slots, level-major."""
        B, L = scratch.shape
        dev = table.device
        rows_t = torch.tensor(rows, device=dev).view(B, 1)
        base_t = torch.tensor(base, device=dev).view(B, 1)
        table[rows_t, base_t + torch.arange(L, device=dev).view(1, L)] = scratch
        width = max(base) + L
        rel = None if min(base) == max(base) else torch.arange(width, device=dev).view(1, width) - base_t
        return cls(table[rows_t.view(B), :width], base, rel, platform)

    def level(self, mask: torch.Tensor) -> AttnMetadata:
        """mask [B, K, t] bool over each request's first t scratch columns (a level's branches see their
        ancestors and themselves) -> the level's attention metadata: the prefix is visible, later columns not."""
        B, K, t = mask.shape
        width = max(self.base) + t
        if self.rel is None:  # equal prefixes: [prefix | tree] side by side
            full = prefix_visible(mask, width)  # [B, K, width]
        else:
            rel = self.rel[:, :width].unsqueeze(1)  # [B, 1, width]
            in_tree = (rel >= 0) & (rel < t)
            tree = mask.gather(2, rel.clamp(0, t - 1).expand(B, K, width))  # [B, K, width]
            full = (rel < 0) | (in_tree & tree)
        return AttnMetadata(B, K, self.kv_slots[:, :width], full.unsqueeze(1), False, None, None,
                            platform=self.platform)

"""ForwardBatch: everything one model forward needs, and ``attention``, the call every attention layer makes.

A forward runs over T flattened tokens belonging to B requests. Request b contributes ``q_len[b]`` new tokens
that attend to ``kv_len[b]`` keys: its prefix (KV already in the pool) followed by the new tokens themselves
(their KV is written to the pool first, then read back with the prefix). How the new tokens attend is described
by the forward's attention metadata, which an attention backend (``specserve.attention.backend``) builds from a
description of the batch and then runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.attention.backend import AttentionBackend, AttentionMetadata
    from specserve.attention.training import StepKV
    from specserve.cache.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly a chunk, possibly after a cached prefix)
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # a draft tree per request, arbitrary mask
    DRAFT_EXTEND = "draft_extend"
    DRAFT_DECODE = "draft_decode"


@dataclass
class ForwardBatch:
    """Everything one model forward needs."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 slots receiving this forward's K/V
    attn: AttentionMetadata  # built by the attention backend
    kv_pool: KVPool | None  # None: a pool-free training forward (see specserve.attention.training)
    logits_indices: torch.Tensor | None = None  # [R] token rows that need logits; None = every row
    capture_layers: tuple[int, ...] = field(default_factory=tuple)  # residual stream at the INPUT of these layers
    input_embeds: torch.Tensor | None = None  # [T, h] optional, replaces the embedding lookup
    step_kv: StepKV | None = None  # pool-free forwards only: K/V of earlier unrolled draft steps
    # a one-layer draft network's long extend: only rows out_rows [R] need the layer's output; every row writes its
    # K/V, and attention runs for the R rows alone, as ``attn`` describes them (``attention``, ``output_rows``)
    out_rows: torch.Tensor | None = None
    # what the layers share in this forward: RoPE cos/sin rows of its positions per rotary module, and the arguments
    # of fused layers (``platform/cpu/fused_layer.py``)
    rope_rows: dict = field(default_factory=dict)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch, scale: float
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the new tokens -> output [T, H*D] ([R, H*D] for fb.out_rows).

    Writes the new K/V into the pool at fb.out_cache_loc, then the metadata's backend attends over each request's
    slots. Attention runs in the pool's dtype: a float32 draft may keep its KV in bf16, so its float32 queries are
    cast to it and the output back.
    """
    if fb.kv_pool is None:
        from specserve.attention.training import poolless_attention

        return poolless_attention(q, k, v, layer_id, fb, scale)
    k_buf, v_buf = fb.kv_pool.store(layer_id, fb.out_cache_loc, k, v)  # [S, Hkv, D]
    out_dtype = q.dtype
    if fb.out_rows is not None:  # [R, H, D]: the rows that need an output, as fb.attn describes them
        q = q.index_select(0, fb.out_rows)
    return fb.attn.attend(q.to(k_buf.dtype), k_buf, v_buf, scale).to(out_dtype)


def output_rows(x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """x [T, ...] -> the rows of it a forward outputs: fb.out_rows' [R, ...], or all of x."""
    return x if fb.out_rows is None else x.index_select(0, fb.out_rows)


def extend_inputs(backend: AttentionBackend, table: torch.Tensor, rows: list[int], starts: list[int],
                  tokens: list[list[int]], may_split: bool = False, out_rows: torch.Tensor | None = None):
    """The pieces of an extend forward: requests that each append tokens[b] at positions starts[b].. of row
    rows[b] of the req_to_token table (whose slots there are already written), attending causally over the row's
    earlier slots -> (ids [T], positions [T], out_cache_loc [T], metadata).

    may_split: the backend may attend request by request where that is cheaper; for eager forwards only (a
    compiled one would unroll a loop whose length varies with the batch). out_rows: [B] each request's last row
    (``last_token_rows``), for a forward with ``ForwardBatch.out_rows``: the metadata is then theirs alone, over all
    their request's keys (a decode's)."""
    device = table.device
    q_lens = [len(t) for t in tokens]
    pieces = list(zip(rows, starts, q_lens, strict=True))
    ids = torch.tensor([t for row in tokens for t in row], dtype=torch.int64, device=device)  # [T]
    positions = torch.cat([torch.arange(s, s + n) for _, s, n in pieces]).to(device)  # [T]
    out_loc = torch.cat([table[r, s : s + n] for r, s, n in pieces])  # [T]
    kv_lens = [s + n for _, s, n in pieces]
    if out_rows is not None:
        last = positions.index_select(0, out_rows)  # [B]
        return ids, positions, out_loc, backend.decode(table, torch.tensor(rows, device=device), last, kv_lens)
    return ids, positions, out_loc, backend.extend(table, rows, kv_lens, q_lens, may_split)


def extend_batch(backend: AttentionBackend, mode: ForwardMode, table: torch.Tensor, rows: list[int],
                 starts: list[int], tokens: list[list[int]], kv_pool: KVPool, may_split: bool = False,
                 last_only: bool = False, **extra) -> ForwardBatch:
    """ForwardBatch over ``extend_inputs`` (may_split as there); used for target prefill chunks and draft extends
    alike. last_only: the forward outputs each request's last row alone (``ForwardBatch.out_rows``; one-layer draft
    networks). extra: ForwardBatch's optional fields."""
    out_rows = last_token_rows([len(t) for t in tokens], table.device) if last_only else None
    return ForwardBatch(mode, *extend_inputs(backend, table, rows, starts, tokens, may_split, out_rows), kv_pool,
                        out_rows=out_rows, **extra)


def last_token_rows(q_lens: list[int], device) -> torch.Tensor:
    """[B] row of each request's last token in a forward's flattened [T] rows."""
    return torch.tensor(q_lens, device=device).cumsum(0) - 1

"""Attention: forward-batch metadata and the torch SDPA backend (runs on CPU and CUDA)."""

from specserve.attention.backend import (
    AttnMetadata,
    ForwardBatch,
    ForwardMode,
    attended_slots,
    attention,
    build_attn_metadata,
    decode_attn_metadata,
    extend_batch,
    extend_inputs,
    last_token_rows,
    mixed_attn_metadata,
    prefix_visible,
)

__all__ = ["AttnMetadata", "ForwardBatch", "ForwardMode", "attended_slots", "attention", "build_attn_metadata",
           "decode_attn_metadata", "extend_batch", "extend_inputs", "last_token_rows", "mixed_attn_metadata",
           "prefix_visible"]

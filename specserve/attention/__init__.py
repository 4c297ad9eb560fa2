"""Attention: forward-batch metadata and the torch SDPA backend (runs on CPU and CUDA)."""

from specserve.attention.backend import (
    AttnMetadata,
    ForwardBatch,
    ForwardMode,
    attention,
    build_attn_metadata,
    extend_batch,
    last_token_rows,
    prefix_visible,
)

__all__ = ["AttnMetadata", "ForwardBatch", "ForwardMode", "attention", "build_attn_metadata", "extend_batch",
           "last_token_rows", "prefix_visible"]

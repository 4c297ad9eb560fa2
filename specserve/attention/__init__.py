"""Attention: the forward batch, the attention backend interface and its registry, and the SDPA backend."""

from specserve.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    DraftTreeKeys,
    create_attention_backend,
)
from specserve.attention.batch import (
    ForwardBatch,
    ForwardMode,
    attention,
    extend_batch,
    extend_inputs,
    last_token_rows,
    output_rows,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "DraftTreeKeys", "ForwardBatch", "ForwardMode", "attention",
           "create_attention_backend", "extend_batch", "extend_inputs", "last_token_rows", "output_rows"]

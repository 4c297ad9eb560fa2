"""The attention backend interface, and the registry ``--attention-backend`` chooses from.

Callers describe a batch (which table rows, how many keys and new tokens per request, an optional tree mask); the
backend turns the description into its own ``AttentionMetadata``, which then runs the attention of every layer of
the forward (``AttentionMetadata.attend``) and, for CUDA graphs, knows how to live in static buffers
(``graph_shape`` / ``static_buffers`` / ``copy_into``). No caller sees how a backend lays its metadata out.

``sdpa.py`` is the one implementation (PyTorch's scaled_dot_product_attention over gathered slots, CPU and CUDA). A
kernel library that reads K/V by slot (FlashInfer- or Triton-class) is one more file implementing these two classes
plus a line in ``ATTENTION_BACKENDS``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from specserve.flags import ConfigError

if TYPE_CHECKING:
    import torch


class AttentionTuning(Protocol):
    """What a backend asks the host's tuning policy (``specserve.platform.PlatformPolicy`` implements it)."""

    def folds_query_heads(self, qb: torch.Tensor, n_kv: int, masked: bool) -> bool:
        """Whether padded queries qb [B, Qmax, H, D] over n_kv KV heads, with a mask other than plain causal, are
        attended as G = H / n_kv rows per KV head."""
        ...

    def few_query_attention(self, qb: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor):
        """The host's own kernel for padded queries qb [B, Qmax, H, D] over the pools k_buf / v_buf [S, Hkv, D],
        called as f(qb, k_buf, v_buf, kv_slots, mask, scale) -> [B * Qmax, H * D]; None: SDPA."""
        ...


class AttentionMetadata(ABC):
    """How the new tokens of one forward attend (built by a backend, read by every attention layer)."""

    batch_size: int  # requests
    max_q_len: int  # new tokens of the longest request

    @abstractmethod
    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, H, D] of the new tokens; k_buf/v_buf [S, Hkv, D] one layer's pool, the new K/V already written
        -> [T, H*D]."""

    def graph_shape(self) -> tuple | None:
        """What besides the batch size fixes a CUDA graph of this forward (None: it cannot be graphed). Every request
        then has max_q_len new tokens."""
        return None

    def static_buffers(self, batch_size: int, shape: tuple) -> AttentionMetadata:
        """Metadata on static buffers for batch_size requests of this graph shape (captured once, refilled)."""
        raise NotImplementedError

    def copy_into(self, static: AttentionMetadata) -> None:
        """Refill static buffers (``static_buffers``) with this forward's metadata; extra requests are padding."""
        raise NotImplementedError


class DraftTreeKeys(ABC):
    """The keys of a draft tree's levels, laid out once per tree: ``level(mask)`` -> one level's metadata."""

    @abstractmethod
    def level(self, mask: torch.Tensor) -> AttentionMetadata:
        """mask [B, K, t] bool over each request's first t scratch columns -> metadata of a level of K branches
        per request that see their prefix and, among the scratch columns, what mask allows."""


class AttentionBackend(ABC):
    name: str

    def __init__(self, platform: AttentionTuning | None = None) -> None:
        self.platform = platform  # the host's tuning rules (None: the defaults)

    @abstractmethod
    def decode(self, table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
               kv_lens: list[int]) -> AttentionMetadata:
        """One new token per request: rows [B] of the req_to_token table [R, C], the new token at positions[b]
        (= kv_lens[b] - 1, a [B] tensor), its slot already written there."""

    @abstractmethod
    def extend(self, table: torch.Tensor, rows: list[int], kv_lens: list[int], q_lens: list[int],
               may_split: bool = False) -> AttentionMetadata:
        """q_lens[b] new tokens at the end of request b's kv_lens[b] keys (row rows[b]), causal among themselves.
        may_split: the forward is eager, so the backend may attend request by request where that is cheaper."""

    @abstractmethod
    def tree(self, table: torch.Tensor, rows: torch.Tensor, kv_lens: list[int], q_lens: list[int],
             masks: list[torch.Tensor]) -> AttentionMetadata:
        """A verify forward: request b's q_lens[b] new tokens (its tree's nodes, the last of its kv_lens[b] keys)
        see its prefix and each other as masks[b] [q, q] bool allows (True = may attend)."""

    @abstractmethod
    def draft_tree(self, table: torch.Tensor, rows: list[int], base: list[int],
                   scratch: torch.Tensor) -> DraftTreeKeys:
        """A draft tree drafted level by level: request b's keys are its base[b] prefix keys, then the scratch slots
        scratch [B, L] of every level (level-major), which this writes into the table after the prefix."""

    @abstractmethod
    def mixed(self, parts: list[tuple[int, AttentionMetadata]]) -> AttentionMetadata:
        """Groups of consecutive rows [(rows, metadata), ...] in forward order, each attending on its own (decode
        rows, then a prefill chunk: ``--enable-mixed-chunk``)."""


#: --attention-backend name -> "module:class" (imported on first use)
ATTENTION_BACKENDS: dict[str, str] = {
    "torch_native": "specserve.attention.sdpa:SdpaBackend",  # SGLang's name for PyTorch SDPA
    "sdpa": "specserve.attention.sdpa:SdpaBackend",
}
DEFAULT_ATTENTION_BACKEND = "torch_native"


def create_attention_backend(name: str | None, platform: AttentionTuning | None = None) -> AttentionBackend:
    """The backend --attention-backend names (default torch_native); names not registered here fail."""
    name = name or DEFAULT_ATTENTION_BACKEND
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    module, cls = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(platform)

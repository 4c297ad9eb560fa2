"""Token-granular KV storage (page size 1).

- ``KVPool``: per layer one K and one V tensor ``[num_slots + 1, Hkv, D]`` indexed by slot. Slot 0 is a
  padding slot that is never handed out (padded gathers read it, padded writes may land in it).
- ``SlotAllocator``: the free list of slots 1..num_slots.
- ``ReqToTokenPool``: the ``req_to_token[req, pos] -> slot`` table, one row per running request.

A draft model owns its own ``KVPool`` of the same slot count and shares the allocator and the table with
the target, so committing or freeing a slot is one operation for both.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, but on CPU in an anonymous memory map of its own: fresh zero pages that the OS maps on first
    write, whatever malloc's settings, so a pool sized for the worst case costs neither memory nor start-up time
    until it is used (``torch.zeros`` writes every byte up front: 6.8 GB resident at start for SmolLM2's default
    pool). The tensor keeps the map alive; the map goes when the tensor does."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private, as malloc's own maps
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


class KVPool:
    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
        fused_store=None,
    ) -> None:
        # (k_buf, v_buf, slots, k, v) -> None: a layer's K and V writes in one call, where the platform has one
        # (``PlatformPolicy.kv_store``); eager forwards whose k and v are in the pool's dtype use it
        self.fused_store = fused_store
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write new tokens' k / v [T, Hkv, D] at slots [T] of layer ``layer_id`` -> that layer's (K, V) [S, Hkv, D]."""
        k_buf, v_buf = self.k[layer_id], self.v[layer_id]
        if (self.fused_store is not None and k.dtype == v.dtype == k_buf.dtype
                and not torch.compiler.is_compiling()):
            self.fused_store(k_buf, v_buf, slots, k, v)
        else:
            k_buf[slots] = k.to(k_buf.dtype)
            v_buf[slots] = v.to(v_buf.dtype)
        return k_buf, v_buf

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class SlotAllocator:
    """Free list of KV slots 1..num_slots (slot 0 is reserved for padding)."""

    def __init__(self, num_slots: int, device) -> None:
        self.num_slots, self.device = num_slots, device
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64, device=self.device)
        self._released: list[torch.Tensor] = []  # freed slots not yet merged into _free (merged on demand)
        self._released_count = 0  # their total, kept so available_size() is O(1)

    def available_size(self) -> int:
        return len(self._free) + self._released_count

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots as int64 [n], or None when fewer are free."""
        if n > len(self._free) and self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released, self._released_count = [], 0
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._released.append(slots.to(torch.int64))
            self._released_count += slots.numel()

    def free_slots_sorted(self) -> torch.Tensor:
        """Every free slot, sorted (for leak checks)."""
        return torch.sort(torch.cat([self._free, *self._released])).values


class ReqToTokenPool:
    """req_to_token: [max_reqs, max_context] int64, row r holds the slots of request r's tokens by position."""

    def __init__(self, max_reqs: int, max_context: int, device) -> None:
        self.max_reqs, self.max_context = max_reqs, max_context
        self.req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_reqs))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + len(slots)] = slots

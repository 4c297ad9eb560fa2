"""KVManager: the KV bookkeeping of running requests, in one place.

It owns the slot allocator, the ``req_to_token`` table and the radix (prefix) cache, and keeps them consistent:
a request is *admitted* (a table row, its cached prefix locked), *extended* (fresh slots for new tokens written
into its row), *trimmed* (slots past its end freed) and *released* (its KV handed to the radix cache, duplicates
freed). The scheduler, both decode steps (plain and speculative) and the drafters go through it; none of them
touches the allocator, the table or the radix tree directly (the attention backend reads the table and lays a draft
tree's scratch slots into it: ``AttentionBackend.draft_tree``).

Request fields it maintains: ``req_pool_idx`` (table row or None), ``kv_len`` (positions whose slots are in the
row and hold computed KV), ``prefix_len`` (of those, how many came from the radix cache), ``last_node`` (the
locked radix node).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from specserve.cache.kv_pool import ReqToTokenPool, SlotAllocator
    from specserve.request import Req


class KVManager:
    def __init__(self, allocator: SlotAllocator, req_pool: ReqToTokenPool, capacity: int, device,
                 disable_radix_cache: bool = False) -> None:
        self.allocator, self.req_pool, self.capacity, self.device = allocator, req_pool, capacity, device
        self.tree = RadixCache(allocator.free, device=device, disable=disable_radix_cache)

    @property
    def table(self) -> torch.Tensor:
        """req_to_token [rows, columns] int64: the slot of each request's token at each position."""
        return self.req_pool.req_to_token

    # ------------------------------------------------------------------ capacity
    def available(self) -> int:
        """Slots a request could get now: free plus evictable from the radix cache."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def usage(self) -> float:
        return 1.0 - self.available() / self.capacity

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots [n] int64 (evicting from the radix cache when needed), or None when there are not enough."""
        if self.allocator.available_size() < n:
            self.tree.evict(n - self.allocator.available_size())
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    # ------------------------------------------------------------------ table cells
    def write(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i] (rows, cols, slots [n])."""
        self.table[rows, cols] = slots

    def cells(self, reqs: list[Req], starts: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Table cells (rows [n], columns [n]) of counts[b] consecutive positions from starts[b] per request,
        request-major; built on the host and copied once (one op for the whole batch)."""
        rows = [r.req_pool_idx for r, n in zip(reqs, counts, strict=True) for _ in range(n)]
        cols = [p + i for p, n in zip(starts, counts, strict=True) for i in range(n)]
        return torch.tensor([rows, cols], dtype=torch.int64, device=self.device).unbind(0)

    def slots_of(self, req: Req, start: int, end: int) -> torch.Tensor:
        """A copy of req's slots at positions [start, end)."""
        return self.table[req.req_pool_idx, start:end].clone()

    # ------------------------------------------------------------------ a request's life
    def cached_prefix_len(self, ids: list[int]) -> int:
        """Tokens of ids the radix cache holds (the last one is always computed: it gives the first logits)."""
        return len(self.tree.match_prefix(ids[:-1])[0])

    def admit(self, req: Req, reserve: int, chunk_cap: int, force: bool) -> bool:
        """Give req a table row and its cached prefix when the pool can hold its first chunk (at most chunk_cap of
        the tokens it still needs) plus `reserve` slots for others; force: admit anyway (nothing else would run,
        and a request that can never fit is failed by the scheduler). False: nothing changed."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        prefix, node = self.tree.match_prefix(req.fill_ids[:-1])  # keep >= 1 token to compute logits
        if req.input_logprobs is not None and not req.input_logprobs.complete:
            prefix = prefix[: req.input_logprobs.next_position()]  # the scored positions are computed, not cached
        self.tree.inc_lock_ref(node)
        need = req.seq_len - len(prefix)
        if not force and self.available() < min(need, chunk_cap) + reserve:
            self.tree.dec_lock_ref(node)
            self.req_pool.free(row)
            return False
        self.req_pool.write(row, 0, prefix)
        req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node = row, len(prefix), len(prefix), node
        if not req.admitted_once:
            req.cached_tokens, req.admitted_once = len(prefix), True
        return True

    def unadmit(self, req: Req) -> None:
        """Undo ``admit`` for a request that took no slots."""
        self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        _clear(req)

    def extend(self, req: Req, n: int) -> bool:
        """Fresh slots for req's next n positions (from kv_len), written into its row; False when the pool cannot
        supply them."""
        slots = self.alloc(n)
        if slots is None:
            return False
        self.req_pool.write(req.req_pool_idx, req.kv_len, slots)
        return True

    def drop_uncomputed(self, req: Req, start: int, n: int) -> None:
        """Free the n slots written for positions [start, start + n) whose KV was never computed (a failed
        forward)."""
        self.free(self.slots_of(req, start, start + n))

    def trim(self, req: Req) -> None:
        """Free the KV past req's end (kv_len > seq_len after its output was cut back)."""
        if req.kv_len > req.seq_len:
            self.free(self.slots_of(req, req.seq_len, req.kv_len))
            req.kv_len = req.seq_len

    def release(self, req: Req) -> None:
        """Give back req's KV: into the radix cache (freeing duplicates) or straight to the free list."""
        row, kv_len = req.req_pool_idx, req.kv_len
        slots = self.slots_of(req, 0, kv_len)
        if self.tree.disable:
            self.free(slots)
        else:
            cached = self.tree.insert(req.fill_ids[:kv_len], slots)
            # [prefix_len, cached): computed by us but already in the tree -> ours are duplicates
            self.free(slots[req.prefix_len : max(cached, req.prefix_len)])
            self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(row)
        _clear(req)

    def reset(self) -> None:
        """Drop the prefix cache and every slot (only when no request holds KV)."""
        self.tree.reset()
        self.allocator.clear()

    def stats(self) -> dict:
        return {"kv_usage": self.usage(), "free_slots": self.allocator.available_size(),
                "radix_cached_tokens": self.tree.total_size(), "kv_locked_tokens": self.tree.protected_size(),
                "free_req_rows": self.req_pool.available_size()}


def _clear(req: Req) -> None:
    req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node = None, 0, 0, None

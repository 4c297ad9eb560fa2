"""Tensor parallelism (Megatron-style) for the decoder models: which slice of each weight a rank holds, and the two
collectives a forward makes.

A rank of a ``--tp-size N`` group holds:
- in each attention layer, H / N query heads, and the KV heads they read: Hkv / N of them when Hkv >= N, else the
  one KV head its query heads share (KV heads are then replicated, N / Hkv ranks each);
- in each MLP, intermediate / N columns of gate and up, and the same rows of down;
- 1 / N of the vocabulary (padded up to a multiple of N) in the embedding and in the LM head.

q/k/v and gate/up are column-parallel (no communication), o_proj and down_proj row-parallel (one all-reduce each),
the embedding is looked up where its rows live and all-reduced, and the LM head's logits are gathered once, on rank
0, which samples. Norms, RoPE and everything else are replicated. A row-parallel bias is added by rank 0 alone.

Models read the group at construction (``sharding``): the target is built inside ``with sharding(group)`` and
draft models outside it, so they stay whole (they run on rank 0; ``specserve.parallel.ranks``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specserve.flags import ConfigError


def split_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of rank's equal share of `total` items (total divisible by size)."""
    per = total // size
    return rank * per, (rank + 1) * per


def padded_vocab(vocab: int, size: int) -> int:
    """The vocabulary rounded up to a multiple of the group size (the padding rows are zeros, their logits dropped)."""
    return -(-vocab // size) * size


def rank_share(total: int, group: TPGroup | None) -> tuple[int, int]:
    """[lo, hi) of the items (heads, MLP columns) `group`'s rank holds; all of them without a group."""
    return (0, total) if group is None else split_range(total, group.rank, group.size)


def vocab_share(vocab: int, group: TPGroup | None) -> tuple[int, int]:
    """[lo, hi) of the (padded) vocabulary rows `group`'s rank holds in the embedding and the LM head."""
    return (0, vocab) if group is None else split_range(padded_vocab(vocab, group.size), group.rank, group.size)


def kv_heads_of(num_heads: int, num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of the KV heads rank's query heads read. With fewer KV heads than ranks, each rank holds the one KV
    head its H / size query heads share (heads h of a group of H / Hkv query heads read KV head h // (H / Hkv))."""
    if num_kv_heads >= size:
        return split_range(num_kv_heads, rank, size)
    first_q = rank * (num_heads // size)
    head = first_q // (num_heads // num_kv_heads)
    return head, head + 1


def check_divisible(size: int, num_heads: int, num_kv_heads: int, intermediate: int) -> None:
    """ConfigError naming --tp-size unless the model's heads and MLP split evenly over `size` ranks."""
    if size == 1:
        return
    problems = []
    if num_heads % size:
        problems.append(f"{num_heads} attention heads")
    if num_kv_heads >= size and num_kv_heads % size or num_kv_heads < size and size % num_kv_heads:
        problems.append(f"{num_kv_heads} KV heads")
    if intermediate % size:
        problems.append(f"MLP width {intermediate}")
    if problems:
        raise ConfigError(f"--tp-size {size} does not divide the model's {', '.join(problems)}")


@dataclass
class TPGroup:
    """One rank's place in a tensor-parallel group. ``link``: on rank 0, what tells the other ranks to join a
    collective computation that rank 0 starts outside a forward (``ranks.Leader``); None on the others."""

    rank: int
    size: int
    link: object | None = None
    # the ranks' shared-memory channel when they share a node (``specserve.parallel.shm``): all-reduces and gathers
    # small enough for it go through it; the rest (and every collective across nodes) through torch.distributed
    comm: object | None = None
    # what the collectives cost this rank: calls and wall seconds (the server info's tp_* counters)
    reduces: int = 0
    reduce_seconds: float = 0.0
    gathers: int = 0
    gather_seconds: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """-> the sum of every rank's x (same shape on all; x itself may be overwritten), summed in float32 for half
        precision (gloo sums bf16 too, but in bf16: float32 keeps a TP run's rounding close to one rank's)."""
        start = time.perf_counter()
        if self.comm is not None and self.comm.fits(x):
            x = self.comm.all_reduce(x).to(x.dtype)
        elif x.dtype in (torch.bfloat16, torch.float16):
            wide = x.float()
            dist.all_reduce(wide)
            x = wide.to(x.dtype)
        else:
            dist.all_reduce(x)
        self.reduces += 1
        self.reduce_seconds += time.perf_counter() - start
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [R, C] side by side as [R, size * C] on rank 0 (None on the others)."""
        start = time.perf_counter()
        if self.comm is not None and self.comm.fits(x):
            full = self.comm.gather_columns(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(x.contiguous(), parts, dst=0)
            full = torch.cat(parts, dim=-1) if parts is not None else None
        self.gathers += 1
        self.gather_seconds += time.perf_counter() - start
        return full

    def info(self) -> dict:
        return {"tp_size": self.size, "tp_all_reduces": self.reduces, "tp_all_reduce_seconds": self.reduce_seconds,
                "tp_gathers": self.gathers, "tp_gather_seconds": self.gather_seconds}


#: a module's shard rule for a row-parallel bias, which is added once: rank 0 loads it, the other ranks hold zeros
FIRST_RANK_ONLY = "first-rank-only"
ZEROS = "zeros"  # ``shard_rules``' rule for such a bias on the other ranks


def shard_rules(model: torch.nn.Module) -> dict[tuple[str, int], tuple | str]:
    """(parameter name, fused piece or -1) -> its rule on this rank: (dim, lo, hi), the checkpoint tensor's slice
    along dim, or ZEROS; from the sharded modules' ``tp_rules``. Parameters without a rule load whole."""
    rules = {}
    for prefix, module in model.named_modules():
        tp = getattr(module, "tp", None)
        if tp is None or not hasattr(module, "tp_rules"):
            continue
        for (name, piece), rule in module.tp_rules().items():
            if rule == FIRST_RANK_ONLY:
                if tp.rank == 0:
                    continue
                rule = ZEROS
            rules[f"{prefix}.{name}" if prefix else name, piece] = rule
    return rules


def take_shard(src, rule: tuple | str | None, like: torch.Tensor) -> torch.Tensor:
    """The part of checkpoint tensor `src` (a tensor, or a safetensors slice, read only where it is indexed) that
    `rule` (``shard_rules``; None: all of it) gives this rank, for its parameter `like`: rows past the checkpoint's
    (the vocabulary's padding) are zeros."""
    if rule is None:
        return src if isinstance(src, torch.Tensor) else src[:]
    if rule == ZEROS:
        return torch.zeros_like(like)
    dim, lo, hi = rule
    size = src.get_shape()[dim] if hasattr(src, "get_shape") else src.shape[dim]
    index = (slice(None),) * dim + (slice(lo, min(hi, size)),)
    part = src[index]
    if part.shape[dim] < hi - lo:  # padding rows
        pad = list(part.shape)
        pad[dim] = hi - lo - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part


_current: TPGroup | None = None


@contextlib.contextmanager
def sharding(group: TPGroup | None):
    """Models built inside are sharded over `group` (None or size 1: whole)."""
    global _current
    before, _current = _current, group if group is not None and group.size > 1 else None
    try:
        yield
    finally:
        _current = before


def building_group() -> TPGroup | None:
    """The group the model being built is sharded over (None: whole)."""
    return _current

"""A model's weights on transparent huge pages (CPU, Linux).

A decode step reads every weight once. With the 4 KiB pages that malloc hands out, SmolLM2-135M's 257 MiB of bf16
weights span 66k pages: one address translation to walk for each 4 KiB streamed, which the CPU's TLB cannot hold.
On 2 MiB pages they span 129. Linux gives a mapping huge pages where it is advised ``MADV_HUGEPAGE`` (the usual
``transparent_hugepage`` setting, "madvise"); the heap that weights are loaded into is not advised.

``place_on_huge_pages(module)`` copies every strided CPU tensor the module holds (parameters, buffers and tensor
attributes, such as a packed linear's plain weight) into one anonymous mapping advised ``MADV_HUGEPAGE``, storage
by storage, and points each tensor at its copy in place (``Tensor.set_``: whoever holds the tensor object sees the
move). The heap pages the old copies leave are handed back to the kernel (``malloc.trim_heap``). Measured on a
2-core AMD EPYC (docs/benchmarks.md): SmolLM2-135M's eager bf16 decode took 15.9 against 17.7 ms a token, the same
process alternating between the two placements (4 pairs, 1.09-1.13x).

Left alone: oneDNN's packed weights (opaque to PyTorch; they stay where oneDNN allocated them); tensors outside
the module that share a moved storage (they keep the old copy, so its memory is not freed); a kernel whose
``transparent_hugepage`` is "never" or that refuses the advice (nothing is moved then).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterator

import torch
from torch import nn

from specserve.cache.kv_pool import lazy_zeros
from specserve.platform.cpu.clib import c_function, libc_path
from specserve.platform.cpu.malloc import trim_heap

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14  # Linux's asm-generic/mman-common.h
ALIGN = 64  # bytes between storages in the mapping: a cache line, as PyTorch's own CPU allocator aligns
TRIM_EVERY_BYTES = 256 * 2**20  # freed heap copies handed back to the kernel at least this often while moving


@functools.cache
def _madvise():
    """libc's madvise, or None (no C library with one)."""
    return c_function(libc_path(), "madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)


def module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Each distinct plain tensor (no subclass) the module or a submodule holds as a parameter, buffer or
    attribute; the int8 / int4 linears' weights and scales (``models/quantize.py``) are such attributes."""
    seen: set[int] = set()
    for m in module.modules():
        for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            if type(t) in (torch.Tensor, nn.Parameter) and type(t.data) is torch.Tensor and id(t) not in seen:
                seen.add(id(t))
                yield t


def movable(t: torch.Tensor) -> bool:
    """A strided CPU tensor with a storage of its own to copy (not oneDNN's opaque layout, not a meta tensor)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
            and t.untyped_storage().nbytes() > 0)


def group_by_storage(tensors) -> dict[int, list[torch.Tensor]]:
    """Movable tensors by the address of their storage (views of one storage move together)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if movable(t):
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return groups


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of storages of these byte sizes packed one after another at ALIGN-byte boundaries -> (offsets,
    total bytes)."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


def _advised_mapping(nbytes: int) -> tuple[torch.Tensor, int] | None:
    """An anonymous mapping of at least nbytes from a 2 MiB boundary, advised MADV_HUGEPAGE -> (uint8 tensor over
    the whole mapping, offset of the boundary), or None where the advice is refused."""
    madvise = _madvise()
    if madvise is None:
        return None
    base = lazy_zeros((nbytes + HUGE_PAGE,), torch.uint8, "cpu")  # a mapping of its own; untouched pages cost nothing
    start = -base.data_ptr() % HUGE_PAGE
    if madvise(base.data_ptr() + start, nbytes, MADV_HUGEPAGE) != 0:
        return None
    return base, start


def place_on_huge_pages(module: nn.Module) -> int:
    """Move the module's strided CPU tensors onto huge pages (module docstring) -> bytes moved (0: nothing moved).

    Storage by storage, holding no old storage past its move: an old copy is freed as soon as its tensors point at
    the new one, and the heap is trimmed every TRIM_EVERY_BYTES, so the process never holds two copies of the
    weights (a 7B model's 14 GB)."""
    groups = list(group_by_storage(module_tensors(module)).values())
    offsets, total = layout([ts[0].untyped_storage().nbytes() for ts in groups])
    if not total:
        return 0
    mapped = _advised_mapping(total)
    if mapped is None:
        logger.info("weights stay on the heap's pages: the kernel refused MADV_HUGEPAGE")
        return 0
    base, start = mapped
    target, untrimmed = base.untyped_storage(), 0
    for tensors, off in zip(groups, offsets, strict=True):
        at, old = start + off, tensors[0].untyped_storage()
        base[at : at + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))  # byte for byte
        for t in tensors:
            _point_at(t, target, at)
        untrimmed += old.nbytes()
        del old
        if untrimmed >= TRIM_EVERY_BYTES:
            trim_heap()
            untrimmed = 0
    trim_heap()
    logger.info("weights: %.1f MiB moved onto huge pages", total / 2**20)
    return total


def _point_at(t: torch.Tensor, target: torch.UntypedStorage, at: int) -> None:
    """Make t read its elements from target, whose byte ``at`` holds the first byte of t's old storage."""
    mode = torch.inference_mode() if t.is_inference() else torch.no_grad()
    with mode:
        t.set_(target, at // t.element_size() + t.storage_offset(), t.shape, t.stride())

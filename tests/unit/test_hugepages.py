"""Weights moved onto huge pages (platform/cpu/hugepages.py): the same values, every holder of a moved storage
pointed at the copy, the mapping advised for huge pages, and what is not moved."""

from __future__ import annotations

import torch
from torch import nn

from specserve.platform.cpu.hugepages import HUGE_PAGE, group_by_storage, layout, module_tensors, place_on_huge_pages


def vm_flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds address (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError("no mapping holds the address")


def test_layout_packs_storages_at_cache_line_boundaries():
    assert layout([10, 64, 65, 1]) == ([0, 64, 128, 256], 320)
    assert layout([]) == ([], 0)


def test_module_tensors_finds_parameters_buffers_and_attributes_once():
    lin = nn.Linear(4, 3)
    lin.plain = lin.weight.detach()  # a second tensor object on the weight's storage
    lin.register_buffer("table", torch.arange(5))
    lin.same = lin.table  # the same object twice
    found = list(module_tensors(lin))
    assert len(found) == 4 and {id(t) for t in found} == {id(lin.weight), id(lin.bias), id(lin.plain), id(lin.table)}
    groups = group_by_storage(found)
    assert len(groups) == 3 and len(groups[lin.weight.untyped_storage().data_ptr()]) == 2


def test_moved_weights_compute_the_same_and_share_one_advised_mapping():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 128)).bfloat16()
    model[0].plain = model[0].weight.detach()
    weight = model[0].weight
    x = torch.randn(3, 256).bfloat16()
    want = model(x)
    moved = place_on_huge_pages(model)
    assert moved == sum(-(-p.numel() * 2 // 64) * 64 for p in model.parameters())
    assert model[0].weight is weight and weight.is_leaf and weight.requires_grad  # the same objects, moved
    assert model[0].plain.data_ptr() == weight.data_ptr()  # both holders of the storage follow it
    assert torch.equal(model(x), want)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1  # one mapping
    assert min(p.data_ptr() for p in model.parameters()) % HUGE_PAGE == 0
    assert "hg" in vm_flags_at(weight.data_ptr())  # MADV_HUGEPAGE


def test_inference_tensors_and_what_is_left_alone():
    with torch.inference_mode():
        lin = nn.Linear(64, 64)
    lin.meta = torch.empty(3, device="meta")
    before = lin.weight.clone()
    assert place_on_huge_pages(lin) > 0
    assert lin.weight.is_inference() and torch.equal(lin.weight, before)
    assert lin.meta.device.type == "meta"
    assert place_on_huge_pages(nn.ReLU()) == 0  # nothing to move


class _Buffer(bytearray):  # a bytearray that can be watched with a weak reference
    pass


def test_each_old_copy_is_freed_before_the_next_is_moved(monkeypatch):
    """The move never holds two copies of the weights: by the time the second storage is re-pointed, the first
    storage's old memory (here a watched buffer) is gone."""
    import weakref

    from specserve.platform.cpu import hugepages

    module = nn.Module()
    watched = []
    for name in ("a", "b"):
        buf = _Buffer(4096 * 4)
        watched.append(weakref.ref(buf))
        module.register_parameter(name, nn.Parameter(torch.frombuffer(buf, dtype=torch.float32), requires_grad=False))
        del buf
    alive_at_second = []
    real = hugepages._point_at

    def spy(t, target, at):
        if t is module.b:
            alive_at_second.append(watched[0]() is not None)
        real(t, target, at)

    monkeypatch.setattr(hugepages, "_point_at", spy)
    assert place_on_huge_pages(module) == 2 * 4096 * 4
    assert alive_at_second == [False] and watched[1]() is None

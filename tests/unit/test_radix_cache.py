"""Unit tests for specserve.cache.radix_cache: hand-checked cases plus a seeded randomized model check."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from specserve.cache.radix_cache import RadixCache, TreeNode


class FreeRecorder:
    """free_slots callback that records every freed slot (in call order)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, slots: torch.Tensor) -> None:  # slots: int64 [n]
        assert slots.dtype == torch.int64 and slots.dim() == 1
        self.calls.append(slots.tolist())

    @property
    def freed(self) -> list[int]:
        return [s for call in self.calls for s in call]


def slots(*xs: int) -> torch.Tensor:
    """int64 [len(xs)] slot tensor."""
    return torch.tensor(xs, dtype=torch.int64)


def make_cache(disable: bool = False) -> tuple[RadixCache, FreeRecorder]:
    rec = FreeRecorder()
    return RadixCache(free_slots=rec, disable=disable), rec


def path_key(node: TreeNode) -> list[int]:
    """Full token sequence from the root to ``node``."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


# -------------------------------------------------------------------------------------- insert / match


def test_empty_cache_matches_nothing():
    cache, _ = make_cache()
    value, node = cache.match_prefix([1, 2, 3])
    assert value.shape == (0,) and value.dtype == torch.int64
    assert node is cache.root_node
    assert cache.total_size() == 0
    cache._check_invariants()


def test_insert_then_exact_match():
    cache, _ = make_cache()
    assert cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13)) == 0
    value, node = cache.match_prefix([1, 2, 3, 4])
    assert value.dtype == torch.int64
    assert value.tolist() == [10, 11, 12, 13]
    assert node.key == [1, 2, 3, 4] and node.parent is cache.root_node
    assert cache.total_size() == cache.evictable_size() == 4 and cache.protected_size() == 0
    cache._check_invariants()


def test_match_longer_query_returns_cached_part():
    cache, _ = make_cache()
    cache.insert([1, 2, 3], slots(5, 6, 7))
    value, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert value.tolist() == [5, 6, 7]
    assert node.key == [1, 2, 3]


def test_match_inside_edge_splits_it():
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    value, node = cache.match_prefix([1, 2, 9])
    assert value.tolist() == [10, 11]
    # root -> [1,2] -> [3,4]; the returned node ends exactly at the match.
    assert node.key == [1, 2] and node.value.tolist() == [10, 11]
    assert node.parent is cache.root_node
    assert list(node.children) == [3]
    lower = node.children[3]
    assert lower.key == [3, 4] and lower.value.tolist() == [12, 13] and lower.parent is node
    # The full sequence still matches across the split.
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [10, 11, 12, 13]
    assert cache.total_size() == 4
    cache._check_invariants()


def test_match_query_ending_inside_edge_splits_it():
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    value, node = cache.match_prefix([1, 2, 3])
    assert value.tolist() == [10, 11, 12]
    assert node.key == [1, 2, 3] and path_key(node) == [1, 2, 3]
    assert node.children[4].key == [4]
    cache._check_invariants()


def test_insert_branch():
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    assert cache.insert([1, 2, 5, 6], slots(20, 21, 22, 23)) == 2
    root = cache.root_node
    assert list(root.children) == [1]
    shared = root.children[1]
    assert shared.key == [1, 2] and sorted(shared.children) == [3, 5]
    assert shared.children[5].value.tolist() == [22, 23]
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [0, 1, 2, 3]
    assert cache.match_prefix([1, 2, 5, 6])[0].tolist() == [0, 1, 22, 23]
    assert cache.total_size() == 6
    cache._check_invariants()


def test_no_match_returns_root():
    cache, _ = make_cache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    value, node = cache.match_prefix([7, 1, 2])
    assert value.numel() == 0 and node is cache.root_node


def test_empty_key():
    cache, _ = make_cache()
    assert cache.insert([], slots()) == 0
    assert cache.total_size() == 0
    value, node = cache.match_prefix([])
    assert value.shape == (0,) and value.dtype == torch.int64 and node is cache.root_node


def test_insert_returns_cached_len_and_keeps_old_slots():
    cache, _ = make_cache()
    assert cache.insert([1, 2, 3], slots(0, 1, 2)) == 0
    assert cache.insert([1, 2, 3, 4, 5], slots(100, 101, 102, 103, 104)) == 3
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == [0, 1, 2, 103, 104]
    # Re-inserting a fully cached key changes nothing.
    assert cache.insert([1, 2, 3, 4], slots(200, 201, 202, 203)) == 4
    assert cache.total_size() == 5
    assert sorted(cache.all_values().tolist()) == [0, 1, 2, 103, 104]
    cache._check_invariants()


def test_insert_copies_value():
    cache, _ = make_cache()
    value = slots(1, 2, 3)
    cache.insert([7, 8, 9], value)
    value[0] = 99  # the caller reusing its buffer must not corrupt the tree
    assert cache.match_prefix([7, 8, 9])[0].tolist() == [1, 2, 3]


def test_insert_rejects_mismatched_value():
    cache, _ = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], slots(0, 1))


# -------------------------------------------------------------------------------------------- eviction


def test_lru_eviction_order_and_match_refreshes():
    cache, rec = make_cache()
    cache.insert([1, 2], slots(0, 1))  # A
    cache.insert([3, 4], slots(2, 3))  # B
    cache.insert([5, 6], slots(4, 5))  # C
    cache.match_prefix([1, 2])  # A is now the most recently used
    assert cache.evict(2) == 2
    assert rec.calls == [[2, 3]]  # B, the least recently used
    assert cache.evict(1) == 2  # a whole node is freed even if fewer tokens were asked
    assert rec.calls == [[2, 3], [4, 5]]  # then C
    assert cache.evict(10) == 2
    assert rec.calls == [[2, 3], [4, 5], [0, 1]]
    assert cache.total_size() == 0
    cache._check_invariants()


def test_parent_becomes_candidate_after_children_evicted():
    cache, rec = make_cache()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    cache.insert([1, 2, 5, 6], slots(9, 9, 4, 5))
    cache.insert([8], slots(6))  # most recent; must outlive the [1, 2] subtree's leaves
    assert cache.evict(3) == 4
    assert rec.calls == [[2, 3], [4, 5]]
    # [1, 2] is now a leaf and older than [8].
    assert cache.evict(1) == 2
    assert rec.calls[-1] == [0, 1]
    assert cache.match_prefix([8])[0].tolist() == [6]
    cache._check_invariants()


def test_locked_nodes_never_evicted():
    cache, rec = make_cache()
    cache.insert([1, 2], slots(0, 1))
    cache.insert([3, 4, 5], slots(2, 3, 4))
    _, node = cache.match_prefix([1, 2])
    assert cache.inc_lock_ref(node) == 2
    assert cache.protected_size() == 2 and cache.evictable_size() == 3
    assert cache.evict(100) == 3  # fewer than asked: only the unlocked node goes
    assert rec.freed == [2, 3, 4]
    assert cache.evict(100) == 0
    assert cache.match_prefix([1, 2])[0].tolist() == [0, 1]
    assert cache.dec_lock_ref(node) == -2
    assert cache.evict(100) == 2
    assert rec.freed == [2, 3, 4, 0, 1]
    cache._check_invariants()


def test_lock_protects_ancestors():
    cache, rec = make_cache()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    cache.insert([1, 2, 5, 6], slots(0, 1, 4, 5))
    _, leaf = cache.match_prefix([1, 2, 3, 4])
    assert leaf.key == [3, 4]
    assert cache.inc_lock_ref(leaf) == 4  # leaf [3,4] + shared parent [1,2]
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert rec.freed == [4, 5]
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [0, 1, 2, 3]
    cache._check_invariants()


def test_inc_dec_lock_return_values():
    cache, _ = make_cache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    _, node = cache.match_prefix([1, 2, 3])
    assert cache.inc_lock_ref(node) == 3
    assert cache.inc_lock_ref(node) == 0  # already protected
    assert node.lock_ref == 2
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == -3
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert cache.inc_lock_ref(cache.root_node) == 0  # locking the root is a no-op
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    cache._check_invariants()


def test_lock_counts_through_match_split():
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5], slots(0, 1, 2, 3, 4))
    _, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert cache.inc_lock_ref(node) == 5
    _, upper = cache.match_prefix([1, 2, 9])  # splits the locked edge into [1,2] + [3,4,5]
    assert upper.key == [1, 2] and node.key == [3, 4, 5] and node.parent is upper
    assert upper.lock_ref == 1  # inherited from the locked child
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    cache._check_invariants()
    assert cache.inc_lock_ref(upper) == 0
    assert upper.lock_ref == 2
    assert cache.dec_lock_ref(node) == -3  # [3,4,5] unlocked, [1,2] still held by the second lock
    assert cache.protected_size() == 2 and cache.evictable_size() == 3
    assert cache.dec_lock_ref(upper) == -2
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    cache._check_invariants()


def test_lock_counts_through_insert_split():
    cache, rec = make_cache()
    cache.insert([1, 2, 3, 4], slots(0, 1, 2, 3))
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    assert cache.insert([1, 2, 7], slots(0, 1, 8)) == 2
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    cache._check_invariants()
    assert cache.evict(100) == 1
    assert rec.freed == [8]
    assert cache.dec_lock_ref(node) == -4  # releases both split pieces
    assert cache.evictable_size() == 4
    assert cache.evict(100) == 4
    assert sorted(rec.freed) == [0, 1, 2, 3, 8]
    cache._check_invariants()


def test_free_slots_exact_no_leak_no_double_free():
    cache, rec = make_cache()
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 7], [2, 2, 2], [1, 2, 3, 4, 9], [2, 2]]
    next_slot = 0
    allocated: list[int] = []
    caller_freed: list[int] = []  # duplicates the caller frees after insert
    for seq in seqs:
        value = torch.arange(next_slot, next_slot + len(seq), dtype=torch.int64)  # int64 [len(seq)]
        next_slot += len(seq)
        allocated += value.tolist()
        prefix_len = cache.insert(seq, value)
        caller_freed += value[:prefix_len].tolist()
        cache._check_invariants()
    assert Counter(cache.all_values().tolist()) + Counter(caller_freed) == Counter(allocated)
    held = sorted(cache.all_values().tolist())
    total = cache.total_size()
    assert cache.evict(total) == total
    assert cache.all_values().numel() == 0 and cache.total_size() == 0
    assert sorted(rec.freed) == held  # exactly the tree's slots, each once
    assert sorted(rec.freed + caller_freed) == sorted(allocated)  # every slot freed exactly once overall
    assert cache.root_node.children == {}
    cache._check_invariants()


def test_reset_drops_without_freeing():
    cache, rec = make_cache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    cache.reset()
    assert rec.calls == []
    assert cache.total_size() == cache.protected_size() == cache.evictable_size() == 0
    assert cache.match_prefix([1, 2, 3])[1] is cache.root_node
    assert cache.all_values().numel() == 0
    cache._check_invariants()


def test_disabled_cache():
    cache, rec = make_cache(disable=True)
    assert cache.insert([1, 2, 3], slots(0, 1, 2)) == 0
    value, node = cache.match_prefix([1, 2, 3])
    assert value.numel() == 0 and node is cache.root_node
    assert cache.inc_lock_ref(node) == 0 and cache.dec_lock_ref(node) == 0
    assert cache.total_size() == 0 and cache.evict(10) == 0
    assert rec.calls == []
    cache._check_invariants()


def test_pretty_print_lists_nodes():
    cache, _ = make_cache()
    cache.insert([1, 2, 3], slots(0, 1, 2))
    cache.insert([1, 2, 4], slots(0, 1, 3))
    text = cache.pretty_print()
    lines = text.splitlines()
    assert lines[0].startswith("RadixCache(total=4")
    assert any("[1, 2] -> [0, 1]" in line for line in lines)
    assert any("[4] -> [3]" in line for line in lines)


# ------------------------------------------------------------------------------------------ randomized


class ReferenceModel:
    """Naive model of the cache: every cached token prefix (tuple) -> the slot of its last token."""

    def __init__(self) -> None:
        self.slot_of: dict[tuple[int, ...], int] = {}
        self.prefix_of: dict[int, tuple[int, ...]] = {}

    def match_len(self, key: list[int]) -> int:
        m = 0
        while m < len(key) and tuple(key[: m + 1]) in self.slot_of:
            m += 1
        return m

    def slots(self, key: list[int], m: int) -> list[int]:
        return [self.slot_of[tuple(key[: i + 1])] for i in range(m)]

    def insert(self, key: list[int], value: list[int]) -> int:
        m = self.match_len(key)
        for i in range(m, len(key)):
            prefix = tuple(key[: i + 1])
            self.slot_of[prefix] = value[i]
            self.prefix_of[value[i]] = prefix
        return m

    def free(self, slot: int) -> None:
        del self.slot_of[self.prefix_of.pop(slot)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_against_reference(seed: int):
    rng = random.Random(seed)
    ref = ReferenceModel()
    freed_count: Counter[int] = Counter()

    def free_slots(value: torch.Tensor) -> None:  # value: int64 [n]
        for s in value.tolist():
            freed_count[s] += 1
            ref.free(s)

    cache = RadixCache(free_slots=free_slots)
    next_slot = 0
    locks: list[tuple[TreeNode, list[int]]] = []  # (locked node, its full path key)
    inserted: list[list[int]] = []

    def random_key() -> list[int]:
        if inserted and rng.random() < 0.5:  # reuse / extend / cut an earlier sequence to get sharing
            base = rng.choice(inserted)
            base = base[: rng.randint(0, len(base))]
            return base + [rng.randrange(4) for _ in range(rng.randint(0, 4))]
        return [rng.randrange(4) for _ in range(rng.randint(0, 8))]

    for _ in range(300):
        op = rng.random()
        if op < 0.35:
            key = random_key()
            value = torch.arange(next_slot, next_slot + len(key), dtype=torch.int64)  # int64 [len(key)]
            next_slot += len(key)
            expected = ref.insert(key, value.tolist())
            assert cache.insert(key, value) == expected
            inserted.append(key)
        elif op < 0.65:
            key = random_key()
            m = ref.match_len(key)
            value, node = cache.match_prefix(key)
            assert value.tolist() == ref.slots(key, m)
            assert path_key(node) == key[:m]
        elif op < 0.8:
            key = random_key()
            _, node = cache.match_prefix(key)
            before = cache.protected_size()
            assert cache.inc_lock_ref(node) == cache.protected_size() - before
            locks.append((node, path_key(node)))
        elif op < 0.9 and locks:
            node, _ = locks.pop(rng.randrange(len(locks)))
            before = cache.protected_size()
            assert cache.dec_lock_ref(node) == cache.protected_size() - before
        else:
            want = rng.randint(1, 10)
            evictable = cache.evictable_size()
            freed = cache.evict(want)
            assert freed >= min(want, evictable)
            assert cache.evictable_size() == evictable - freed
            if freed < want:
                assert cache.evictable_size() == 0

        cache._check_invariants()
        assert max(freed_count.values(), default=1) == 1  # no double free
        assert cache.total_size() == len(ref.slot_of)
        assert sorted(cache.all_values().tolist()) == sorted(ref.slot_of.values())
        for node, key in locks:  # locked paths survive eviction and still resolve to the same node
            assert (node is cache.root_node or node.parent is not None) and path_key(node) == key
            assert ref.match_len(key) == len(key)

    for node, _ in locks:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    cache.evict(cache.total_size())
    assert cache.total_size() == 0 and not ref.slot_of
    cache._check_invariants()

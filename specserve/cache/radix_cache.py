"""Radix-tree prefix cache over token ids for a token-granular (page size 1) KV cache.

The tree is a compressed trie: every non-root node owns one edge, i.e. a ``key`` (list of token ids) and a
``value`` (1-D ``torch.int64`` tensor of KV-pool slot indices, ``value[i]`` holds the KV of ``key[i]``).
The concatenation of keys along a root-to-node path is a cached token prefix, and the concatenation of the
values is where its KV lives in the pool.

Bookkeeping:

* ``lock_ref``: number of live users (running requests) that depend on the node. Locking a node also locks
  every ancestor, so a locked node's whole path is protected. Locked nodes are never evicted.
* ``last_access``: a logical clock value (incremented once per ``match_prefix`` / ``insert``), giving a
  deterministic LRU order. Every access touches the whole path, so a parent is never older than its children.
* ``evictable_size`` / ``protected_size``: maintained counters of tokens held in unlocked / locked nodes.

The cache never allocates slots itself; it only takes ownership of slots passed to :meth:`RadixCache.insert`
and hands them back through the ``free_slots`` callback on eviction.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch

# Monotonic node ids: a deterministic tie-break for nodes with equal last_access in the eviction heap.
_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree (the root has an empty key and value)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor,  # int64 [len(key)]
        parent: TreeNode | None = None,
        last_access: int = 0,
    ) -> None:
        self.children: dict[int, TreeNode] = {}  # first token of child's key -> child
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = last_access
        self.id = next(_node_ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, key={_abbrev(self.key)}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, children={len(self.children)})"
        )


def _abbrev(seq: Sequence[int], limit: int = 12) -> str:
    """Short printable form of a token / slot list."""
    items = list(seq)
    if len(items) <= limit:
        return str(items)
    head = ", ".join(str(x) for x in items[: limit // 2])
    tail = ", ".join(str(x) for x in items[-(limit // 2) :])
    return f"[{head}, ... ({len(items)}) ..., {tail}]"


def _common_prefix_len(edge: list[int], key: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[start:]``."""
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


class RadixCache:
    """Prefix cache mapping token-id sequences to KV-pool slots (page size 1).

    Args:
        free_slots: called with an int64 [n] tensor of slots whenever evicted nodes release them.
        device: device of the empty tensors the cache creates itself (stored values keep their own device).
        disable: if True the cache stores nothing and never matches.
    """

    def __init__(
        self,
        free_slots: Callable[[torch.Tensor], None],
        device: str | torch.device = "cpu",
        disable: bool = False,
    ) -> None:
        self.free_slots = free_slots
        self.device = torch.device(device)
        self.disable = disable
        self.reset()

    # ------------------------------------------------------------------ lifecycle

    def reset(self) -> None:
        """Drop every node WITHOUT calling ``free_slots`` (the owner resets its pool separately)."""
        self.root_node = TreeNode(key=[], value=self._empty())
        self._clock = 0
        self._evictable_size = 0
        self._protected_size = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)  # int64 [0]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ lookup / insert

    def match_prefix(self, key: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of ``key``.

        Returns ``(slots, node)``: ``slots`` is int64 [m] (m = matched length) and ``node`` is the last node
        of the matched path. If the match ends inside an edge, that edge is split so ``node`` ends exactly at
        the match. An empty match gives ``(int64 [0], root_node)``. Refreshes ``last_access`` along the path.
        """
        if self.disable or len(key) == 0:
            return self._empty(), self.root_node
        node, matched, pieces = self._descend(key, self._tick())
        if matched == 0:
            return self._empty(), self.root_node
        return torch.cat(pieces), node  # int64 [matched]

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Cache ``key -> value`` (``value``: int64 [len(key)]).

        Returns the number of leading tokens that were already cached. For those positions the tree keeps its
        own slots and ignores ``value[:prefix_len]`` (the caller must free those duplicates); the new suffix
        takes a copy of ``value[prefix_len:]``.
        """
        if value.dim() != 1 or value.numel() != len(key):
            raise ValueError(
                f"value must be 1-D with len(key)={len(key)} entries, got shape {tuple(value.shape)}"
            )
        if self.disable or len(key) == 0:
            return 0
        now = self._tick()
        node, matched, _ = self._descend(key, now)
        if matched < len(key):
            leaf = TreeNode(
                key=list(key[matched:]),
                value=value[matched:].to(torch.int64).clone(),  # int64 [len(key) - matched]
                parent=node,
                last_access=now,
            )
            node.children[leaf.key[0]] = leaf
            self._evictable_size += len(leaf.key)
        return matched

    def _descend(self, key: Sequence[int], now: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Walk ``key`` from the root, splitting the last edge if the match ends inside it.

        Touches every node on the path with ``now``. Returns (last matched node, matched length, values along
        the path).
        """
        node = self.root_node
        node.last_access = now
        pos = 0
        pieces: list[torch.Tensor] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, key, pos)  # >= 1: child was found by key[pos]
            split = n < len(child.key)
            if split:
                child = self._split(child, n)
            child.last_access = now
            pieces.append(child.value)
            node = child
            pos += n
            if split:
                break
        return node, pos, pieces

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child``'s edge after ``n`` tokens; returns the new upper piece (child keeps its identity).

        The upper piece inherits the child's ``lock_ref`` (every lock through ``child`` also passes through
        it) and ``last_access``, so the size counters and the LRU ordering are unchanged.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n],  # int64 [n]
            parent=parent,
            last_access=child.last_access,
        )
        upper.lock_ref = child.lock_ref
        child.key = child.key[n:]
        child.value = child.value[n:]  # int64 [old_len - n]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper

    # ------------------------------------------------------------------ locking

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors (root excluded). Returns the change of ``protected_size()``."""
        delta = 0
        while node is not self.root_node:
            if node.parent is None:
                raise RuntimeError(f"cannot lock a node that is no longer in the tree: {node!r}")
            if node.lock_ref == 0:
                delta += self._move_tokens(len(node.key), to_protected=True)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one :meth:`inc_lock_ref` on ``node``. Returns the change of ``protected_size()`` (<= 0)."""
        delta = 0
        while node is not self.root_node:
            if node.parent is None or node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on an unlocked or detached node: {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta -= self._move_tokens(len(node.key), to_protected=False)
            node = node.parent
        return delta

    def _move_tokens(self, n: int, to_protected: bool) -> int:
        """Move ``n`` tokens between the evictable and protected counters; returns ``n``."""
        sign = 1 if to_protected else -1
        self._protected_size += sign * n
        self._evictable_size -= sign * n
        return n

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (or all evictable ones), LRU unlocked leaves first.

        A parent that becomes an unlocked leaf joins the candidates. Calls ``free_slots(node.value)`` for
        every removed node and returns the number of slots freed (may overshoot ``num_tokens`` within a node).
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n, _ in self._iter_nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            self.free_slots(node.value)
            freed += len(node.key)
            self._remove_leaf(node)
            if parent is not self.root_node and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def _remove_leaf(self, node: TreeNode) -> None:
        """Detach an unlocked leaf (its slots must already have been freed)."""
        parent = node.parent
        assert parent is not None and node.is_leaf and node.lock_ref == 0
        del parent.children[node.key[0]]
        node.parent = None
        self._evictable_size -= len(node.key)

    # ------------------------------------------------------------------ sizes / introspection

    def evictable_size(self) -> int:
        """Tokens held in unlocked nodes."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens held in locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        """Tokens held in the tree."""
        return self._evictable_size + self._protected_size

    def all_values(self) -> torch.Tensor:
        """Concatenated slots of every node (int64 [total_size()]), in depth-first order."""
        values = [n.value for n, _ in self._iter_nodes()]
        return torch.cat(values) if values else self._empty()

    def _iter_nodes(self) -> Iterator[tuple[TreeNode, int]]:
        """Depth-first (pre-order) iteration over non-root nodes as ``(node, depth)``, without recursion."""
        stack = [(child, 1) for child in reversed(self.root_node.children.values())]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))

    def pretty_print(self) -> str:
        """Human-readable dump of the tree (one node per line, indented by depth)."""
        lines = [
            f"RadixCache(total={self.total_size()}, evictable={self._evictable_size}, "
            f"protected={self._protected_size}, disable={self.disable})"
        ]
        for node, depth in self._iter_nodes():
            lines.append(
                f"{'  ' * depth}{_abbrev(node.key)} -> {_abbrev(node.value.tolist())} "
                f"lock={node.lock_ref} t={node.last_access}"
            )
        return "\n".join(lines)

    def _check_invariants(self) -> None:
        """Recompute everything from the tree and raise AssertionError on any inconsistency (for tests)."""
        root = self.root_node
        _require(root.parent is None and root.key == [] and root.value.numel() == 0, "bad root")
        _require(root.lock_ref == 0, "root must never be locked")
        evictable = protected = 0
        for node, _ in self._iter_nodes():
            parent = node.parent
            _require(parent is not None and len(node.key) > 0, f"detached or empty node {node!r}")
            _require(parent.children.get(node.key[0]) is node, f"children map mismatch at {node!r}")
            _require(
                node.value.dim() == 1 and node.value.numel() == len(node.key), f"value shape at {node!r}"
            )
            _require(node.value.dtype == torch.int64, f"value dtype {node.value.dtype} at {node!r}")
            child_locks = sum(c.lock_ref for c in node.children.values())
            _require(node.lock_ref >= child_locks, f"lock_ref below children's total at {node!r}")
            _require(parent is root or parent.last_access >= node.last_access, f"parent older at {node!r}")
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        _require(
            evictable == self._evictable_size, f"evictable {self._evictable_size} != recomputed {evictable}"
        )
        _require(
            protected == self._protected_size, f"protected {self._protected_size} != recomputed {protected}"
        )


def _require(cond: bool, msg: str) -> None:
    """Like ``assert`` but not stripped under ``python -O``."""
    if not cond:
        raise AssertionError(msg)

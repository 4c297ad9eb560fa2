"""N-gram draft cache for NGRAM speculative decoding: a token trie shared by all requests, and the draft trees
built from it. Pure Python, no model, no tensors; runs wherever the scheduler runs.

Trie
----
Every root-to-node path is an n-gram (n <= ``branch_length``) seen in inserted text. A node stores

* ``freq``: how many occurrences of its n-gram were inserted (see :meth:`NgramCache.insert` for exactly what
  is counted); ``csum`` is the sum of its children's ``freq`` (the denominator of PROB probabilities);
* ``tick``: recency, the value of a global clock (one tick per counted occurrence) at the node's last
  inserted occurrence. Each node's children dict is kept in the same order (most recent last).

The pool holds at most ``capacity`` nodes (the root excluded). When a node must be created in a full pool,
the least recently used LEAF (smallest tick) is evicted. Leaves live in an ``OrderedDict`` in tick order
(a counted occurrence moves a leaf to its end); a node that BECOMES a leaf because its last child was evicted
keeps its older tick, so it goes to a small heap instead; eviction takes the older of the two heads.
Internal nodes are never evicted: a path only loses its deepest, stalest nodes first.

Nodes are small integers indexing parallel lists (token, parent, freq, ...), not objects: the trie holds no
reference cycles and its dicts hold only ints, so the garbage collector never has to walk millions of nodes.

Memory
------
Storage grows with use: a new cache holds only the root, each created node appends one entry to every list,
and once ``capacity`` nodes exist new nodes reuse the ids of evicted ones, so the lists never grow past
``capacity + 1``. SGLang's default capacity of 10M nodes therefore costs nothing until text fills it.
Measured (CPython 3.11, resident memory before/after filling 1M nodes from random text over a 32000-id
vocabulary, ``gc.collect()`` both times): about 346 bytes per node with BFS, 423 with PROB (which also keeps
each node's ranked children), the bulk being each internal node's children dict and the leaf order's entry.
A full 10M-node cache thus takes about 3.5 GB (BFS) / 4.2 GB (PROB): :func:`capacity_memory_warning` says so
when that would exceed a share of the machine's RAM.

Draft trees
-----------
:meth:`NgramCache.match` looks up the last ``w`` context tokens for ``w`` from ``max_window`` down to
``min_window``; every matched node with children is an anchor (longest first). The draft tree hangs below the
root, which is ``context[-1]`` (already verified, not part of the output). Anchors are expanded one after
the other into one tree (same token path = same node) until ``max_draft_nodes`` nodes exist:

* ``BFS``: breadth-first; a trie node at depth ``d`` (so ``d`` tokens of matched context) contributes its
  ``breadth(d)`` most recent children; ``breadth`` falls linearly from ``max_bfs_breadth`` at
  ``d = min_window`` to ``min_bfs_breadth`` at ``d >= max_window``, so long (reliable) matches and deep
  nodes give narrow trees and short matches broad ones.
* ``PROB``: best-first by path probability, where a child's probability given its parent is
  ``child.freq / parent.csum`` and a path's is the product along it (1 at the anchor); each node offers its
  ``max_bfs_breadth`` most frequent children (ties: smaller token id). Equal probabilities: first pushed wins.

The output is ``(tokens, parents)`` in topological order: ``parents[i]`` is -1 (child of the root) or an
index ``< i``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import islice
from typing import Any

MATCH_TYPES = ("BFS", "PROB")
_ROOT = 0
_NONE = -1
# resident bytes per trie node, measured as described in the module docstring (section "Memory")
BYTES_PER_NODE = {"BFS": 346, "PROB": 423}
# a full cache may take at most this share of the machine's RAM before capacity_memory_warning speaks up
RAM_SHARE_WARN = 0.25


def check_ngram_params(
    branch_length: int,
    min_window: int,
    max_window: int,
    min_bfs_breadth: int,
    max_bfs_breadth: int,
    match_type: str,
) -> None:
    """Raise ValueError when the NGRAM parameters break SGLang's rules (docs/formats.md, "NGRAM draft cache")."""
    if branch_length <= 1:
        raise ValueError(f"branch_length must be > 1, got {branch_length}")
    if not 0 < min_window <= max_window < branch_length:
        raise ValueError(
            "need 0 < min_window <= max_window < branch_length, got "
            f"min_window={min_window}, max_window={max_window}, branch_length={branch_length}"
        )
    if not 0 < min_bfs_breadth <= max_bfs_breadth:
        raise ValueError(
            f"need 0 < min_bfs_breadth <= max_bfs_breadth, got {min_bfs_breadth}, {max_bfs_breadth}"
        )
    if match_type not in MATCH_TYPES:
        raise ValueError(f"match_type must be one of {', '.join(MATCH_TYPES)}, got {match_type!r}")


def bfs_breadth(depth: int, min_window: int, max_window: int, min_breadth: int, max_breadth: int) -> int:
    """Children taken from a trie node at ``depth`` in BFS mode: max_breadth at depth min_window, falling
    linearly (rounded down) to min_breadth at depth >= max_window; min_breadth when the windows are equal."""
    if max_window == min_window:
        return min_breadth
    steps = min(max(max_window - depth, 0), max_window - min_window)
    return min_breadth + (max_breadth - min_breadth) * steps // (max_window - min_window)


def full_cache_bytes(capacity: int, match_type: str) -> int:
    """Approximate resident memory of a cache holding ``capacity`` nodes (``BYTES_PER_NODE``)."""
    return capacity * BYTES_PER_NODE[match_type]


def capacity_memory_warning(capacity: int, match_type: str, ram_bytes: int | None,
                            share: float = RAM_SHARE_WARN) -> str | None:
    """A warning naming ``--speculative-ngram-capacity`` when a FULL cache would take more than ``share`` of
    ``ram_bytes``; None when it fits or the RAM is unknown. (Storage grows with use, so this is about where a
    long-running server may end up, not about startup.)"""
    need = full_cache_bytes(capacity, match_type)
    if ram_bytes is None or need <= share * ram_bytes:
        return None
    return (f"--speculative-ngram-capacity {capacity}: the n-gram cache grows with use up to about "
            f"{need / 2**30:.1f} GiB ({BYTES_PER_NODE[match_type]} B/node, {match_type}), more than "
            f"{share:.0%} of this machine's {ram_bytes / 2**30:.1f} GiB RAM; lower the flag to bound it")


class _DraftTree:
    """Draft tree under construction: node i is ``tokens[i]`` with parent ``parents[i]`` (-1 = root)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._index: dict[tuple[int, int], int] = {}  # (parent index, token) -> node index

    def full(self) -> bool:
        return len(self.tokens) >= self.cap

    def add(self, parent: int, token: int) -> int:
        """Index of the child ``token`` of ``parent``, created if new (caller checks ``full()`` first)."""
        key = (parent, token)
        idx = self._index.get(key)
        if idx is None:
            idx = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self._index[key] = idx
        return idx


class NgramCache:
    """Shared n-gram trie with a bounded node pool and LRU leaf eviction; builds BFS or PROB draft trees."""

    def __init__(
        self,
        capacity: int = 10_000_000,
        branch_length: int = 18,
        min_window: int = 1,
        max_window: int = 12,
        min_bfs_breadth: int = 1,
        max_bfs_breadth: int = 10,
        match_type: str = "BFS",
        max_draft_nodes: int = 11,
    ) -> None:
        check_ngram_params(branch_length, min_window, max_window, min_bfs_breadth, max_bfs_breadth, match_type)
        if capacity < branch_length:  # then a full pool always holds a leaf off the path being inserted
            raise ValueError(f"capacity must be >= branch_length ({branch_length}), got {capacity}")
        if max_draft_nodes < 0:
            raise ValueError(f"max_draft_nodes must be >= 0, got {max_draft_nodes}")
        self.capacity = capacity
        self.branch_length = branch_length
        self.min_window = min_window
        self.max_window = max_window
        self.min_bfs_breadth = min_bfs_breadth
        self.max_bfs_breadth = max_bfs_breadth
        self.match_type = match_type
        self.max_draft_nodes = max_draft_nodes
        self._prob = match_type == "PROB"
        # breadth by trie depth 0..branch_length (a node at depth branch_length has no children)
        self._breadth = [
            bfs_breadth(d, min_window, max_window, min_bfs_breadth, max_bfs_breadth) for d in range(branch_length + 1)
        ]
        self.reset()

    @classmethod
    def from_server_args(cls, args: Any, num_draft_tokens: int) -> NgramCache:
        """The cache for ``ServerArgs`` (``--speculative-ngram-*``) and the resolved N (tree nodes verified
        per step, root included, so ``max_draft_nodes = N - 1``)."""
        return cls(
            capacity=args.speculative_ngram_capacity,
            branch_length=args.speculative_ngram_branch_length,
            min_window=args.speculative_ngram_min_match_window_size,
            max_window=args.speculative_ngram_max_match_window_size,
            min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
            max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
            match_type=args.speculative_ngram_match_type,
            max_draft_nodes=num_draft_tokens - 1,
        )

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop every node (the root stays)."""
        self._tok: list[int] = [_NONE]  # node -> token id
        self._parent: list[int] = [_NONE]  # node -> parent node
        self._freq: list[int] = [0]  # node -> inserted occurrences of its n-gram
        self._csum: list[int] = [0]  # node -> sum of its children's freq
        self._tick: list[int] = [0]  # node -> clock at its last counted occurrence
        self._kids: list[dict[int, int] | None] = [None]  # node -> {token: child}, most recent last; None = leaf
        self._top: list[list[int] | None] = [None]  # PROB: node -> its most frequent children, best first
        self._count = 0  # live nodes, root excluded
        self._clock = 0
        self._leaves: OrderedDict[int, None] = OrderedDict()  # leaves, smallest tick first
        self._orphans: list[tuple[int, int]] = []  # heap of (tick, node): nodes that became leaves by eviction
        self._orphan_tick: dict[int, int] = {}  # node -> tick of its live heap entry (older entries are stale)

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root excluded (never more than ``capacity``)."""
        return self._count

    @property
    def allocated_nodes(self) -> int:
        """Node ids the storage lists hold, the root included: grows with use, at most ``capacity + 1``."""
        return len(self._tok)

    def node_stats(self, ngram: Sequence[int]) -> tuple[int, int] | None:
        """``(freq, tick)`` of the node whose path is ``ngram``, or None when absent (tests and debugging)."""
        node = self._walk(ngram)
        return None if node <= _ROOT else (self._freq[node], self._tick[node])

    def _check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (tests only; walks the whole trie)."""
        live, leaves, stack = 0, set(), [_ROOT]
        while stack:
            node = stack.pop()
            kids = self._kids[node]
            if kids is None:
                if node != _ROOT:
                    leaves.add(node)
                continue
            assert kids, "empty children dicts are stored as None"
            assert self._csum[node] == sum(self._freq[c] for c in kids.values())
            ticks = [self._tick[c] for c in kids.values()]
            assert ticks == sorted(ticks), "children must be in recency order"
            for tok, child in kids.items():
                assert self._tok[child] == tok and self._parent[child] == node and self._freq[child] >= 1
                live += 1
                stack.append(child)
            if self._prob and node != _ROOT:
                assert self._top[node] == self._most_frequent(node)
        assert live == self._count <= self.capacity
        assert leaves == set(self._leaves) | set(self._orphan_tick) and not set(self._leaves) & set(self._orphan_tick)
        ticks = [self._tick[n] for n in self._leaves]
        assert ticks == sorted(ticks), "the leaf order must be the tick order"
        assert all(self._tick[n] == t for n, t in self._orphan_tick.items())

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int], num_new: int | None = None) -> None:
        """Count the n-grams (n <= branch_length) of ``tokens`` that END in its last ``num_new`` tokens.

        For every start ``i`` (left to right) whose path ``tokens[i : i + branch_length]`` reaches a new token,
        the path is walked from the root down. Nodes of n-grams ending at a new position get ``freq += 1`` and
        the next clock value as ``tick`` (created if missing); nodes of n-grams ending in the older part are
        only looked up (recreated with ``freq = 1`` and a new tick if they were evicted).

        So with ``num_new=None`` (all tokens new: a prompt) every n-gram occurrence is counted, and a request
        that calls ``insert(seq, num_new=k)`` after each step that appended k tokens to ``seq`` (or after each
        prefill chunk of k tokens) counts each occurrence exactly once. Only the last
        ``branch_length - 1 + num_new`` tokens are read, so passing the whole sequence costs the same as
        passing that tail. Without ``num_new``, inserting overlapping windows again counts their shared
        n-grams again (once per call).
        """
        n = len(tokens)
        num_new = n if num_new is None else min(num_new, n)
        if num_new <= 0:
            return
        seq = list(map(int, tokens[max(0, n - num_new - (self.branch_length - 1)) :]))  # plain ints for the dicts
        n = len(seq)
        first_new = n - num_new
        kids_of, branch = self._kids, self.branch_length
        for start in range(n):
            cur = _ROOT
            for pos in range(start, min(n, start + branch)):
                tok = seq[pos]
                kids = kids_of[cur]
                node = _NONE if kids is None else kids.get(tok, _NONE)
                if node == _NONE:
                    node = self._new_node(cur, tok)
                elif pos >= first_new:
                    self._count_occurrence(cur, node, tok)
                cur = node

    def _count_occurrence(self, parent: int, node: int, tok: int) -> None:
        """One more occurrence of an existing node's n-gram: freq, tick and recency orders."""
        self._freq[node] += 1
        self._csum[parent] += 1
        kids = self._kids[parent]
        kids[tok] = kids.pop(tok)  # most recent sibling last
        self._clock += 1
        self._tick[node] = self._clock
        if self._kids[node] is None:  # a leaf: to the young end of the leaf order
            if node in self._leaves:
                self._leaves.move_to_end(node)
            else:
                del self._orphan_tick[node]
                self._leaves[node] = None
        if self._prob and parent != _ROOT:  # the root is never expanded: its children are not ranked
            self._rank(parent, node)

    def _new_node(self, parent: int, tok: int) -> int:
        """Create ``parent``'s child ``tok`` with one occurrence; in a full pool it reuses the id of the evicted
        least recently used leaf."""
        kids_of = self._kids
        if kids_of[parent] is None and parent != _ROOT:  # parent stops being a leaf: out of the eviction order
            if self._leaves.pop(parent, _NONE) == _NONE:
                del self._orphan_tick[parent]
        if self._count >= self.capacity:
            node = self._evict_one()
            if kids_of[parent] is None:  # the victim was its last child: parent became an orphan leaf; undo
                self._orphan_tick.pop(parent, None)
        else:
            node = len(self._tok)
            self._tok.append(tok)
            self._parent.append(parent)
            self._freq.append(1)
            self._csum.append(0)
            self._tick.append(0)
            self._kids.append(None)
            self._top.append(None)
            self._count += 1
        self._clock += 1
        self._tok[node] = tok
        self._parent[node] = parent
        self._freq[node] = 1
        self._csum[node] = 0
        self._tick[node] = self._clock
        kids = kids_of[parent]
        if kids is None:
            kids = kids_of[parent] = {}
        kids[tok] = node
        self._csum[parent] += 1
        self._leaves[node] = None
        if self._prob and parent != _ROOT:
            self._rank(parent, node)
        return node

    def _evict_one(self) -> int:
        """Unlink the leaf with the smallest tick (the head of the leaf order or of the orphan heap) and return
        its id for reuse; its parent may become an (orphan) leaf."""
        orphans, orphan_tick = self._orphans, self._orphan_tick
        while orphans and orphan_tick.get(orphans[0][1]) != orphans[0][0]:
            heapq.heappop(orphans)  # stale: the node got a child, an occurrence, or was evicted since
        leaf = next(iter(self._leaves), _NONE)
        if orphans and (leaf == _NONE or orphans[0][0] < self._tick[leaf]):
            victim = heapq.heappop(orphans)[1]
            del orphan_tick[victim]
        elif leaf != _NONE:
            victim = leaf
            del self._leaves[leaf]
        else:
            raise RuntimeError("n-gram cache: no leaf to evict")
        parent = self._parent[victim]
        kids = self._kids[parent]
        del kids[self._tok[victim]]
        self._csum[parent] -= self._freq[victim]
        if not kids:
            self._kids[parent] = None
            if parent != _ROOT:  # a new leaf with an old tick: to the heap
                heapq.heappush(orphans, (self._tick[parent], parent))
                orphan_tick[parent] = self._tick[parent]
        if self._prob:
            top = self._top[parent]
            if top is not None and victim in top:
                self._top[parent] = self._most_frequent(parent)
            self._top[victim] = None
        return victim

    # ------------------------------------------------------------------ PROB ranking
    def _ranks_before(self, a: int, b: int) -> bool:
        fa, fb = self._freq[a], self._freq[b]
        return fa > fb or (fa == fb and self._tok[a] < self._tok[b])

    def _rank(self, parent: int, child: int) -> None:
        """Keep ``_top[parent]`` = its ``max_bfs_breadth`` most frequent children after ``child``'s freq rose.

        Frequencies only grow between evictions, so only the child that grew can enter the list or move up.
        """
        top = self._top[parent]
        if top is None:
            self._top[parent] = [child]
            return
        if child in top:
            i = top.index(child)
        elif len(top) < self.max_bfs_breadth:
            top.append(child)
            i = len(top) - 1
        elif self._ranks_before(child, top[-1]):
            top[-1] = child
            i = len(top) - 1
        else:
            return
        while i > 0 and self._ranks_before(top[i], top[i - 1]):
            top[i], top[i - 1] = top[i - 1], top[i]
            i -= 1

    def _most_frequent(self, node: int) -> list[int] | None:
        kids = self._kids[node]
        if not kids:
            return None
        freq, tok = self._freq, self._tok
        return heapq.nsmallest(self.max_bfs_breadth, kids.values(), key=lambda c: (-freq[c], tok[c]))

    # ------------------------------------------------------------------ match
    def match(self, context: Sequence[int]) -> tuple[list[int], list[int]]:
        """Draft tree for ``context`` (root = ``context[-1]``, not included): ``(tokens, parents)``, both of
        length <= max_draft_nodes, topologically ordered; empty lists when no window matches."""
        anchors = self._anchors(context)
        if not anchors or self.max_draft_nodes == 0:
            return [], []
        tree = _DraftTree(self.max_draft_nodes)
        for anchor, window in anchors:
            if tree.full():
                break
            if self._prob:
                self._expand_prob(tree, anchor)
            else:
                self._expand_bfs(tree, anchor, window)
        return tree.tokens, tree.parents

    def batch_match(self, contexts: Sequence[Sequence[int]]) -> list[tuple[list[int], list[int]]]:
        """``match`` for each context."""
        return [self.match(context) for context in contexts]

    def _walk(self, ngram: Sequence[int]) -> int:
        """Node whose path is ``ngram`` (the root for an empty one), or -1 when absent."""
        kids_of = self._kids
        node = _ROOT
        for tok in ngram:
            kids = kids_of[node]
            if kids is None:
                return _NONE
            node = kids.get(tok, _NONE)
            if node == _NONE:
                return _NONE
        return node

    def _anchors(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """``(node, window)`` of every matched suffix window that has children, longest window first."""
        n = len(context)
        tail = list(map(int, context[max(0, n - self.max_window) :]))
        out = []
        for window in range(min(self.max_window, n), self.min_window - 1, -1):
            node = self._walk(tail[len(tail) - window:])
            if node > _ROOT and self._kids[node] is not None:
                out.append((node, window))
        return out

    def _expand_bfs(self, tree: _DraftTree, anchor: int, window: int) -> None:
        kids_of, breadth = self._kids, self._breadth
        queue = deque([(-1, anchor, window)])  # (draft parent index, trie node, trie depth)
        while queue and not tree.full():
            parent, node, depth = queue.popleft()
            kids = kids_of[node]
            if kids is None:
                continue
            for tok, child in islice(reversed(kids.items()), breadth[depth]):
                if tree.full():
                    return
                queue.append((tree.add(parent, tok), child, depth + 1))

    def _expand_prob(self, tree: _DraftTree, anchor: int) -> None:
        heap: list[tuple[float, int, int, int]] = []  # (-path probability, push order, draft parent, trie node)
        order = itertools.count()
        self._push_children(heap, order, -1, anchor, 1.0)
        while heap and not tree.full():
            neg_prob, _, parent, node = heapq.heappop(heap)
            idx = tree.add(parent, self._tok[node])
            self._push_children(heap, order, idx, node, -neg_prob)

    def _push_children(self, heap: list, order: itertools.count, parent: int, node: int, prob: float) -> None:
        top = self._top[node]
        if not top:
            return
        total = self._csum[node]
        for child in top:
            heapq.heappush(heap, (-prob * self._freq[child] / total, next(order), parent, child))

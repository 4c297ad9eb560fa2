"""Draft trees for speculative decoding: building, duplicate merging and the EAGLE-2 rerank. Pure tensor code.

A draft tree holds, per request, N nodes in topological order (a parent always has a smaller index than its
children). Node 0 is the ROOT: the last token already chosen (the bonus token of the previous step), whose KV the
target has not computed yet. The target's verify forward takes all N nodes, root first, with the tree mask
(node i attends to the whole prefix plus its ancestors and itself) at positions `prefix_len + depth`.

Padding convention (requests with fewer real nodes than N, e.g. n-gram drafts): node i is real iff
i < num_nodes[b]. A padding node has token 0, parent -1, depth 0, no children and no siblings, and its mask row
holds only itself. No real node has it as a parent, so verification (which only walks parent -> child links,
and checks `valid` besides) can never accept it; the verify forward may still compute it (its output is ignored).

Duplicate siblings (same parent, same token) are MERGED: the later node is dropped and its children are
re-parented to the first one (recursively, so their own duplicates merge too). Lossless tree sampling needs the
children of a node to carry distinct tokens, and merging keeps every drafted continuation available.

All functions are batched over B requests and keep the device of their inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor


@dataclass
class DraftTree:
    """A batch of draft trees, N nodes per request (node 0 = root). All tensors on one device."""

    tokens: Tensor  # [B, N] int64: node tokens; tokens[:, 0] = root token; padding nodes hold 0
    parents: Tensor  # [B, N] int64: parent node index, -1 for the root and for padding; parents[b, i] < i
    depth: Tensor  # [B, N] int64: root 0 (padding 0); verify positions = prefix_len + depth
    mask: Tensor  # [B, N, N] bool: mask[b, i, j] = node j is node i or an ancestor of node i
    num_nodes: Tensor  # [B] int64: real nodes per request, root included (1..N); the rest is padding
    # (first_child, next_sibling), built from parents on first use: the greedy walk never needs them
    links: tuple[Tensor, Tensor] | None = field(default=None, repr=False)
    full: bool = False  # every request has all N nodes (no padding), so `valid` is all True

    @property
    def first_child(self) -> Tensor:
        """[B, N] int64: smallest-index child, -1 = leaf."""
        return self._links()[0]

    @property
    def next_sibling(self) -> Tensor:
        """[B, N] int64: next child of the same parent (index order), -1 = none."""
        return self._links()[1]

    def _links(self) -> tuple[Tensor, Tensor]:
        if self.links is None:
            self.links = _child_links(self.parents)
        return self.links

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """N: nodes per request, padding included."""
        return self.tokens.shape[1]

    @property
    def valid(self) -> Tensor:
        """[B, N] bool: real (non-padding) nodes."""
        if self.full:
            return torch.ones_like(self.tokens, dtype=torch.bool)
        return _valid_mask(self.num_nodes, self.width)

    @property
    def max_depth(self) -> int:
        """Deepest node over the batch (a device sync)."""
        return int(self.depth.max().item())

    def positions(self, prefix_lens: Tensor) -> Tensor:
        """prefix_lens [B] = tokens whose KV is cached before the root -> verify positions [B, N] int64."""
        return prefix_lens.to(torch.int64).view(-1, 1) + self.depth


def max_tree_nodes(steps: int, topk: int) -> int:
    """The largest --speculative-num-draft-tokens a (steps, topk) draft can fill: the root plus every candidate the
    EAGLE-2 rerank chooses from (level 0 drafts topk, each later level topk children of each of topk branches)."""
    return 1 + topk + (steps - 1) * topk * topk


def _valid_mask(num_nodes: Tensor, width: int) -> Tensor:
    return torch.arange(width, device=num_nodes.device).view(1, -1) < num_nodes.view(-1, 1)  # [B, N]


def _first_true(m: Tensor) -> Tensor:
    """m [..., K] bool -> index of the first True along the last dim, -1 where none [...]."""
    idx = m.to(torch.uint8).argmax(dim=-1)  # argmax returns the first maximal index
    return torch.where(m.any(dim=-1), idx, torch.full_like(idx, -1))


# ----------------------------------------------------------------------------------------------------------------
# Structure from parents
# ----------------------------------------------------------------------------------------------------------------


def _ancestor_mask(parents: Tensor) -> Tensor:
    """parents [B, N] (-1 = none) -> mask [B, N, N]: node j is node i or one of its ancestors.

    Pointer jumping: after t rounds, mask[i] covers the ancestors at distance < 2^t and ptr[i] is the ancestor at
    distance 2^t (or the sentinel N). ceil(log2 N) rounds cover every distance up to N - 1, with no device sync.
    """
    B, N = parents.shape
    dev = parents.device
    mask = torch.eye(N, dtype=torch.bool, device=dev).expand(B, N, N).contiguous()  # [B, N, N]
    sentinel = torch.full((B, 1), N, dtype=torch.int64, device=dev)  # [B, 1]
    ptr = torch.where(parents < 0, N, parents)  # [B, N]; N = "no ancestor"
    empty_row = torch.zeros(B, 1, N, dtype=torch.bool, device=dev)  # [B, 1, N]
    for _ in range(math.ceil(math.log2(N)) if N > 1 else 0):
        ext = torch.cat([mask, empty_row], dim=1)  # [B, N+1, N]
        mask = mask | ext.gather(1, ptr.unsqueeze(-1).expand(B, N, N))  # [B, N, N]
        ptr = torch.cat([ptr, sentinel], dim=1).gather(1, ptr)  # [B, N]
    return mask


def _child_links(parents: Tensor) -> tuple[Tensor, Tensor]:
    """parents [B, N] -> (first_child [B, N], next_sibling [B, N]), children in index order, -1 = none."""
    N = parents.shape[1]
    idx = torch.arange(N, device=parents.device)  # [N]
    is_child = parents.unsqueeze(1) == idx.view(1, N, 1)  # [B, N(parent p), N(node i)]: parents[i] == p
    first_child = _first_true(is_child)  # [B, N]
    same_parent = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (parents >= 0).unsqueeze(2)  # [B, N, N]
    later = idx.view(1, 1, N) > idx.view(1, N, 1)  # [1, N, N]: j > i
    next_sibling = _first_true(same_parent & later)  # [B, N]
    return first_child, next_sibling


def _from_parents(tokens: Tensor, parents: Tensor, num_nodes: Tensor, full: bool = False) -> DraftTree:
    """Finished node lists (padding already applied, no duplicate siblings) -> DraftTree."""
    mask = _ancestor_mask(parents)  # [B, N, N]
    depth = mask.sum(dim=-1) - 1  # [B, N]: number of strict ancestors
    return DraftTree(tokens, parents, depth, mask, num_nodes, full=full)


def _apply_padding(tokens: Tensor, parents: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Padding nodes get token 0 and parent -1 (see the module docstring)."""
    return tokens.masked_fill(~valid, 0), parents.masked_fill(~valid, -1)


# ----------------------------------------------------------------------------------------------------------------
# Duplicate siblings
# ----------------------------------------------------------------------------------------------------------------


def _canonical_step(canon: Tensor, tokens: Tensor, parents: Tensor, valid: Tensor) -> Tensor:
    """One round: each real node maps to the first real node with the same token whose parent maps to the same
    canonical node. After t rounds every node at depth <= t is final (its parent's entry was final a round
    earlier), and the result is the unique fixed point of this step."""
    B, N = tokens.shape
    canon_ext = torch.cat([canon, torch.full((B, 1), -1, dtype=torch.int64, device=canon.device)], dim=1)
    cparent = canon_ext.gather(1, torch.where(parents < 0, N, parents))  # [B, N]; -1 for the root
    same = (cparent.unsqueeze(2) == cparent.unsqueeze(1)) & (tokens.unsqueeze(2) == tokens.unsqueeze(1))
    same = same & valid.unsqueeze(1) & valid.unsqueeze(2)  # [B, N, N]; diagonal True for real nodes
    first = _first_true(same)  # [B, N]; <= own index for real nodes
    own = torch.arange(N, device=canon.device).expand(B, N)  # [B, N]
    return torch.where(valid, first, own)


def _merge_duplicates(tokens: Tensor, parents: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merge duplicate siblings; returns compacted (tokens [B, N], parents [B, N], num_nodes [B]).

    Costs one round and one sync when there is nothing to merge (the usual case)."""
    B, N = tokens.shape
    own = torch.arange(N, device=tokens.device).expand(B, N)  # [B, N]
    canon = own
    while True:
        nxt = _canonical_step(canon, tokens, parents, valid)
        if torch.equal(nxt, canon):
            break
        canon = nxt
    keep = valid & (canon == own)  # [B, N]
    if torch.equal(keep, valid):
        return tokens, parents, valid.sum(dim=1)
    return _compact(tokens, parents, keep, canon.gather(1, parents.clamp(min=0)))


def _compact(tokens: Tensor, parents: Tensor, keep: Tensor, parent_of: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Keep the nodes where keep [B, N] is True, in their order, at the front; padding after them.
    parent_of [B, N]: the (kept) node each node hangs under, by old index (for nodes whose parents >= 0).
    -> (tokens [B, N], parents [B, N] by new index, num_nodes [B])."""
    N = tokens.shape[1]
    new_index = keep.cumsum(dim=1) - 1  # [B, N]: position of each kept node after compaction
    new_parents = torch.where(parents < 0, -1, new_index.gather(1, parent_of))  # [B, N]
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # [B, N]: kept nodes first, in order
    num_nodes = keep.sum(dim=1)  # [B]
    tokens, parents = tokens.gather(1, order), new_parents.gather(1, order)
    return (*_apply_padding(tokens, parents, _valid_mask(num_nodes, N)), num_nodes)


def cap_depth(tree: DraftTree, max_depth: Tensor) -> DraftTree:
    """Drop the nodes of request b deeper than max_depth[b] ([B] int64, >= 0) -> a DraftTree of the same width with
    the kept nodes first, in their order. A node's ancestors are shallower than it, so what is kept is a tree.
    The tree itself is returned when nothing is dropped."""
    keep = tree.valid & (tree.depth <= max_depth.view(-1, 1))  # [B, N]
    if bool(keep.sum() == tree.num_nodes.sum()):
        return tree
    tokens, parents, num_nodes = _compact(tree.tokens, tree.parents, keep, tree.parents.clamp(min=0))
    return _from_parents(tokens, parents, num_nodes)


# ----------------------------------------------------------------------------------------------------------------
# Public builders
# ----------------------------------------------------------------------------------------------------------------


def _check_inputs(root_tokens: Tensor, tokens: Tensor, parents: Tensor, num_nodes: Tensor) -> None:
    B, M = tokens.shape
    if root_tokens.shape != (B,) or parents.shape != (B, M) or num_nodes.shape != (B,):
        raise ValueError(f"shape mismatch: root {tuple(root_tokens.shape)}, tokens {tuple(tokens.shape)}, "
                         f"parents {tuple(parents.shape)}, num_nodes {tuple(num_nodes.shape)}")
    node_idx = torch.arange(1, M + 1, device=tokens.device).view(1, M)  # [1, M]: node index of candidate m
    real = node_idx < num_nodes.view(B, 1)  # [B, M]
    bad = real & ((parents < 0) | (parents >= node_idx) | (tokens < 0))  # parents must precede their child
    if bool(((num_nodes < 1) | (num_nodes > M + 1)).any() | bad.any() | (root_tokens < 0).any()):
        raise ValueError("invalid draft tree: need 1 <= num_nodes <= M+1, tokens >= 0 and, for every real "
                         "candidate m (node m+1), 0 <= parents[b, m] <= m")


def build_tree(root_tokens: Tensor, tokens: Tensor, parents: Tensor, num_nodes: Tensor | None = None, *,
               check: bool = True, merge: bool = True) -> DraftTree:
    """Build a batch of draft trees.

    root_tokens [B] int64; tokens [B, M] int64: candidate m is node m + 1; parents [B, M] int64: NODE index of
    each candidate's parent (0 = root), so parents[b, m] <= m; num_nodes [B] int64: real nodes per request
    including the root (default M + 1 for all); entries of candidates past num_nodes - 1 are ignored.
    Duplicate siblings are merged (module docstring), which may lower num_nodes. Result width N = M + 1.
    check=False skips validating the inputs (~15 ops and a device sync), for callers that built them valid;
    merge=False skips the duplicate search (~25 ops, two syncs), for callers whose siblings are distinct already.
    """
    B, M = tokens.shape
    dev = tokens.device
    full = num_nodes is None
    if full:
        num_nodes = torch.full((B,), M + 1, dtype=torch.int64, device=dev)
    num_nodes = num_nodes.to(device=dev, dtype=torch.int64)
    if check:
        _check_inputs(root_tokens, tokens, parents, num_nodes)
    all_tokens = _as_int64(torch.cat([root_tokens.view(B, 1), tokens], dim=1))  # [B, N]
    all_parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=dev), _as_int64(parents)], 1)
    if not merge and full:  # nothing to pad, nothing to merge: every node stays
        return _from_parents(all_tokens, all_parents, num_nodes, full=True)
    valid = _valid_mask(num_nodes, M + 1)  # [B, N]
    all_tokens, all_parents = _apply_padding(all_tokens, all_parents, valid)
    if merge:
        all_tokens, all_parents, num_nodes = _merge_duplicates(all_tokens, all_parents, valid)
    return _from_parents(all_tokens, all_parents, num_nodes)


def _as_int64(t: Tensor) -> Tensor:
    """t as int64, without a dispatched no-op cast when it already is (the per-step paths count ops)."""
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def build_chain(root_tokens: Tensor, tokens: Tensor, num_nodes: Tensor | None = None) -> DraftTree:
    """A chain (topk == 1, or a linear n-gram draft): node i's parent is i - 1. No sync, no search.

    root_tokens [B]; tokens [B, M] (node m + 1 = tokens[:, m]); num_nodes [B] as in build_tree (default M + 1).
    """
    B, M = tokens.shape
    N, dev = M + 1, tokens.device
    idx = torch.arange(N, device=dev)  # [N]
    all_tokens = torch.cat([root_tokens.view(B, 1), tokens], dim=1).to(torch.int64)  # [B, N]
    if num_nodes is None:
        tril = torch.ones(N, N, dtype=torch.bool, device=dev).tril()  # [N, N]
        first_child = torch.where(idx + 1 < N, idx + 1, -1)  # [N]
        return DraftTree(all_tokens, (idx - 1).expand(B, N).contiguous(), idx.expand(B, N).contiguous(),
                         tril.expand(B, N, N).contiguous(), torch.full((B,), N, dtype=torch.int64, device=dev),
                         (first_child.expand(B, N).contiguous(), torch.full((B, N), -1, dtype=torch.int64, device=dev)),
                         full=True)
    num_nodes = num_nodes.to(device=dev, dtype=torch.int64)
    valid = _valid_mask(num_nodes, N)  # [B, N]
    all_tokens, parents = _apply_padding(all_tokens, (idx - 1).expand(B, N), valid)
    depth = torch.where(valid, idx, 0)  # [B, N]
    mask = torch.ones(N, N, dtype=torch.bool, device=dev).tril() & valid.unsqueeze(1) & valid.unsqueeze(2)
    mask = mask | torch.eye(N, dtype=torch.bool, device=dev)  # [B, N, N]: padding rows see only themselves
    first_child = torch.where(idx + 1 < num_nodes.view(B, 1), idx + 1, -1)  # [B, N]
    return DraftTree(all_tokens, parents, depth, mask, num_nodes,
                     (first_child, torch.full((B, N), -1, dtype=torch.int64, device=dev)))


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-2: expansion levels and rerank
# ----------------------------------------------------------------------------------------------------------------


class LevelExpansion(NamedTuple):
    scores: Tensor  # [B, L*K] cumulative path probability of each new candidate (branch-major order)
    tokens: Tensor  # [B, L*K] their tokens
    best: Tensor  # [B, L] int64: indices into the L*K candidates of the new live branches, best first

    @property
    def parent_branch(self) -> Tensor:
        """[B, L*K] int64: index (0..L-1) of the live branch each candidate extends (candidate // K)."""
        B, L = self.best.shape
        K = self.scores.shape[1] // L
        return torch.arange(L, device=self.best.device).repeat_interleave(K).expand(B, L * K)


def _rank_desc(scores: Tensor) -> Tensor:
    """scores [B, M] -> candidate indices [B, M] ordered by score desc, ties by index asc (stable sort)."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


def expand_level(live_scores: Tensor, child_probs: Tensor, child_tokens: Tensor) -> LevelExpansion:
    """One EAGLE-2 expansion level after level 0.

    live_scores [B, L]: cumulative probabilities of the L live branches; child_probs / child_tokens [B, L, K]:
    the draft's top-K next-token probabilities and tokens at each live branch. Every branch x child pair is a
    candidate scored live_score * child_prob; the best L of them (score desc, ties by index asc) become the next
    live branches. (Level 0 takes the root's top-K directly: scores = probs, no expansion.)
    """
    B, L, K = child_probs.shape
    scores = (live_scores.unsqueeze(2) * child_probs).reshape(B, L * K)  # [B, L*K]
    best = _rank_desc(scores)[:, :L]  # [B, L]
    return LevelExpansion(scores, child_tokens.reshape(B, L * K), best)


def drafting_can_stop(cand_scores: Tensor, live_scores: Tensor, keep: int, threshold: float = 0.0) -> Tensor:
    """Per request, whether drafting deeper levels is pointless (exact) or not worth it (threshold) -> [B] bool.

    cand_scores [B, M]: cumulative scores of every candidate drafted so far (probabilities in [0, 1]);
    live_scores [B, K]: those of the live branches, the only ones a next level expands; keep = N - 1, the number
    of candidates the rerank keeps (``select_eagle_tree``).

    Exact stop: a future candidate descends from a live branch, so its score is at most max(live_scores) (a
    child's score is its parent's times a probability <= 1), and its index is larger than every current one. A
    current candidate with score >= max(live_scores) therefore ranks before it (score desc, ties by index asc).
    When at least `keep` current candidates do, no future candidate can enter the kept set: the tree selected now
    equals the one a full-depth draft would select.

    Threshold stop (changes the TREE, never the output: verification is exact for any tree): the best live path's
    probability is below `threshold`, so deeper nodes are unlikely to be accepted. With fewer than `keep`
    candidates drafted (a chain, or a tree stopped at its first level) the tree is then smaller than N nodes.
    threshold 0 turns it off.
    """
    best_live = live_scores.max(dim=1, keepdim=True).values  # [B, 1]
    exact = (cand_scores >= best_live).sum(dim=1) >= keep  # [B]
    if threshold <= 0:
        return exact
    return exact | (best_live.squeeze(1) < threshold)


class EagleCandidates:
    """Accumulates the candidate list of one EAGLE-2 draft (level by level, parents before children).

    cands = EagleCandidates(root_probs, root_tokens)        # level 0: the root's top-K, all live
    best = cands.add_level(child_probs, child_tokens)       # per further level; best [B, K] indexes the K*K
                                                            # new candidates: branch best // K, child best % K
    tree = cands.select(root_tokens, num_draft_tokens)

    On a CPU the bookkeeping runs on numpy views of the same memory (``host``): these arrays hold a few dozen
    elements, where a numpy call costs about a microsecond and a torch op several (one request's 7 levels and a
    12-node selection took 2.4-2.8x less time than through torch ops). Same arithmetic (float32 products, stable
    ranking), same trees (``test_host_bookkeeping_equals_the_torch_path``).
    """

    def __init__(self, root_probs: Tensor, root_tokens: Tensor, host: bool | None = None):  # [B, K] each
        """host: bookkeeping on numpy arrays (None: on a CPU)."""
        B, K = root_probs.shape
        self.topk = K
        self.host = root_probs.device.type == "cpu" if host is None else host
        self._scores = [_host(root_probs) if self.host else root_probs]  # list of [B, *]
        self._tokens = [_host(_as_int64(root_tokens)) if self.host else _as_int64(root_tokens)]
        if self.host:
            self._parents = [np.full((B, K), -1, dtype=np.int64)]
            self.live_index = np.broadcast_to(np.arange(K), (B, K))  # [B, K] candidate indices
        else:
            self._parents = [torch.full((B, K), -1, dtype=torch.int64, device=root_probs.device)]
            self.live_index = torch.arange(K, device=root_probs.device).expand(B, K)
        self._count = K
        self._all_scores = self._scores[0]  # cat of self._scores, made on demand
        self.live_scores = self._scores[0]  # [B, K]

    def add_level(self, child_probs: Tensor, child_tokens: Tensor) -> Tensor:
        """child_probs / child_tokens [B, K, K] at the live branches -> best [B, K] (see expand_level)."""
        B, L, K = child_probs.shape
        if self.host:
            scores, best = _host_expand_level(self.live_scores, _host(child_probs))
            tokens, parents = _host(_as_int64(child_tokens)).reshape(B, L * K), np.repeat(self.live_index, K, axis=1)
            live_scores = scores[np.arange(B)[:, None], best]
        else:
            lvl = expand_level(self.live_scores, child_probs, child_tokens)
            scores, best, tokens = lvl.scores, lvl.best, _as_int64(lvl.tokens)
            # [B, L*K] candidate index of each new candidate's parent: live branch l's, K times (branch-major)
            parents = self.live_index.unsqueeze(2).expand(B, L, K).reshape(B, L * K)
            live_scores = scores.gather(1, best)
        self._scores.append(scores)
        self._all_scores = None
        self._tokens.append(tokens)
        self._parents.append(parents)
        self.live_index = self._count + best  # [B, K]
        self.live_scores = live_scores  # [B, K]
        self._count += scores.shape[1]
        return torch.from_numpy(best) if self.host else best

    def extend_levels(self, scores: Tensor, tokens: Tensor, parents: Tensor) -> None:
        """Levels drafted in one call (``DraftModel.levels``): scores [B, n] and tokens, parents [B, n] (candidate
        indices) of the n candidates after those so far, in candidate order. Only ``select`` follows: the live
        branches are not tracked."""
        if scores.shape[1] == 0:
            return
        if self.host:
            scores, tokens, parents = _host(scores), _host(tokens), _host(parents)
        self._scores.append(scores)
        self._tokens.append(tokens)
        self._parents.append(parents)
        self._all_scores = None
        self._count += scores.shape[1]
        self.live_index = self.live_scores = None

    def can_stop(self, keep: int, threshold: float = 0.0) -> bool:
        """True when no request needs a deeper level (``drafting_can_stop`` for every request)."""
        if self._count < keep:  # too few candidates for the exact stop: only the threshold can stop
            return threshold > 0 and bool(self.live_scores.max() < threshold)
        if self.host:
            return bool(_host_can_stop(self.scores(), self.live_scores, keep, threshold).all())
        return bool(drafting_can_stop(self.scores(), self.live_scores, keep, threshold).all())

    def scores(self) -> Tensor:
        """[B, M] cumulative scores of every candidate drafted so far (a numpy array on the host path)."""
        if self._all_scores is None:
            cat = np.concatenate if self.host else torch.cat
            self._all_scores = cat(self._scores, 1)
        return self._all_scores

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """(cand_tokens, cand_parents, cand_scores), each [B, M]."""
        if self.host:
            return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in self._arrays())
        return torch.cat(self._tokens, 1), torch.cat(self._parents, 1), self.scores()

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The host path's (cand_tokens, cand_parents, cand_scores), each [B, M]."""
        return np.concatenate(self._tokens, 1), np.concatenate(self._parents, 1), self.scores()

    def select(self, root_tokens: Tensor, num_draft_tokens: int, distinct: bool = False) -> DraftTree:
        """The rerank over what was drafted: N = num_draft_tokens nodes, fewer when drafting stopped before N - 1
        candidates existed (``can_stop`` with a threshold). distinct: the children of a candidate carry distinct
        tokens (top-k ids through an injective id map), so no duplicates need merging."""
        n = min(num_draft_tokens, self._count + 1)
        if self.host and distinct and self.topk > 1 and n >= 1:
            return _host_select(_host(root_tokens), *self._arrays(), n)
        tokens, parents, scores = self.tensors()
        return select_eagle_tree(root_tokens, tokens, parents, scores, n, topk=self.topk, distinct=distinct)


def select_eagle_tree(
    root_tokens: Tensor,
    cand_tokens: Tensor,
    cand_parents: Tensor,
    cand_scores: Tensor,
    num_draft_tokens: int,
    *,
    topk: int | None = None,
    distinct: bool = False,
) -> DraftTree:
    """EAGLE-2 rerank: keep the root plus the best N-1 candidates (N = num_draft_tokens).

    root_tokens [B]; cand_tokens [B, M]; cand_parents [B, M]: CANDIDATE index of each parent, -1 = root;
    cand_scores [B, M]: cumulative path probability or log-prob, a child never above its parent.
    N - 1 > M raises ValueError (start-up validates N - 1 <= K + (S-1) * K^2, what S levels draft). topk == 1 (a
    chain) takes the first N-1 candidates through build_chain, with no sort. distinct=True: siblings carry distinct
    tokens (the caller guarantees it), so duplicate merging is skipped.

    Why the kept set is ancestor-closed: order the candidates by (score desc, index asc). For a child c of p,
    score[c] <= score[p] and index[p] < index[c] (candidates are listed level by level), so p sorts strictly
    before c: either score[p] > score[c], or the scores tie and the smaller index wins. Every candidate's parent
    therefore precedes it in this total order, so every prefix of the order (in particular the top N-1) contains
    the parent of each of its members, and by induction all its ancestors. A stable descending sort yields
    exactly this order, ties included (e.g. a child whose probability is exactly 1.0 ties its parent).
    The kept candidates are then put back in candidate order, so parents still precede children.
    """
    B, M = cand_tokens.shape
    keep = num_draft_tokens - 1
    if keep < 0 or keep > M:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} needs 1 <= N <= M+1 = {M + 1} (candidates: {M})")
    if topk == 1:
        return build_chain(root_tokens, cand_tokens[:, :keep])
    kept = _rank_desc(cand_scores)[:, :keep].sort(dim=1).values  # [B, N-1] candidate indices, candidate order
    # node index of each candidate: 0 if dropped (never read for kept ones), else its position + 1
    node_of = torch.zeros(B, M + 1, dtype=torch.int64, device=cand_tokens.device)  # [B, M+1]; column M = root
    pos = torch.arange(1, keep + 1, device=cand_tokens.device).expand(B, keep)  # [B, N-1]
    node_of.scatter_(1, kept, pos)
    parents = cand_parents.gather(1, kept)  # [B, N-1] candidate index, -1 = root
    node_parents = node_of.gather(1, torch.where(parents < 0, M, parents))  # [B, N-1]: root column holds 0
    # valid by construction (each kept node's parent is kept and precedes it), so build_tree need not check
    return build_tree(root_tokens, cand_tokens.gather(1, kept), node_parents, check=False, merge=not distinct)


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-2 on host arrays (``EagleCandidates`` on a CPU): the functions above in numpy, same results
# ----------------------------------------------------------------------------------------------------------------


def _host(t: Tensor) -> np.ndarray:
    """A CPU tensor's numpy view (no copy; the drafter's tensors carry no autograd history)."""
    return t.numpy()


def _host_rank_desc(scores: np.ndarray) -> np.ndarray:
    """``_rank_desc``: [B, M] -> indices by score desc, ties by index asc (a stable sort of the negated scores)."""
    return np.argsort(-scores, axis=1, kind="stable")


def _host_expand_level(live_scores: np.ndarray, child_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``expand_level``: live_scores [B, L], child_probs [B, L, K] -> (scores [B, L*K], best [B, L])."""
    B, L, K = child_probs.shape
    scores = (live_scores[:, :, None] * child_probs).reshape(B, L * K)  # [B, L*K]
    return scores, _host_rank_desc(scores)[:, :L]


def _host_can_stop(cand_scores: np.ndarray, live_scores: np.ndarray, keep: int, threshold: float) -> np.ndarray:
    """``drafting_can_stop`` -> [B] bool."""
    best_live = live_scores.max(axis=1, keepdims=True)  # [B, 1]
    exact = (cand_scores >= best_live).sum(axis=1) >= keep  # [B]
    return exact | (best_live[:, 0] < threshold) if threshold > 0 else exact


def _host_select(root_tokens: np.ndarray, cand_tokens: np.ndarray, cand_parents: np.ndarray,
                 cand_scores: np.ndarray, n: int) -> DraftTree:
    """``select_eagle_tree`` with distinct siblings and topk > 1 (1 <= n <= M + 1): the root plus the best n - 1
    candidates, in candidate order -> a full DraftTree of n nodes (CPU tensors over the arrays)."""
    B, M = cand_tokens.shape
    rows = np.arange(B)[:, None]  # [B, 1]
    kept = np.sort(_host_rank_desc(cand_scores)[:, : n - 1], axis=1)  # [B, n-1] candidate indices, candidate order
    node_of = np.zeros((B, M + 1), dtype=np.int64)  # node index of each kept candidate; column M = the root's 0
    node_of[rows, kept] = np.arange(1, n)
    parents = cand_parents[rows, kept]  # [B, n-1] candidate index, -1 = root
    tokens = np.empty((B, n), dtype=np.int64)  # [B, n]
    tokens[:, 0], tokens[:, 1:] = root_tokens, cand_tokens[rows, kept]
    all_parents = np.empty((B, n), dtype=np.int64)  # [B, n] node index, -1 for the root
    all_parents[:, 0], all_parents[:, 1:] = -1, node_of[rows, np.where(parents < 0, M, parents)]
    mask, depth = _host_ancestors(all_parents)
    return DraftTree(torch.from_numpy(tokens), torch.from_numpy(all_parents), torch.from_numpy(depth),
                     torch.from_numpy(mask), torch.full((B,), n, dtype=torch.int64), full=True)


def _host_ancestors(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """parents [B, N] (-1 = none; parents precede children) -> (``_ancestor_mask`` [B, N, N] bool, depth [B, N]
    int64). Each node's ancestor set as an integer bitset, its parent's plus itself, in one pass over the nodes in
    Python (a tree has a few dozen nodes; this is cheaper than numpy's pointer jumping at these sizes)."""
    B, N = parents.shape
    bitsets: list[int] = []
    for row in parents.tolist():
        bits = [0] * N
        for i, p in enumerate(row):
            bits[i] = (1 << i) | (bits[p] if p >= 0 else 0)
        bitsets += bits
    depth = np.array([bits.bit_count() - 1 for bits in bitsets], dtype=np.int64).reshape(B, N)  # strict ancestors
    width = (N + 7) // 8  # bytes per bitset
    raw = np.frombuffer(b"".join(bits.to_bytes(width, "little") for bits in bitsets), dtype=np.uint8)
    mask = np.unpackbits(raw.reshape(B, N, width), axis=2, bitorder="little")[:, :, :N]  # [B, N, N] 0/1
    return np.ascontiguousarray(mask).view(bool), depth

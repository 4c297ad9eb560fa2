"""Verification of a draft tree against the target model: greedy walk and lossless tree sampling. Pure functions.

Rules, all walking the tree from the root:
  - verify_greedy: a node's child is accepted when it carries the target's token at that node. Greedy rows take the
    argmax; sampled rows at the default (lossless) thresholds take ``race_node_ids``, the exponential-race winner
    with the noise of the node's output position, which is the very token plain decoding samples there for the
    request's seed (``specserve.sampling.race``): so a sampled request emits plain decoding's tokens, whatever the
    draft or its batch mates;
  - verify_sampling: SGLang's rule (a coin per level compared with the children's running probability sum,
    then a residual draw), which also supports the lossy accept thresholds.

All walks start at the root and descend one level at a time: at the current node, a child may be accepted;
the walk stops at the first node where none is, and the target then supplies one extra BONUS token at that last
accepted node. A request therefore gains accept_len + 1 tokens per step (accepted draft tokens, then the bonus).
Padding nodes (see specserve.speculative.tree) are never children of anything and never accepted.

All functions are batched over B requests and keep the device of their inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specserve.sampling.race import exponentials, race_argmax
from specserve.sampling.sampler import sample_inverse_cdf
from specserve.speculative.tree import DraftTree


@dataclass
class VerifyResult:
    accept_len: Tensor  # [B] int64: accepted DRAFT nodes (root excluded), 0..max depth
    accepted_nodes: Tensor  # [B, D+1] int64: accepted path's node indices starting with the root 0, then -1
    bonus_tokens: Tensor  # [B] int64: the target's token at the last accepted node
    last_nodes: Tensor  # [B] int64: node index of the last accepted node (where the bonus token was produced)
    new_tokens: Tensor  # [B, D+1] int64: accepted draft tokens followed by the bonus token, then -1

    def token_lists(self) -> list[list[int]]:
        """New tokens per request (accept_len + 1 each) as Python lists; one device transfer."""
        rows, lens = self.new_tokens.tolist(), self.accept_len.tolist()
        return [row[: n + 1] for row, n in zip(rows, lens, strict=True)]


def _walk(tree: DraftTree, ok: Tensor, depth_levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """Descend from the root accepting, at each level, the first child (index order) of the current node whose
    ok[b, child] is True. ok [B, N] bool must be False for the root and padding nodes.

    Returns accept_len [B], accepted_nodes [B, D+1] (-1 padded) and last_nodes [B]."""
    B = tree.batch_size
    dev = tree.tokens.device
    cur = torch.zeros(B, dtype=torch.int64, device=dev)  # [B]
    active = torch.ones(B, dtype=torch.bool, device=dev)  # [B]
    path = torch.full((B, depth_levels + 1), -1, dtype=torch.int64, device=dev)  # [B, D+1]
    path[:, 0] = 0
    for d in range(depth_levels):
        cand = (tree.parents == cur.unsqueeze(1)) & ok  # [B, N]: accepted children of the current node
        nxt = cand.to(torch.uint8).argmax(dim=1)  # [B]: first one (argmax returns the first maximum)
        active = active & cand.any(dim=1)
        cur = torch.where(active, nxt, cur)
        path[:, d + 1] = torch.where(active, cur, -1)
    accept_len = (path[:, 1:] >= 0).sum(dim=1)  # [B]
    return accept_len, path, cur


def _chain_walk(tree: DraftTree, ok: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``_walk`` for ok sets where at most one child of any node is ok (greedy: siblings carry distinct tokens, a
    DraftTree invariant, and only the one equal to the target's token can match; simulation: first children only).
    The accepted nodes are then exactly the nodes whose path from the root is ok all the way, one per depth, so
    they come from the ancestor mask in a few ops instead of a loop over levels. Same results as ``_walk``."""
    B, N = ok.shape
    dev = ok.device
    blocked = ~ok
    blocked[:, 0] = False  # the root is always accepted
    reached = ~(tree.mask & blocked.unsqueeze(1)).any(dim=2)  # [B, N]: node and all its ancestors ok
    accept_len = reached.sum(dim=1) - 1  # [B]
    D = tree.max_depth
    at_depth = reached.unsqueeze(1) & (tree.depth.unsqueeze(1) == torch.arange(D + 1, device=dev).view(1, -1, 1))
    path = torch.where(at_depth.any(dim=2), at_depth.to(torch.uint8).argmax(dim=2), -1)  # [B, D+1]
    last = path.gather(1, accept_len.view(-1, 1)).view(-1)  # [B]: the deepest accepted node
    return accept_len, path, last


def _result(tree: DraftTree, accept_len: Tensor, path: Tensor, last: Tensor, bonus: Tensor) -> VerifyResult:
    tokens = tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, D]: accepted draft tokens (junk past the end)
    pos = torch.arange(path.shape[1] - 1, device=path.device).view(1, -1)  # [1, D]
    tokens = torch.where(pos < accept_len.view(-1, 1), tokens, -1)  # [B, D]
    new_tokens = torch.cat([tokens, torch.full_like(bonus.view(-1, 1), -1)], dim=1)  # [B, D+1]
    new_tokens.scatter_(1, accept_len.view(-1, 1), bonus.view(-1, 1))
    return VerifyResult(accept_len, path, bonus, last, new_tokens)


def _parent_values(tree: DraftTree, per_node: Tensor) -> Tensor:
    """per_node [B, N] -> the same value at each node's parent [B, N] (the root's own for parent -1)."""
    return per_node.gather(1, tree.parents.clamp(min=0))


def _child_nodes(tree: DraftTree) -> Tensor:
    """[B, N] bool: real non-root nodes (the only nodes that can ever be accepted)."""
    nodes = torch.arange(tree.width, device=tree.tokens.device).view(1, -1)  # [1, N]
    return tree.valid & (nodes > 0)


def verify_greedy(tree: DraftTree, target_ids: Tensor) -> VerifyResult:
    """target_ids [B, N] int64: the target's argmax at each node (its prediction of the token after the node).

    Accept, level by level, the child of the current node whose token equals target_ids at the current node;
    stop where none does; the bonus token is target_ids at the last accepted node. On a CPU in numpy
    (``_host_verify_greedy``: same results, a fraction of the per-op cost at these sizes)."""
    if tree.tokens.device.type == "cpu":
        return _host_verify_greedy(tree, target_ids)
    return _device_verify_greedy(tree, target_ids)


def _device_verify_greedy(tree: DraftTree, target_ids: Tensor) -> VerifyResult:
    """``verify_greedy`` in torch ops, on the tree's device."""
    ok = _child_nodes(tree) & (tree.tokens == _parent_values(tree, target_ids))  # [B, N]
    accept_len, path, last = _chain_walk(tree, ok)
    bonus = target_ids.gather(1, last.view(-1, 1)).view(-1)  # [B]
    return _result(tree, accept_len, path, last, bonus)


def _host_verify_greedy(tree: DraftTree, target_ids: Tensor) -> VerifyResult:
    """``verify_greedy`` on numpy views of CPU tensors: ``_chain_walk`` and ``_result``, op for op. A 12-node tree
    took 45 us this way against 93 us in torch ops timed alone on the reference Xeon (171 against 192 us between the
    engine's forwards, which leave the caches cold), torch ops costing several microseconds each at these sizes."""
    tokens, parents, depth = tree.tokens.numpy(), tree.parents.numpy(), tree.depth.numpy()  # [B, N] each
    target = target_ids.to(torch.int64).numpy()  # [B, N]
    B, N = tokens.shape
    rows = np.arange(B)
    blocked = tokens != np.take_along_axis(target, np.maximum(parents, 0), axis=1)  # [B, N]
    if not tree.full:
        blocked |= np.arange(N)[None, :] >= tree.num_nodes.numpy()[:, None]  # padding nodes are never accepted
    blocked[:, 0] = False  # the root is always accepted
    reached = ~(tree.mask.numpy() & blocked[:, None, :]).any(axis=2)  # [B, N]: node and all its ancestors ok
    accept_len = reached.sum(axis=1) - 1  # [B]
    D = int(depth.max())
    at_depth = reached[:, None, :] & (depth[:, None, :] == np.arange(D + 1)[None, :, None])  # [B, D+1, N]
    path = np.where(at_depth.any(axis=2), at_depth.argmax(axis=2), -1)  # [B, D+1]
    last = path[rows, accept_len]  # [B]
    bonus = target[rows, last]  # [B]
    new_tokens = np.full((B, D + 1), -1, dtype=np.int64)  # [B, D+1]: accepted draft tokens, the bonus, then -1
    drafted = np.take_along_axis(tokens, np.maximum(path[:, 1:], 0), axis=1)  # [B, D]
    new_tokens[:, :D] = np.where(np.arange(D)[None, :] < accept_len[:, None], drafted, -1)
    new_tokens[rows, accept_len] = bonus
    return VerifyResult(*(torch.from_numpy(a) for a in (accept_len.astype(np.int64), path.astype(np.int64), bonus,
                                                        last.astype(np.int64), new_tokens)))


# ----------------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------------


def _draw_coins(tree: DraftTree, generators: list[torch.Generator | None], device: torch.device) -> Tensor:
    """Uniform coins in (0, 1], [B, D+1]: columns 0..D-1 one per tree level, column D for the bonus token.

    A row with its own generator draws exactly (its own max depth + 1) values from it, so its coins and the
    generator's later state depend on nothing but its own tree. Rows with None share one draw from the global
    RNG. Unused level columns hold 1.0."""
    B = tree.batch_size
    if len(generators) != B:
        raise ValueError(f"{len(generators)} generators for {B} requests")
    row_depth = tree.depth.masked_fill(~tree.valid, 0).amax(dim=1)  # [B]
    D = int(row_depth.max().item())
    coins = torch.ones(B, D + 1, dtype=torch.float64, device=device)  # [B, D+1]
    unseeded = [b for b, g in enumerate(generators) if g is None]
    if unseeded:
        rows = torch.tensor(unseeded, dtype=torch.int64, device=device)  # [U]
        coins[rows] = 1.0 - torch.rand(len(unseeded), D + 1, dtype=torch.float64, device=device)
    for b, (g, depth_b) in enumerate(zip(generators, row_depth.tolist(), strict=True)):
        if g is not None:
            r = (1.0 - torch.rand(depth_b + 1, dtype=torch.float64, generator=g, device=g.device)).to(device)
            coins[b, :depth_b] = r[:depth_b]
            coins[b, D] = r[depth_b]
    return coins


def _accept_mask(tree: DraftTree, target_probs: Tensor, level_coins: Tensor,
                 threshold_single: float, threshold_acc: float) -> Tensor:
    """ok [B, N] bool: node i would be accepted if the walk reaches its parent.

    p_i = target prob of node i's token at its parent; cum_i = sum of p over i's real siblings with index <= i
    (i included); u = the coin of the parent's level. Lossless (thresholds 1): ok_i = u <= cum_i and p_i > 0,
    so the FIRST ok sibling is the one with cum_{i-1} < u <= cum_i: it is chosen with probability p_i."""
    B, N, V = target_probs.shape
    if level_coins.shape[1] == 0:  # no node below the root anywhere in the batch
        return torch.zeros(B, N, dtype=torch.bool, device=target_probs.device)
    flat = tree.parents.clamp(min=0) * V + tree.tokens  # [B, N]: (parent node, own token) in [B, N*V]
    p = target_probs.reshape(B, N * V).gather(1, flat).to(torch.float64)  # [B, N]
    real = _child_nodes(tree)  # [B, N]
    p = p.masked_fill(~real, 0.0)
    upto = torch.ones(N, N, dtype=torch.bool, device=p.device).tril()  # [N, N]: j <= i
    siblings = (tree.parents.unsqueeze(2) == tree.parents.unsqueeze(1)) & upto  # [B, N, N]
    cum = (siblings.to(torch.float64) @ p.unsqueeze(2)).squeeze(2)  # [B, N]
    u = level_coins.gather(1, (tree.depth - 1).clamp(min=0))  # [B, N]: coin of the parent's level
    return real & (p > 0) & ((u * threshold_acc <= cum) | (p >= threshold_single))


def _residual_probs(tree: DraftTree, target_probs: Tensor, last: Tensor) -> Tensor:
    """Target distribution at the last accepted node with its children's tokens zeroed (all of them were tried
    and rejected, or it is a leaf and has none) -> [B, V] float64, unnormalised."""
    B, N, V = target_probs.shape
    probs = target_probs.gather(1, last.view(B, 1, 1).expand(B, 1, V)).squeeze(1).to(torch.float64)  # [B, V]
    tried = (tree.parents == last.view(B, 1)) & tree.valid  # [B, N]
    hits = torch.zeros(B, V, dtype=torch.int64, device=probs.device).scatter_add_(1, tree.tokens, tried.long())
    residual = probs.masked_fill(hits > 0, 0.0)  # [B, V]
    # Zero remaining mass only happens when rounding put the coin just above the children's total (exactly,
    # the children cover the whole distribution): fall back to the unmodified target distribution there.
    empty = residual.sum(dim=1, keepdim=True) <= 0  # [B, 1]
    return torch.where(empty, probs, residual)


def verify_sampling_with_coins(tree: DraftTree, target_probs: Tensor, coins: Tensor,
                               threshold_single: float = 1.0, threshold_acc: float = 1.0) -> VerifyResult:
    """verify_sampling with given coins [B, D+1] in (0, 1] (D = tree.max_depth; column d = level d, column D =
    the bonus token): deterministic, for tests and for callers that draw their own coins."""
    accept_len, path, last = _walk(tree, _accept_mask(tree, target_probs, coins[:, :-1], threshold_single,
                                                      threshold_acc), coins.shape[1] - 1)
    bonus = sample_inverse_cdf(_residual_probs(tree, target_probs, last), coins[:, -1])  # [B]
    return _result(tree, accept_len, path, last, bonus)


def race_verify(tree: DraftTree, target_probs: Tensor, keys: Tensor, walk=None) -> VerifyResult:
    """Lossless sampled verification of every request of the tree: ``verify_greedy`` over each node's race winner
    (``race_node_ids``; target_probs [B, N, V], keys [B, D+1, 2]). walk: the host's one-call walk
    (``PlatformPolicy.race_walk``: (probs, tokens, parents, depth, num_nodes, keys) -> VerifyResult's fields, the same
    result, racing only the nodes the walk reaches), or None."""
    if walk is not None:
        return VerifyResult(*walk(target_probs, tree.tokens, tree.parents, tree.depth, tree.num_nodes, keys))
    return verify_greedy(tree, race_node_ids(tree.depth, target_probs, keys))


def race_node_ids(depth: Tensor, target_probs: Tensor, keys: Tensor) -> Tensor:
    """Each node's exponential-race winner -> [B, N] int64.

    depth [B, N] (``DraftTree.depth``); target_probs [B, N, V], the processed target distribution at each node;
    keys [B, D+1, 2] int32 (``race_keys``), D the deepest node's depth: column d keys output position (tokens
    generated so far) + d, the position of the token after a node of depth d.

    The token plain decoding with the same seed would sample after the node's path: verify_greedy over these ids
    emits exactly plain decoding's tokens, whatever the draft (lossless; see ``specserve.sampling.race``)."""
    B, N, V = target_probs.shape
    D1 = keys.shape[1]
    expo = exponentials(keys.reshape(B * D1, 2), torch.arange(V, device=target_probs.device)).view(B, D1, V)
    per_node = expo.gather(1, depth.clamp(max=D1 - 1).unsqueeze(2).expand(B, N, V))  # [B, N, V]
    return race_argmax(target_probs, per_node)


def verify_sampling(
    tree: DraftTree,
    target_probs: Tensor,
    generators: list[torch.Generator | None],
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> VerifyResult:
    """Target-only tree sampling. target_probs [B, N, V] float: the target's processed distribution at each node
    (temperature, top-k/p, min-p, penalties and logit bias already applied by the caller).

    Lossless with both thresholds at 1.0 (the default): at each level one coin u ~ U(0, 1] is drawn from the
    request's generator; the current node's children are walked in index order accumulating their target
    probabilities (at the current node); child j is accepted iff sum_{i<j} p_i < u <= sum_{i<=j} p_i, i.e. with
    probability p_j. If none is, the bonus token is sampled from the current node's distribution with the tried
    children's tokens removed and renormalised, so each other token x comes with probability
    (1 - sum_i p_i) * p_x / (1 - sum_i p_i) = p_x; at an accepted leaf it is sampled from that leaf's
    distribution. By induction over the levels the emitted tokens are distributed exactly as plain sampling from
    the target. Zero-probability tokens are never emitted: a child with p = 0 is never accepted and the bonus
    draw only lands on tokens of positive probability.

    Thresholds below 1.0 (SGLang's --speculative-accept-threshold-single / -acc) are LOSSY: they accept more
    eagerly, and the output is then NOT distributed as the target. As in SGLang, a child is also accepted when
    u <= cum / threshold_acc (its siblings' accumulated mass, itself included, scaled up) or when its own
    probability p >= threshold_single; rejected children are still removed from the bonus distribution. Unlike
    SGLang, a child of probability 0 is never accepted, even with threshold_single = 0.

    generators: one per request; a seeded request's draws come only from its own generator (reproducible
    whatever its batch mates); None rows use the global RNG. Generators live on their own device.
    """
    if not (0.0 <= threshold_single <= 1.0 and 0.0 <= threshold_acc <= 1.0):
        raise ValueError(f"thresholds must be in [0, 1], got single={threshold_single}, acc={threshold_acc}")
    coins = _draw_coins(tree, generators, target_probs.device)  # [B, D+1]
    return verify_sampling_with_coins(tree, target_probs, coins, threshold_single, threshold_acc)


# ----------------------------------------------------------------------------------------------------------------
# Simulated acceptance (benchmarking only; see specserve.speculative.simulate)
# ----------------------------------------------------------------------------------------------------------------


def simulate_accept(tree: DraftTree, target_ids: Tensor, accept_lens: Tensor) -> VerifyResult:
    """LOSSY, for benchmarks: accept a prescribed number of drafted tokens whatever the target says.

    accept_lens [B] int64 >= 1: tokens the step should yield per request, the bonus token included (SGLang's
    ``SGLANG_SIMULATE_ACC_LEN`` convention), so accept_lens[b] - 1 drafted nodes are accepted: the first child
    (index order) at each level, from the root down; fewer where that path ends sooner (a leaf, or a root-only
    tree). target_ids [B, N] int64: the target's argmax per node; the bonus token is its value at the last
    accepted node, as with verify_greedy."""
    is_first_child = tree.first_child.gather(1, tree.parents.clamp(min=0)) == torch.arange(
        tree.width, device=tree.tokens.device).view(1, -1)  # [B, N]
    wanted = tree.depth <= (accept_lens.to(tree.depth.device) - 1).view(-1, 1)  # [B, N]: within the prescribed depth
    ok = _child_nodes(tree) & is_first_child & wanted  # [B, N]
    accept_len, path, last = _chain_walk(tree, ok)
    bonus = target_ids.gather(1, last.view(-1, 1)).view(-1)  # [B]
    return _result(tree, accept_len, path, last, bonus)

"""Token masks from matchers: one row for a request's next token, or one row per node of its draft tree.

A row is an int32 bitmask over the vocabulary (bit t of word t // 32 set = token t allowed) plus whether the
grammar is in an accepting state there, where the request's stop tokens (EOS, stop_token_ids) are allowed too: the
engine ends a request on its own stop ids, whatever the grammar engine calls its EOS. Rows are turned into the
sampler's ban mask by ``ban_mask``.
"""

from __future__ import annotations

import torch

from specserve.grammar.backend import Matcher, new_bitmask

_BITS = torch.arange(32, dtype=torch.int32)  # [32]


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] bitmask -> bool [R, V] (True = allowed); bits past V are dropped."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def ban_mask(bitmask: torch.Tensor, accepting: list[bool], stop_ids: list[set[int]], vocab_size: int,
             device: torch.device | str) -> torch.Tensor:
    """Rows of ``fill_rows`` / ``tree_rows`` -> bool [R, V] ban mask (True = banned) on ``device``, V being the
    model's vocabulary (the grammar's may be larger: its tokens past V are dropped).

    A row where the grammar is accepting also allows its request's stop ids."""
    allowed = allowed_tokens(bitmask, vocab_size)  # [R, V]
    rows = [r for r, (ok, stops) in enumerate(zip(accepting, stop_ids, strict=True)) if ok for t in stops
            if t < vocab_size]
    cols = [t for ok, stops in zip(accepting, stop_ids, strict=True) if ok for t in stops if t < vocab_size]
    if rows:
        allowed[rows, cols] = True
    return ~allowed.to(device)


def fill_rows(matchers: list[Matcher]) -> tuple[torch.Tensor, list[bool]]:
    """The next-token row of each matcher (all of one backend) -> (int32 [R, W] bitmask, accepting [R])."""
    bitmask = new_bitmask(len(matchers), matchers[0].vocab_size)
    for r, m in enumerate(matchers):
        m.fill(bitmask, r)
    return bitmask, [m.accepting() for m in matchers]


def tree_rows(matcher: Matcher, tokens: list[int], parents: list[int],
              stop_ids: set[int]) -> tuple[torch.Tensor, list[bool]]:
    """One row per node of a draft tree -> (int32 [N, W] bitmask, accepting [N]).

    ``tokens`` [N] and ``parents`` [N] (node 0 = the root, whose token the matcher has already accepted; parents
    come before their children). Row i allows the tokens the grammar allows after the path root -> i: a depth-first
    walk over forks of the matcher (it is left untouched). Nodes the grammar forbids (and a stop id, which ends the
    request) are not entered: their rows, and those of their subtrees, stay all-allowed; verification can never
    reach them, since their parent's row bans them (a stop id only where the grammar may stop). After the grammar's
    own stop token nothing is verified either."""
    n = len(tokens)
    bitmask = new_bitmask(n, matcher.vocab_size)
    accepting = [False] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        if parents[i] >= 0:
            children[parents[i]].append(i)
    matcher.fill(bitmask, 0)
    accepting[0] = matcher.accepting()
    stack = [(child, matcher) for child in reversed(children[0])]  # (node, the state of its parent)
    while stack:
        node, parent_state = stack.pop()
        if tokens[node] in stop_ids:
            continue
        state = parent_state.fork()
        if not state.accept(tokens[node]) or state.terminated():
            continue
        state.fill(bitmask, node)
        accepting[node] = state.accepting()
        stack.extend((child, state) for child in reversed(children[node]))
    return bitmask, accepting


def path_rows(matcher: Matcher, paths: list[list[int]], stop_ids: set[int]) -> tuple[torch.Tensor, list[bool]]:
    """One row per path from the matcher's state -> (int32 [P, W] bitmask, accepting [P]): row p allows what the
    grammar allows after ``paths[p]``. A path the grammar refuses (or that goes through a stop id or the grammar's
    own stop token) gets an empty row (nothing allowed). The matcher is left untouched (the walks run on forks).
    (The drafter's live branches: ``EagleProposer``.)"""
    bitmask = new_bitmask(len(paths), matcher.vocab_size)
    accepting = [False] * len(paths)
    for p, path in enumerate(paths):
        state = matcher.fork() if path else matcher
        if all(t not in stop_ids and state.accept(t) for t in path) and not state.terminated():
            state.fill(bitmask, p)
            accepting[p] = state.accepting()
        else:
            bitmask[p] = 0
    return bitmask, accepting

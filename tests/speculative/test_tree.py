"""Draft tree building, duplicate merging and the EAGLE-2 rerank, on small hand-drawn inputs."""

import random

import numpy as np
import pytest
import torch

from specserve.speculative import (
    EagleCandidates,
    build_chain,
    build_tree,
    cap_depth,
    drafting_can_stop,
    expand_level,
    select_eagle_tree,
)
from specserve.speculative.tree import _host_ancestors


def t(x):
    return torch.tensor(x, dtype=torch.int64)


def mask_from_ancestors(anc_lists, n):
    """anc_lists[i]: the nodes node i may attend to (itself and its ancestors), written by hand."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, anc in enumerate(anc_lists):
        m[i, anc] = True
    return m


# The hand-drawn tree used below (node: token):
#
#            0:10
#        /    |    \
#      1:11  2:12  3:13
#      /  \    |
#    4:14 5:15 6:16
#     |
#    7:17
TOKENS = [11, 12, 13, 14, 15, 16, 17]
PARENTS = [0, 0, 0, 1, 1, 2, 4]
ANCESTORS = [[0], [0, 1], [0, 2], [0, 3], [0, 1, 4], [0, 1, 5], [0, 2, 6], [0, 1, 4, 7]]


def test_build_tree_hand_drawn():
    tree = build_tree(t([10]), t([TOKENS]), t([PARENTS]))
    assert tree.tokens.tolist() == [[10, 11, 12, 13, 14, 15, 16, 17]]
    assert tree.parents.tolist() == [[-1, 0, 0, 0, 1, 1, 2, 4]]
    assert tree.depth.tolist() == [[0, 1, 1, 1, 2, 2, 2, 3]]
    assert tree.first_child.tolist() == [[1, 4, 6, -1, 7, -1, -1, -1]]
    assert tree.next_sibling.tolist() == [[-1, 2, 3, -1, 5, -1, -1, -1]]
    assert torch.equal(tree.mask[0], mask_from_ancestors(ANCESTORS, 8))
    assert tree.num_nodes.tolist() == [8]
    assert tree.max_depth == 3
    assert tree.positions(t([100])).tolist() == [[100, 101, 101, 101, 102, 102, 102, 103]]


def test_build_tree_batch_rows_are_independent():
    # row 1 is a chain 0 -> 1 -> ... -> 7 with other tokens
    tree = build_tree(t([10, 20]), t([TOKENS, [21, 22, 23, 24, 25, 26, 27]]), t([PARENTS, [0, 1, 2, 3, 4, 5, 6]]))
    assert tree.depth.tolist()[1] == list(range(8))
    assert torch.equal(tree.mask[1], torch.ones(8, 8, dtype=torch.bool).tril())
    assert tree.first_child.tolist()[1] == [1, 2, 3, 4, 5, 6, 7, -1]
    assert tree.next_sibling.tolist()[1] == [-1] * 8
    assert torch.equal(tree.mask[0], mask_from_ancestors(ANCESTORS, 8))  # unchanged by its batch mate
    assert tree.positions(t([5, 9])).tolist()[1] == list(range(9, 17))


def test_padding_nodes():
    # Row 1 has 4 real nodes (root, 1, 2, 3); its candidates past that are junk and must be ignored,
    # including a parent index that would otherwise be invalid.
    tree = build_tree(t([10, 10]), t([TOKENS, TOKENS]), t([PARENTS, [0, 0, 0, 9, 9, 9, 9]]), num_nodes=t([8, 4]))
    assert tree.num_nodes.tolist() == [8, 4]
    assert tree.valid.tolist()[1] == [True] * 4 + [False] * 4
    assert tree.tokens.tolist()[1] == [10, 11, 12, 13, 0, 0, 0, 0]
    assert tree.parents.tolist()[1] == [-1, 0, 0, 0, -1, -1, -1, -1]
    assert tree.depth.tolist()[1] == [0, 1, 1, 1, 0, 0, 0, 0]
    assert tree.first_child.tolist()[1] == [1, -1, -1, -1, -1, -1, -1, -1]
    assert tree.next_sibling.tolist()[1] == [-1, 2, 3, -1, -1, -1, -1, -1]
    assert torch.equal(tree.mask[1], mask_from_ancestors([[0], [0, 1], [0, 2], [0, 3], [4], [5], [6], [7]], 8))
    assert tree.max_depth == 3  # row 0


def test_cap_depth_hand_drawn():
    # rows: the hand-drawn tree (depths 0 1 1 1 2 2 2 3) capped at 3 (whole), 2, 1 and 0
    tree = build_tree(t([10] * 4), t([TOKENS] * 4), t([PARENTS] * 4))
    capped = cap_depth(tree, t([3, 2, 1, 0]))
    assert capped.num_nodes.tolist() == [8, 7, 4, 1]
    assert capped.tokens.tolist() == [[10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 12, 13, 14, 15, 16, 0],
                                      [10, 11, 12, 13, 0, 0, 0, 0], [10, 0, 0, 0, 0, 0, 0, 0]]
    assert capped.parents.tolist()[1] == [-1, 0, 0, 0, 1, 1, 2, -1]
    assert capped.depth.tolist()[2] == [0, 1, 1, 1, 0, 0, 0, 0]
    assert torch.equal(capped.mask[1, :7, :7], mask_from_ancestors(ANCESTORS[:7], 7))
    assert torch.equal(capped.mask[0], tree.mask[0])


def test_cap_depth_renumbers_the_kept_nodes():
    # node: token (parent): 1: 5 (0), 2: 6 (1), 3: 7 (0), 4: 8 (3); depths 1 2 1 2. Capped at 1: nodes 0, 1, 3 stay
    tree = build_tree(t([4]), t([[5, 6, 7, 8]]), t([[0, 1, 0, 3]]))
    capped = cap_depth(tree, t([1]))
    assert capped.num_nodes.tolist() == [3]
    assert capped.tokens.tolist() == [[4, 5, 7, 0, 0]]
    assert capped.parents.tolist() == [[-1, 0, 0, -1, -1]]
    assert capped.first_child.tolist() == [[1, -1, -1, -1, -1]] and capped.next_sibling.tolist()[0][:3] == [-1, 2, -1]
    assert cap_depth(tree, t([2])) is tree  # nothing deeper: the same tree


def test_duplicate_siblings_are_merged_recursively():
    # node: token (parent)            after merging:
    # 1: 5 (0)                          0 - 1:5 - 3:7 - 5:9
    # 2: 6 (0)                            |     \
    # 3: 5 (0)  dup of 1                  |      4:8
    # 4: 7 (1)                            2:6
    # 5: 7 (3)  parent merges into 1 -> dup of 4
    # 6: 8 (3)  re-parented to 1
    # 7: 9 (5)  parent merges into 4 -> re-parented to 4
    tree = build_tree(t([1, 1]), t([[5, 6, 5, 7, 7, 8, 9]] * 2), t([[0, 0, 0, 1, 3, 3, 5]] * 2), num_nodes=t([8, 3]))
    assert tree.num_nodes.tolist() == [6, 3]
    assert tree.tokens.tolist()[0] == [1, 5, 6, 7, 8, 9, 0, 0]
    assert tree.parents.tolist()[0] == [-1, 0, 0, 1, 1, 3, -1, -1]
    assert tree.depth.tolist()[0] == [0, 1, 1, 2, 2, 3, 0, 0]
    assert tree.first_child.tolist()[0] == [1, 3, -1, 5, -1, -1, -1, -1]
    assert tree.next_sibling.tolist()[0] == [-1, 2, -1, 4, -1, -1, -1, -1]
    # row 1 only keeps nodes 0..2, which hold no duplicate: nothing merged
    assert tree.tokens.tolist()[1] == [1, 5, 6, 0, 0, 0, 0, 0]
    assert tree.parents.tolist()[1] == [-1, 0, 0, -1, -1, -1, -1, -1]


def test_same_token_under_different_parents_is_not_merged():
    tree = build_tree(t([1]), t([[5, 6, 7, 7]]), t([[0, 0, 1, 2]]))
    assert tree.num_nodes.tolist() == [5]
    assert tree.tokens.tolist() == [[1, 5, 6, 7, 7]]


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError):
        build_tree(t([1]), t([[5, 6]]), t([[0, 2]]))  # candidate 1 (node 2) cannot be its own parent
    with pytest.raises(ValueError):
        build_tree(t([1]), t([[5, 6]]), t([[-1, 0]]))  # only the root has no parent
    with pytest.raises(ValueError):
        build_tree(t([1]), t([[5, 6]]), t([[0, 0]]), num_nodes=t([0]))
    with pytest.raises(ValueError):
        build_tree(t([1]), t([[5, -3]]), t([[0, 0]]))


def reference_tree(root, tokens, parents, n_real):
    """Slow, obviously-correct reference: merge duplicates with a dict, then walk parents for each node."""
    node_tok, node_par, canon = [root], [-1], {0: 0}
    first_of = {}
    for m in range(n_real - 1):
        par = canon[parents[m]]
        key = (par, tokens[m])
        if key in first_of:
            canon[m + 1] = first_of[key]
        else:
            first_of[key] = canon[m + 1] = len(node_tok)
            node_tok.append(tokens[m])
            node_par.append(par)
    anc = []
    for i in range(len(node_tok)):
        chain, j = [], i
        while j >= 0:
            chain.append(j)
            j = node_par[j]
        anc.append(chain)
    return node_tok, node_par, anc


def test_build_tree_matches_reference_on_random_trees():
    rng = random.Random(0)
    B, M = 16, 11
    roots = [rng.randrange(4) for _ in range(B)]
    toks = [[rng.randrange(3) for _ in range(M)] for _ in range(B)]  # 3 tokens: many duplicates
    pars = [[rng.randrange(m + 1) for m in range(M)] for _ in range(B)]
    n_real = [rng.randrange(1, M + 2) for _ in range(B)]
    tree = build_tree(t(roots), t(toks), t(pars), num_nodes=t(n_real))
    for b in range(B):
        node_tok, node_par, anc = reference_tree(roots[b], toks[b], pars[b], n_real[b])
        n = len(node_tok)
        assert tree.num_nodes[b].item() == n
        assert tree.tokens[b, :n].tolist() == node_tok
        assert tree.parents[b, :n].tolist() == node_par
        assert tree.depth[b, :n].tolist() == [len(a) - 1 for a in anc]
        assert torch.equal(tree.mask[b, :n, :n], mask_from_ancestors(anc, n))
        for i in range(n):  # children are distinct tokens, listed in index order through the links
            kids = [j for j in range(n) if node_par[j] == i]
            assert len({node_tok[j] for j in kids}) == len(kids)
            walked, c = [], tree.first_child[b, i].item()
            while c != -1:
                walked.append(c)
                c = tree.next_sibling[b, c].item()
            assert walked == kids


def test_build_chain_equals_build_tree_on_a_chain():
    roots, toks = t([3, 4]), t([[5, 6, 7], [8, 9, 10]])
    chain_parents = t([[0, 1, 2], [0, 1, 2]])
    for num_nodes in (None, t([4, 2])):
        a = build_chain(roots, toks, num_nodes)
        b = build_tree(roots, toks, chain_parents, num_nodes)
        for field in ("tokens", "parents", "depth", "mask", "first_child", "next_sibling", "num_nodes"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-2
# ----------------------------------------------------------------------------------------------------------------


def test_expand_level_by_hand():
    live = torch.tensor([[0.6, 0.3]])
    probs = torch.tensor([[[0.5, 0.4], [0.9, 0.1]]])
    tokens = t([[[3, 4], [5, 6]]])
    lvl = expand_level(live, probs, tokens)
    torch.testing.assert_close(lvl.scores, torch.tensor([[0.30, 0.24, 0.27, 0.03]]))
    assert lvl.tokens.tolist() == [[3, 4, 5, 6]]
    assert lvl.parent_branch.tolist() == [[0, 0, 1, 1]]
    assert lvl.best.tolist() == [[0, 2]]  # 0.30 and 0.27


def test_expand_level_ties_go_to_the_lower_index():
    live = torch.tensor([[0.5, 0.5]])
    probs = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    lvl = expand_level(live, probs, t([[[1, 2], [3, 4]]]))
    assert lvl.best.tolist() == [[0, 2]]
    lvl = expand_level(torch.tensor([[0.25, 0.5]]), torch.tensor([[[1.0, 1.0], [0.5, 0.5]]]), t([[[1, 2], [3, 4]]]))
    assert lvl.best.tolist() == [[0, 1]]  # four-way tie at 0.25: the first two


def eagle_topk2_steps3():
    """topk=2, steps=3 with dyadic probabilities (exact products). Candidates (index: token, score, parent):
    level 0: c0: 10 .5 root      c1: 11 .25 root                          live: c0, c1
    level 1: c2: 20 .25 c0       c3: 21 .125 c0   c4: 22 .1875 c1   c5: 23 .03125 c1   live: c2, c4
    level 2: c6: 30 .1875 c2     c7: 31 .03125 c2 c8: 32 .09375 c4  c9: 33 .046875 c4
    """
    cands = EagleCandidates(torch.tensor([[0.5, 0.25]]), t([[10, 11]]))
    best1 = cands.add_level(torch.tensor([[[0.5, 0.25], [0.75, 0.125]]]), t([[[20, 21], [22, 23]]]))
    best2 = cands.add_level(torch.tensor([[[0.75, 0.125], [0.5, 0.25]]]), t([[[30, 31], [32, 33]]]))
    return cands, best1, best2


def test_eagle_candidates_topk2_steps3():
    cands, best1, best2 = eagle_topk2_steps3()
    assert best1.tolist() == [[0, 2]]  # c2 (.25) and c4 (.1875) among c2..c5
    assert best2.tolist() == [[0, 2]]  # c6 (.1875) and c8 (.09375) among c6..c9
    tokens, parents, scores = cands.tensors()
    assert tokens.tolist() == [[10, 11, 20, 21, 22, 23, 30, 31, 32, 33]]
    assert parents.tolist() == [[-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]]
    assert scores.tolist() == [[0.5, 0.25, 0.25, 0.125, 0.1875, 0.03125, 0.1875, 0.03125, 0.09375, 0.046875]]


@pytest.mark.parametrize(
    "n, tokens, parents",
    [
        # order: c0 .5, c1 .25, c2 .25 (tie: index), c4 .1875, c6 .1875 (tie: index), c3 .125, ...
        (3, [10, 11], [-1, 0, 0]),
        (4, [10, 11, 20], [-1, 0, 0, 1]),
        (5, [10, 11, 20, 22], [-1, 0, 0, 1, 2]),
        (6, [10, 11, 20, 22, 30], [-1, 0, 0, 1, 2, 3]),
        (7, [10, 11, 20, 21, 22, 30], [-1, 0, 0, 1, 1, 2, 3]),
    ],
)
def test_select_eagle_tree_topk2_steps3(n, tokens, parents):
    cands, _, _ = eagle_topk2_steps3()
    tree = cands.select(t([7]), n)
    assert tree.tokens.tolist() == [[7, *tokens]]
    assert tree.parents.tolist() == [parents]
    assert tree.num_nodes.tolist() == [n]


def test_select_ties_with_probability_one_stay_ancestor_closed():
    # Every candidate scores 0.5: children of probability exactly 1.0 tie with their parents.
    # c0: root, c1: root, c2: child of c1, c3: child of c2, c4: child of c0
    toks, pars = t([[1, 2, 3, 4, 5]]), t([[-1, -1, 1, 2, 0]])
    scores = torch.full((1, 5), 0.5)
    for n, expect_parents in [(2, [-1, 0]), (3, [-1, 0, 0]), (4, [-1, 0, 0, 2]), (5, [-1, 0, 0, 2, 3])]:
        tree = select_eagle_tree(t([9]), toks, pars, scores, n)
        assert tree.parents.tolist() == [expect_parents]
        assert tree.tokens.tolist() == [[9, *toks[0, : n - 1].tolist()]]


def token_path(tokens, parents, i):
    """Tokens from the top of the tree down to item i, following parents until a negative one."""
    path = []
    while i >= 0:
        path.append(tokens[i])
        i = parents[i]
    return tuple(reversed(path))


def test_select_random_ties_keep_every_path():
    """Random EAGLE drafts with many ties (probabilities from {1, .5, .25, 0}): the selection is the top N-1 by
    (score desc, index asc), and every kept node's token path from the root is its candidate's path."""
    rng = random.Random(1)
    B, K, steps = 8, 3, 4
    choice = [1.0, 0.5, 0.25, 0.0]

    def probs(*shape):
        return torch.tensor([rng.choice(choice) for _ in range(B * K ** len(shape))]).view(B, *shape)

    cands = EagleCandidates(probs(K), torch.randint(0, 50, (B, K)))
    for _ in range(steps - 1):
        cands.add_level(probs(K, K), torch.randint(0, 50, (B, K, K)))
    tokens, parents, scores = cands.tensors()
    M = tokens.shape[1]
    for n in (2, 5, 9, M + 1):
        tree = cands.select(t(list(range(B))), n)
        for b in range(B):
            expected = sorted(sorted(range(M), key=lambda c: (-scores[b, c].item(), c))[: n - 1])

            assert set(parents[b, expected].tolist()) <= set(expected) | {-1}  # ancestor-closed
            node_toks, node_pars = tree.tokens[b].tolist(), tree.parents[b].tolist()
            paths = {token_path(node_toks, node_pars, i)[1:] for i in range(1, tree.num_nodes[b].item())}
            cand_toks, cand_pars = tokens[b].tolist(), parents[b].tolist()
            # duplicate siblings (random tokens) may have been merged, never lost
            assert paths == {token_path(cand_toks, cand_pars, c) for c in expected}


def test_topk1_is_an_exact_chain():
    cands = EagleCandidates(torch.tensor([[0.9]]), t([[5]]))
    cands.add_level(torch.tensor([[[1.0]]]), t([[[6]]]))  # probability 1.0: ties its parent
    cands.add_level(torch.tensor([[[0.5]]]), t([[[7]]]))
    tree = cands.select(t([4]), 4)
    assert tree.tokens.tolist() == [[4, 5, 6, 7]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2]]
    assert tree.depth.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(tree.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.first_child.tolist() == [[1, 2, 3, -1]]
    # the generic path (no topk hint) agrees
    generic = select_eagle_tree(t([4]), *cands.tensors(), 4)
    for field in ("tokens", "parents", "depth", "mask", "first_child", "next_sibling", "num_nodes"):
        assert torch.equal(getattr(tree, field), getattr(generic, field)), field
    assert cands.select(t([4]), 3).tokens.tolist() == [[4, 5, 6]]


def test_select_rejects_more_draft_tokens_than_candidates():
    cands, _, _ = eagle_topk2_steps3()  # 10 candidates
    assert cands.select(t([7]), 11).num_nodes.tolist() == [11]  # all of them
    with pytest.raises(ValueError):
        select_eagle_tree(t([7]), *cands.tensors(), 12)
    with pytest.raises(ValueError):
        cands.select(t([7]), 0)


def test_candidates_stopped_early_give_a_smaller_tree():
    """A draft stopped before N - 1 candidates existed (threshold stop) verifies all of them: M + 1 nodes."""
    cands, _, _ = eagle_topk2_steps3()  # 10 candidates
    tree = cands.select(t([7]), 12)
    assert tree.num_nodes.tolist() == [11]
    assert torch.equal(tree.tokens, cands.select(t([7]), 11).tokens)


def _two_levels():
    """Level 0 and 1 of eagle_topk2_steps3: scores .5 .25 | .25 .125 .1875 .03125, live c2 (.25) and c4 (.1875)."""
    cands = EagleCandidates(torch.tensor([[0.5, 0.25]]), t([[10, 11]]))
    cands.add_level(torch.tensor([[[0.5, 0.25], [0.75, 0.125]]]), t([[[20, 21], [22, 23]]]))
    return cands


@pytest.mark.parametrize("n, stops", [(2, True), (3, True), (4, True), (5, False), (8, False)])
def test_exact_stop_by_hand(n, stops):
    # three candidates score >= the best live .25 (c0 .5, c1 .25, c2 .25), and any level-2 candidate scores at
    # most .25 with a larger index: it cannot beat them, so a tree of up to 3 candidates (N <= 4) is final. At
    # N = 5 the 4th pick is c4 (.1875), which a level-2 child of c2 (up to .25) could displace: draft on.
    # (the selections in test_select_eagle_tree_topk2_steps3 agree: N <= 4 holds no level-2 token)
    assert _two_levels().can_stop(n - 1) is stops


def test_threshold_stop_by_hand():
    cands = _two_levels()  # best live path .25
    assert cands.can_stop(4, threshold=0.3)
    assert not cands.can_stop(4, threshold=0.25)  # strictly below
    scores = torch.tensor([[0.5, 0.25, 0.25, 0.1], [0.9, 0.05, 0.04, 0.01]])
    live = torch.tensor([[0.25, 0.1], [0.04, 0.01]])
    # request 0: 3 scores >= .25; request 1: 3 scores >= .04
    assert drafting_can_stop(scores, live, keep=3).tolist() == [True, True]
    assert drafting_can_stop(scores, live, keep=4).tolist() == [False, False]
    assert drafting_can_stop(scores, live, keep=4, threshold=0.05).tolist() == [False, True]
    # the batch drafts on while any request needs it
    assert not EagleCandidates(torch.tensor([[0.9, 0.05], [0.3, 0.3]]), t([[1, 2], [3, 4]])).can_stop(3, 0.5)


def test_can_stop_with_fewer_candidates_than_kept_equals_the_full_rule():
    """Before N-1 candidates exist only the threshold can stop (can_stop's shortcut); it agrees with
    drafting_can_stop over the same scores, stopping and not."""
    torch.manual_seed(3)
    seen = set()
    for _ in range(50):
        probs = torch.rand(3, 2).sort(dim=1, descending=True).values * torch.rand(3, 1)
        cands = EagleCandidates(probs, torch.randint(0, 9, (3, 2)))
        for threshold in (0.0, 0.2, 0.6):
            want = bool(drafting_can_stop(probs, probs, keep=5, threshold=threshold).all())
            assert cands.can_stop(5, threshold) is want
            seen.add(want)
    assert seen == {True, False}


def test_exact_stop_never_changes_the_selected_tree():
    """Random drafts with many ties: drafting all levels and drafting until ``can_stop(N - 1)`` select the same
    tree, for every N; the stop does fire (a guard against a test that never stops)."""
    rng = random.Random(7)
    B, K, steps = 4, 3, 6
    choice = [1.0, 0.75, 0.5, 0.25, 0.1, 0.0]
    stopped_early = 0
    for _ in range(60):
        root_p = torch.tensor([rng.choice(choice) for _ in range(B * K)]).view(B, K).sort(dim=1, descending=True)
        levels = [(torch.tensor([rng.choice(choice) for _ in range(B * K * K)]).view(B, K, K),
                   torch.randint(0, 50, (B, K, K))) for _ in range(steps - 1)]
        roots, root_t = t(list(range(B))), torch.randint(0, 50, (B, K))
        for n in (2, 4, 7, 10, 16):
            full, early = EagleCandidates(root_p.values, root_t), EagleCandidates(root_p.values, root_t)
            for probs, toks in levels:
                full.add_level(probs, toks)
            for probs, toks in levels:
                if early.can_stop(n - 1):
                    stopped_early += 1
                    break
                early.add_level(probs, toks)
            a, b = full.select(roots, n), early.select(roots, n)
            for field in ("tokens", "parents", "num_nodes", "mask"):
                assert torch.equal(getattr(a, field), getattr(b, field)), (n, field)
    assert stopped_early > 100


def test_select_distinct_skips_only_the_merge():
    """With distinct siblings, select(distinct=True) builds the very tree select() builds (it only skips the
    duplicate search); with duplicates, the default still merges them."""
    cands, _, _ = eagle_topk2_steps3()
    for n in (1, 4, 7, 11):
        a, b = cands.select(t([7]), n), cands.select(t([7]), n, distinct=True)
        for field in ("tokens", "parents", "depth", "mask", "first_child", "next_sibling", "num_nodes"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (n, field)
    dup = EagleCandidates(torch.tensor([[0.5, 0.25]]), t([[10, 10]]))  # the root's two children share a token
    assert cands_num_nodes(dup.select(t([7]), 3)) == 2  # merged
    assert cands_num_nodes(dup.select(t([7]), 3, distinct=True)) == 3  # the caller's promise is taken as given


def cands_num_nodes(tree) -> int:
    return int(tree.num_nodes[0])


@pytest.mark.parametrize("B, K, steps", [(1, 3, 8), (5, 4, 4), (3, 2, 6)])
def test_host_bookkeeping_equals_the_torch_path(B, K, steps):
    """EagleCandidates on numpy arrays (its CPU path) against its torch path, level by level and in the selected
    trees: random drafts with many ties (probabilities from a few dyadic values) and a threshold stop."""
    rng = torch.Generator().manual_seed(B * 100 + K)
    values = torch.tensor([1.0, 0.5, 0.25, 0.125, 0.0])

    def probs(*shape):
        return values[torch.randint(0, len(values), (B, *shape), generator=rng)]

    root_p, root_ids = probs(K), torch.randint(0, 99, (B, K), generator=rng)
    host, dev = EagleCandidates(root_p, root_ids, host=True), EagleCandidates(root_p, root_ids, host=False)
    assert host.host and not dev.host
    for _ in range(steps - 1):
        p, ids = probs(K, K), torch.randint(0, 99, (B, K, K), generator=rng)
        assert torch.equal(host.add_level(p, ids), dev.add_level(p, ids))
        for keep, threshold in ((5, 0.0), (K * K, 0.0), (3, 0.2)):
            assert host.can_stop(keep, threshold) == dev.can_stop(keep, threshold)
    for a, b in zip(host.tensors(), dev.tensors(), strict=True):
        assert torch.equal(a, b)
    roots = torch.arange(B) + 500
    for n in (2, 5, 12, host.tensors()[0].shape[1] + 1):
        a, b = host.select(roots, n, distinct=True), dev.select(roots, n, distinct=True)
        for field in ("tokens", "parents", "depth", "mask", "num_nodes", "first_child", "next_sibling"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (n, field)
        assert a.full and bool(a.valid.all())


def test_host_ancestors_by_hand():
    # 0 <- 1 <- 3, 0 <- 2 <- 4 <- 5; a second request: a chain
    parents = np.array([[-1, 0, 0, 1, 2, 4], [-1, 0, 1, 2, 3, 4]])
    mask, depth = _host_ancestors(parents)
    assert depth.tolist() == [[0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert [np.flatnonzero(row).tolist() for row in mask[0]] == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4],
                                                                  [0, 2, 4, 5]]
    assert np.array_equal(mask[1], np.tril(np.ones((6, 6), dtype=bool)))
    wide = np.array([[-1] + [0] * 69 + [69]])  # 71 nodes: bitsets wider than 64 bits
    mask, depth = _host_ancestors(wide)
    assert depth[0, -1] == 2 and np.flatnonzero(mask[0, -1]).tolist() == [0, 69, 70]

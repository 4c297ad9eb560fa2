"""Greedy and sampling verification of draft trees: hand-checked walks, a statistical test of both lossless tree
sampling rules (SGLang's running sum and the exponential race, with mutants they must catch), thresholds and seeded
reproducibility."""

import math
from collections import Counter

import pytest
import torch

from specserve.sampling.race import grid_keys, race_sample
from specserve.speculative import (
    build_tree,
    race_node_ids,
    verify_greedy,
    verify_sampling,
    verify_sampling_with_coins,
)
from specserve.speculative import verify as verify_mod


def t(x):
    return torch.tensor(x, dtype=torch.int64)


# The hand-drawn tree (node: token):
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


def greedy_tree(rows, num_nodes=None):
    return build_tree(t([10] * rows), t([TOKENS] * rows), t([PARENTS] * rows),
                      None if num_nodes is None else t(num_nodes))


def targets(**at_node):
    """target_ids for one row of the hand-drawn tree: at_node = {"n0": token, ...}; other nodes predict 99."""
    row = [99] * 8
    for k, v in at_node.items():
        row[int(k[1:])] = v
    return row


# ----------------------------------------------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------------------------------------------


def test_greedy_full_accept():
    res = verify_greedy(greedy_tree(1), t([targets(n0=11, n1=14, n4=17, n7=42)]))
    assert res.accept_len.tolist() == [3]
    assert res.accepted_nodes.tolist() == [[0, 1, 4, 7]]
    assert res.bonus_tokens.tolist() == [42]
    assert res.last_nodes.tolist() == [7]
    assert res.token_lists() == [[11, 14, 17, 42]]


def test_greedy_partial_accept_down_a_second_branch():
    res = verify_greedy(greedy_tree(1), t([targets(n0=12, n2=16, n6=55)]))  # node 6 is a leaf
    assert res.accept_len.tolist() == [2]
    assert res.accepted_nodes.tolist() == [[0, 2, 6, -1]]
    assert res.token_lists() == [[12, 16, 55]]
    res = verify_greedy(greedy_tree(1), t([targets(n0=11, n1=15, n4=17)]))  # second child of node 1
    assert res.accepted_nodes.tolist() == [[0, 1, 5, -1]]
    assert res.token_lists() == [[11, 15, 99]]


def test_greedy_zero_accept():
    res = verify_greedy(greedy_tree(1), t([targets(n0=14, n1=14)]))  # 14 is a grandchild, not a child
    assert res.accept_len.tolist() == [0]
    assert res.accepted_nodes.tolist() == [[0, -1, -1, -1]]
    assert res.token_lists() == [[14]]


def test_greedy_batch_with_different_lengths_and_padding():
    # Row 3 keeps only nodes 0..3: its dropped candidates (node 4 = token 14 under node 1) would match its
    # targets, as would a padding node's token 0 at the root and at node 1, but padding is never accepted.
    ids = t([targets(n0=11, n1=14, n4=17, n7=5), targets(n0=13, n3=6), targets(n0=7),
             targets(n0=11, n1=14), targets(n0=0, n1=0)])
    res = verify_greedy(greedy_tree(5, num_nodes=[8, 8, 8, 4, 4]), ids)
    assert res.accept_len.tolist() == [3, 1, 0, 1, 0]
    assert res.accepted_nodes.tolist() == [[0, 1, 4, 7], [0, 3, -1, -1], [0, -1, -1, -1], [0, 1, -1, -1],
                                           [0, -1, -1, -1]]
    assert res.bonus_tokens.tolist() == [5, 6, 7, 14, 0]
    assert res.token_lists() == [[11, 14, 17, 5], [13, 6], [7], [11, 14], [0]]
    assert res.new_tokens.tolist()[1] == [13, 6, -1, -1]


def test_root_only_tree_yields_just_the_bonus_token():
    tree = build_tree(t([0, 1]), torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64))
    assert verify_greedy(tree, t([[7], [8]])).token_lists() == [[7], [8]]
    probs = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])
    res = verify_sampling(tree, probs, [gen(0), None])
    assert res.token_lists() == [[1], [2]]
    assert res.accepted_nodes.tolist() == [[0], [0]]


# ----------------------------------------------------------------------------------------------------------------
# Sampling: the tree and distributions of the statistical test
#
#          0  (root)
#       /  |  \
#     1:1 2:2  3:5        token 1 has probability 0 at the root
#        /  \
#      4:4  5:6
# ----------------------------------------------------------------------------------------------------------------

V = 8
S_TOKENS, S_PARENTS = [1, 2, 5, 4, 6], [0, 0, 0, 2, 2]
S_PROBS = torch.tensor([
    [0.25, 0.0, 0.125, 0.0625, 0.0, 0.375, 0.1875, 0.0],  # root: children 1 (p 0), 2 (.125), 5 (.375)
    [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5],  # node 1 (never accepted)
    [0.1, 0.2, 0.0, 0.0, 0.3, 0.15, 0.25, 0.0],  # node 2: children 4 (.3), 6 (.25)
    [0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0],  # node 3 (leaf)
    [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5],  # node 4 (leaf)
    [0.0, 0.0, 0.7, 0.0, 0.0, 0.0, 0.3, 0.0],  # node 5 (leaf)
])


def sampling_tree(rows):
    return build_tree(t([3] * rows), t([S_TOKENS] * rows), t([S_PARENTS] * rows))


def with_coins(coins, threshold_single=1.0, threshold_acc=1.0):
    rows = len(coins)
    return verify_sampling_with_coins(sampling_tree(rows), S_PROBS.expand(rows, -1, -1),
                                      torch.tensor(coins, dtype=torch.float64), threshold_single, threshold_acc)


def test_sampling_walk_by_hand():
    # level-0 coins against the root's children (cumulative .0, .125, .5), level-1 coins against node 2's
    # children (cumulative .3, .55), final coin for the bonus token
    res = with_coins([
        [1e-9, 0.9, 0.5],  # node 1 has p 0: skipped; node 2; then none of 4/6 -> bonus from node 2 minus {4, 6}
        [0.125, 0.3, 0.5],  # boundaries are inclusive: node 2, then node 4 (leaf): bonus from node 4
        [0.126, 0.3, 1.0],  # node 3 (leaf): bonus from node 3
        [0.6, 0.1, 0.5],  # none at the root: bonus from the root minus {1, 2, 5}: [.25, 0, 0, .0625, 0, 0, .1875, 0]
        [0.6, 0.1, 0.51],
        [0.6, 0.1, 1.0],
    ])
    assert res.accept_len.tolist() == [1, 2, 1, 0, 0, 0]
    assert res.accepted_nodes.tolist() == [[0, 2, -1], [0, 2, 4], [0, 3, -1], [0, -1, -1], [0, -1, -1], [0, -1, -1]]
    # row 0: node 2 minus {4, 6} = [.1, .2, 0, 0, 0, .15, 0, 0] (total .45): u*.45 = .225 -> token 1
    # row 1: node 4 = [.5, 0, ..., .5]: u = .5 -> token 0 (inclusive); row 2: node 3, u = 1 -> token 3 (last positive)
    # rows 3-5: total .5: .25 -> token 0 (inclusive), .255 -> token 3, .5 -> token 6 (not the zero tail)
    assert res.token_lists() == [[2, 1], [2, 4, 0], [5, 3], [0], [3], [6]]


def by_race(tree, probs, seeds, start=0):
    """Sampled verification as the scheduler runs it: each node's race winner, then the greedy walk."""
    keys = grid_keys(seeds, [start] * len(seeds), tree.max_depth + 1, "cpu")  # [R, D+1, 2]
    return verify_greedy(tree, race_node_ids(tree.depth, probs, keys))


def test_race_emits_what_plain_sampling_with_the_same_seed_emits():
    # Plain sampling, written out: token k of the step is race_sample(distribution after the tokens so far, seed,
    # position start + k), here following the tree while the tokens stay on it (the target's distributions are
    # only known on the tree). For every seed the walk must give exactly that sequence.
    children = {}
    for node, (tok, par) in enumerate(zip(S_TOKENS, S_PARENTS, strict=True), start=1):
        children.setdefault(par, {})[tok] = node
    seeds = list(range(300))
    res = by_race(sampling_tree(len(seeds)), S_PROBS.expand(len(seeds), -1, -1), seeds, start=11)
    accepted = 0
    for seed, got in zip(seeds, res.token_lists(), strict=True):
        node, want = 0, []
        for k in range(3):
            tok = race_sample(S_PROBS[node].view(1, -1), [seed], [11 + k]).item()
            want.append(tok)
            if tok not in children.get(node, {}):
                break
            node = children[node][tok]
        assert got == want
        accepted += len(got) - 1
    assert accepted > 100  # the walk went into the tree often (P(first token is a child) = .5)


@pytest.mark.parametrize("impl", ["operator", "reference"])
def test_the_one_call_race_walk_gives_what_racing_every_node_gives(impl):
    """race_walk (the CPU's one-call walk, racing only the nodes it reaches) against every node's winner and the
    greedy walk: the same accepted paths, bonus tokens and new tokens, over the hand-drawn tree for 300 seeds and over
    random trees with padding nodes, a vocabulary wider than the operator's chunk of ids, and a root-only tree."""
    from specserve.platform.cpu import native, race_walk

    if impl == "operator" and not (native.native_ops() and race_walk.native()):
        pytest.skip("ops.cpp does not build here (a CPU with AVX2 or AVX512-BF16, and a compiler)")
    walk = race_walk.race_walk if impl == "operator" else race_walk.race_walk_reference

    def check(tree, probs, seeds, start):
        keys = grid_keys(seeds, [start] * len(seeds), tree.max_depth + 1, "cpu")
        want = verify_greedy(tree, race_node_ids(tree.depth, probs, keys))
        got = verify_mod.VerifyResult(*walk(probs, tree.tokens, tree.parents, tree.depth, tree.num_nodes, keys))
        assert got.token_lists() == want.token_lists()
        for field in ("accept_len", "accepted_nodes", "bonus_tokens", "last_nodes"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        return want

    seeds = list(range(300 if impl == "operator" else 40))
    res = check(sampling_tree(len(seeds)), S_PROBS.expand(len(seeds), -1, -1).contiguous(), seeds, 11)
    assert res.accept_len.sum() > len(seeds) // 4  # walks went into the tree
    g = gen(5)
    for rows, vocab in ((3, 64), (2, 9000)):
        probs = torch.rand(rows, 8, vocab, generator=g) ** 8  # peaked: children get accepted now and then
        probs = probs / probs.sum(-1, keepdim=True)
        tokens = torch.randint(0, vocab, (rows, 7), generator=g)
        keys_seeds = torch.randint(0, 2**40, (rows,), generator=g).tolist()
        winners = race_node_ids(torch.zeros(rows, 8, dtype=torch.int64), probs,
                                grid_keys(keys_seeds, [0] * rows, 1, "cpu"))  # the root's and depth-1 winners
        tokens[:, 0] = winners[:, 0]  # the root's winner is a child: the walk goes below the root
        tree = build_tree(t([0] * rows), tokens, t([[0, 1, 1, 2, 0, 4, 6]] * rows), num_nodes=t([8, 6, 8][:rows]))
        check(tree, probs, keys_seeds, 0)
    root_only = build_tree(t([3]), torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.int64))
    check(root_only, S_PROBS[:1].unsqueeze(0).contiguous(), [3], 5)


def test_race_rows_do_not_depend_on_batch_mates_or_the_draft():
    # A row's tokens are fixed by its distributions, its seed and its position: another batch (other trees, other
    # seeds) or a root-only tree (no draft: one token per step) gives the same tokens, position by position.
    alone = by_race(sampling_tree(1), S_PROBS.unsqueeze(0), [3], start=5)
    probs_b = torch.rand(2, 8, V, generator=gen(99))
    probs_b = probs_b / probs_b.sum(-1, keepdim=True)
    probs_b[1, :6] = S_PROBS
    tree_b = build_tree(t([3, 3]), t([[1, 2, 3, 4, 5, 6, 7], [*S_TOKENS, 0, 0]]),
                        t([[0, 1, 2, 3, 4, 5, 6], [*S_PARENTS, 0, 0]]), num_nodes=t([8, 6]))
    mixed = by_race(tree_b, probs_b, [17, 3], start=5)
    assert mixed.token_lists()[1] == alone.token_lists()[0]
    first = alone.token_lists()[0][0]
    root_only = build_tree(t([3]), torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.int64))
    assert by_race(root_only, S_PROBS[:1].unsqueeze(0), [3], start=5).token_lists() == [[first]]


def test_race_one_hot_rows_take_the_argmax_path():
    one_hot = torch.zeros(1, 6, V)
    one_hot[0, torch.arange(6), S_PROBS.argmax(-1)] = 1.0  # argmax: root 5 (node 3), node 3 -> 1
    assert by_race(sampling_tree(1), one_hot, [12345]).token_lists() == [[5, 1]]


def test_sampling_thresholds_below_one_accept_more_eagerly():
    # coin .9 rejects every root child losslessly
    assert with_coins([[0.9, 0.9, 0.5]]).accept_len.tolist() == [0]
    # threshold_single .3: node 3 (p .375 >= .3) is accepted whatever the coin
    assert with_coins([[0.9, 0.9, 0.5]], threshold_single=0.3).accepted_nodes.tolist() == [[0, 3, -1]]
    # threshold_acc .5: accept when u * .5 <= cumulative mass: .45 <= .5 at node 3
    assert with_coins([[0.9, 0.9, 0.5]], threshold_acc=0.5).accepted_nodes.tolist() == [[0, 3, -1]]
    # threshold_single 0: the first child with positive probability, never the zero-probability node 1
    res = with_coins([[0.9, 0.9, 0.5]], threshold_single=0.0)
    assert res.accepted_nodes.tolist() == [[0, 2, 4]]
    with pytest.raises(ValueError):
        verify_sampling(sampling_tree(1), S_PROBS.unsqueeze(0), [None], threshold_single=1.5)


# ----------------------------------------------------------------------------------------------------------------
# Statistical test
# ----------------------------------------------------------------------------------------------------------------

DRAWS = 100_000


def exact_outcomes():
    """Probability of every token sequence one step can emit: plain sampling from the target, continued
    into the tree while the sampled token is a child's token (written from the definition, not the code)."""
    children = {}
    for node, (tok, par) in enumerate(zip(S_TOKENS, S_PARENTS, strict=True), start=1):
        children.setdefault(par, {})[tok] = node
    out = {}

    def visit(node, prefix, prob):
        for tok, p in enumerate(S_PROBS[node].tolist()):
            if p == 0:
                continue
            if tok in children.get(node, {}):
                visit(children[node][tok], prefix + (tok,), prob * p)
            else:
                out[prefix + (tok,)] = prob * p

    visit(0, (), 1.0)
    return out


def marginal(dist, length):
    m = Counter()
    for seq, p in dist.items():
        m[seq[:length]] += p
    return m


def check_counts(counts, expected, n):
    """Failures: an outcome outside the support, or a count more than 6 sigma from its expectation."""
    failures = [f"{k}: drawn {c} times but has probability 0" for k, c in counts.items() if k not in expected]
    for k, p in expected.items():
        sigma = math.sqrt(n * p * (1 - p))
        if abs(counts.get(k, 0) - n * p) > 6 * sigma:
            failures.append(f"{k}: {counts.get(k, 0)} drawn, {n * p:.0f} +- {sigma:.0f} expected")
    return failures


def by_race_with_random_seeds(tree, probs, generators):
    """Race verification for rows without a seed: each draws one (as the sampler does)."""
    return by_race(tree, probs, torch.randint(0, 2**62, (len(generators),)).tolist())


def statistical_failures(seed=0, verify=verify_sampling):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        res = verify(sampling_tree(DRAWS), S_PROBS.expand(DRAWS, -1, -1), [None] * DRAWS)
    seqs = [tuple(s) for s in res.token_lists()]
    exact = exact_outcomes()
    failures = []
    for length in (1, 2, 3):  # first token, (first, second), whole step
        counts = Counter(s[:length] for s in seqs)
        failures += check_counts(counts, marginal(exact, length), DRAWS)
    return failures


def test_exact_outcomes_fixture_is_consistent():
    exact = exact_outcomes()
    assert math.isclose(sum(exact.values()), 1.0, abs_tol=1e-6)  # S_PROBS is float32
    first = marginal(exact, 1)
    for tok in range(V):  # the first token is distributed as the root's distribution
        assert math.isclose(first.get((tok,), 0.0), S_PROBS[0, tok].item(), abs_tol=1e-6)
    assert exact[(2, 4, 7)] == pytest.approx(0.125 * 0.3 * 0.5)


@pytest.mark.parametrize("verify", [verify_sampling, by_race_with_random_seeds])
def test_sampling_matches_the_target_distribution(verify):
    assert statistical_failures(verify=verify) == []


def test_statistical_check_catches_a_race_mutant():
    """Wrong: one noise for the whole step (every level must race with its own position's noise)."""
    def one_noise(tree, probs, generators):
        keys = grid_keys(torch.randint(0, 2**62, (len(generators),)).tolist(), [0] * len(generators), 1,
                         "cpu")  # [B, 1, 2]
        return verify_greedy(tree, race_node_ids(tree.depth, probs, keys.expand(-1, tree.max_depth + 1, 2)))

    assert statistical_failures(verify=one_noise) != []


def mutant_keeps_tried_children(tree, target_probs, last):
    """Wrong: samples the bonus token from the full distribution, tried children included."""
    B, _, V = target_probs.shape
    return target_probs.gather(1, last.view(B, 1, 1).expand(B, 1, V)).squeeze(1).to(torch.float64)


def mutant_non_cumulative(tree, target_probs, level_coins, threshold_single, threshold_acc):
    """Wrong: accepts child j when u <= p_j instead of comparing u with the siblings' running sum."""
    B, N, V = target_probs.shape
    p = target_probs.reshape(B, N * V).gather(1, tree.parents.clamp(min=0) * V + tree.tokens).to(torch.float64)
    u = level_coins.gather(1, (tree.depth - 1).clamp(min=0))
    real = tree.valid & (torch.arange(N).view(1, N) > 0)
    return real & (p > 0) & (u <= p)


@pytest.mark.parametrize("name, mutant", [("_residual_probs", mutant_keeps_tried_children),
                                          ("_accept_mask", mutant_non_cumulative)])
def test_statistical_check_catches_mutants(monkeypatch, name, mutant):
    monkeypatch.setattr(verify_mod, name, mutant)
    assert statistical_failures() != []


# ----------------------------------------------------------------------------------------------------------------
# Reproducibility
# ----------------------------------------------------------------------------------------------------------------


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_seeded_rows_do_not_depend_on_batch_mates():
    # Batch A: the sampling tree alone. Batch B: a deeper tree first (row 0, its own generator), then the
    # sampling tree padded to B's width (row 1), then an unseeded row.
    probs_b = torch.rand(3, 8, V, generator=gen(99))
    probs_b = probs_b / probs_b.sum(-1, keepdim=True)
    probs_b[1, :6] = S_PROBS
    tree_b = build_tree(t([3, 3, 3]), t([[1, 2, 3, 4, 5, 6, 7], [*S_TOKENS, 0, 0], [1, 2, 3, 4, 5, 6, 7]]),
                        t([[0, 1, 2, 3, 4, 5, 6], [*S_PARENTS, 0, 0], [0, 0, 0, 0, 0, 0, 0]]), num_nodes=t([8, 6, 8]))
    outcomes = set()
    for seed in range(20):
        ga, gb = gen(seed), gen(seed)
        alone = verify_sampling(sampling_tree(1), S_PROBS.unsqueeze(0), [ga])
        mixed = verify_sampling(tree_b, probs_b, [gen(1000 + seed), gb, None])
        again = verify_sampling(sampling_tree(1), S_PROBS.unsqueeze(0), [gen(seed)])
        assert mixed.token_lists()[1] == alone.token_lists()[0] == again.token_lists()[0]
        assert torch.equal(ga.get_state(), gb.get_state())  # the same number of draws was taken
        outcomes.add(tuple(alone.token_lists()[0]))
    assert len(outcomes) > 3  # the seeds do matter: the comparison is not vacuous


@pytest.mark.parametrize("seed", range(5))
def test_chain_walk_equals_the_level_walk(seed):
    """_chain_walk (greedy, simulation) gives _walk's results whenever at most one child of a node is ok."""
    g = torch.Generator().manual_seed(seed)
    B, M = 6, 14
    parents = torch.stack([torch.randint(0, m + 1, (B,), generator=g) for m in range(M)], dim=1)  # parent <= m
    tokens = torch.randint(0, 5, (B, M), generator=g)  # few values: duplicate siblings get merged
    tree = build_tree(t([1] * B), tokens, parents, torch.randint(1, M + 2, (B,), generator=g))
    child = verify_mod._child_nodes(tree)
    rank = torch.where(child, torch.rand(B, tree.width, generator=g), -1.0)  # ok: the best-ranked child of a node
    parent_of = tree.parents.clamp(min=0)
    best_rank = torch.full((B, tree.width), -1.0).scatter_reduce(1, parent_of, rank, "amax")
    ok = child & (rank == best_rank.gather(1, parent_of)) & (rank > 0.1)
    want = verify_mod._walk(tree, ok, tree.max_depth)
    assert want[0].max() >= 2  # some walks go deep
    got = verify_mod._chain_walk(tree, ok)
    for w, x in zip(want, got, strict=True):
        assert torch.equal(w, x)


@pytest.mark.parametrize("seed", range(6))
def test_host_greedy_verify_equals_the_torch_ops(seed):
    """verify_greedy's numpy path (any CPU tree) gives the torch ops' results: padded batches, targets that follow
    the drafted tokens part of the way, full trees."""
    g = torch.Generator().manual_seed(seed)
    B, M = 6, 14
    parents = torch.stack([torch.randint(0, m + 1, (B,), generator=g) for m in range(M)], dim=1)  # parent <= m
    tokens = torch.randint(0, 6, (B, M), generator=g)
    num = torch.randint(1, M + 2, (B,), generator=g) if seed % 2 else torch.full((B,), M + 1)
    tree = build_tree(t([1] * B), tokens, parents, num)
    # the target agrees with one child of each node most of the time: walks of several levels
    first_child = tree.first_child
    follow = tree.tokens.gather(1, first_child.clamp(min=0))
    target = torch.where(torch.rand(B, tree.width, generator=g) < 0.9, follow, torch.randint(0, 6, (B, tree.width),
                                                                                             generator=g))
    want = verify_mod._device_verify_greedy(tree, target)
    got = verify_mod._host_verify_greedy(tree, target)
    assert want.accept_len.max() >= 2  # some walks go deep
    for name in ("accept_len", "accepted_nodes", "bonus_tokens", "last_nodes", "new_tokens"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    assert got.token_lists() == want.token_lists()

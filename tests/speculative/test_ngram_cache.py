"""NgramCache: the n-gram trie (counting, recency, LRU leaf eviction) and its draft trees (BFS / PROB).

Expected values are derived by hand in the comments. Unless a test says otherwise the cache is ``small()``:
branch_length B = 4 (paths of at most 4 tokens), windows 1..3, BFS breadth 1..3, so by depth d of the trie
node being expanded: breadth(1) = 3, breadth(2) = 2, breadth(3) = breadth(4) = 1 (linear from 3 at d = 1 to
1 at d = 3). Tokens are small ints; ``insert(seq)`` without ``num_new`` counts every n-gram of ``seq``.
"""

from __future__ import annotations

import random
import time
import tracemalloc

import numpy as np
import pytest

from specserve.config import ServerArgs
from specserve.speculative.ngram_cache import (
    BYTES_PER_NODE,
    NgramCache,
    bfs_breadth,
    capacity_memory_warning,
    full_cache_bytes,
)


def small(**overrides) -> NgramCache:
    kw = dict(capacity=1000, branch_length=4, min_window=1, max_window=3, min_bfs_breadth=1, max_bfs_breadth=3,
              match_type="BFS", max_draft_nodes=10)
    kw.update(overrides)
    return NgramCache(**kw)


def insert_all(cache: NgramCache, *seqs: list[int]) -> NgramCache:
    for seq in seqs:
        cache.insert(seq)
    cache._check_invariants()
    return cache


# ---------------------------------------------------------------------------------------------- breadth
def test_bfs_breadth_defaults_fall_linearly_from_max_to_min():
    # defaults: windows 1..12, breadth 1..10: breadth(d) = 1 + 9 * (12 - d) // 11 for d in 1..12, then 1.
    # d=1: 1 + 99//11 = 10; d=2: 1 + 90//11 = 9; d=3: 1 + 81//11 = 8; d=4: 1 + 72//11 = 7; d=5: 1 + 63//11 = 6;
    # d=6: 1 + 54//11 = 5; d=7: 1 + 45//11 = 5; d=8: 1 + 36//11 = 4; d=9: 1 + 27//11 = 3; d=10: 1 + 18//11 = 2;
    # d=11: 1 + 9//11 = 1; d=12: 1.
    got = [bfs_breadth(d, 1, 12, 1, 10) for d in range(1, 19)]
    assert got == [10, 9, 8, 7, 6, 5, 5, 4, 3, 2, 1, 1] + [1] * 6
    assert [bfs_breadth(d, 1, 3, 1, 3) for d in (1, 2, 3, 4)] == [3, 2, 1, 1]  # the small() cache
    assert bfs_breadth(2, 2, 2, 1, 5) == 1  # equal windows: the narrow end


# ---------------------------------------------------------------------------------------------- matching
def test_no_match_gives_empty_lists():
    cache = small()
    assert cache.match([1, 2]) == ([], [])  # empty cache
    insert_all(cache, [1, 2, 3])
    assert cache.match([7, 8]) == ([], [])  # neither [7, 8] nor [8] was seen
    assert cache.match([]) == ([], [])
    # [3] was seen but only at the end of the text: no continuation, so no anchor
    assert cache.match([3]) == ([], [])


def test_longest_match_wins_and_shorter_windows_add_alternatives():
    # Trie after [1, 2, 3] and [5, 2, 4]: [2] has children 3 (older) and 4 (most recent); [1, 2] -> 3; [5, 2] -> 4.
    one = insert_all(small(max_draft_nodes=1), [1, 2, 3], [5, 2, 4])
    assert one.match([1, 2]) == ([3], [-1])  # window 2 ([1, 2]) beats window 1's most recent child 4
    assert one.match([5, 2]) == ([4], [-1])
    assert one.match([9, 2]) == ([4], [-1])  # only window 1 matches: its most recent child
    # With room for more, window 1 ([2]) is expanded after window 2 and adds 4 beside 3 (3 is not repeated).
    many = insert_all(small(), [1, 2, 3], [5, 2, 4])
    assert many.match([1, 2]) == ([3, 4], [-1, -1])


def test_prompt_lookup_drafts_the_continuation_of_the_prompt():
    cache = insert_all(small(), [10, 11, 12, 13, 14, 15])
    # Context ... 99, 10, 11: window 3 ([99, 10, 11]) is unknown. Window 2 [10, 11] (path of start 0,
    # [10, 11, 12, 13]): breadth(2) = 2 -> 12 (#0); [10, 11, 12] breadth 1 -> 13 (#1 under #0); [10..13] is a leaf.
    # Window 1 [11] (path [11, 12, 13, 14]): 12 = #0, then 13 = #1, then [11, 12, 13] -> 14 (#2 under #1).
    assert cache.match([99, 10, 11]) == ([12, 13, 14], [-1, 0, 1])


def test_prompt_lookup_with_default_parameters():
    cache = NgramCache()  # B = 18, windows 1..12, breadth 1..10, 11 draft nodes
    prompt = list(range(100, 130))  # 30 distinct tokens
    cache.insert(prompt)
    # The model starts repeating the prompt: context ends ..., 129, 100, 101, 102. [129, 100] never occurred, so
    # the longest window is 3 ([100, 101, 102], depth 3). Below it the trie holds start 0's path up to depth 18,
    # i.e. 103..117: a chain (every token has one continuation), cut at 11 nodes: 103..113, each under the previous.
    # Windows 2 and 1 only revisit the same chain.
    tokens, parents = cache.match(prompt + [100, 101, 102])
    assert tokens == list(range(103, 114))
    assert parents == list(range(-1, 10))


def test_bfs_prefers_recent_and_prob_prefers_frequent():
    # [1] -> 2 twice, then [1] -> 3 once: 2 is more frequent (2/3), 3 more recent.
    seqs = ([1, 2], [1, 2], [1, 3])
    assert insert_all(small(max_draft_nodes=1), *seqs).match([1]) == ([3], [-1])
    assert insert_all(small(max_draft_nodes=1, match_type="PROB"), *seqs).match([1]) == ([2], [-1])
    assert insert_all(small(), *seqs).match([1]) == ([3, 2], [-1, -1])
    assert insert_all(small(match_type="PROB"), *seqs).match([1]) == ([2, 3], [-1, -1])


def test_prob_follows_path_probability_and_bfs_goes_wide():
    # [1, 2, 4] three times, then [1, 3]: P(2 | 1) = 3/4, P(3 | 1) = 1/4, P(4 | 1 2) = 1, so the path 1-2-4 has
    # probability 3/4 > 1/4 and PROB takes 2 then 4 (under 2). BFS takes [1]'s children first, most recent first.
    seqs = ([1, 2, 4], [1, 2, 4], [1, 2, 4], [1, 3])
    assert insert_all(small(max_draft_nodes=2, match_type="PROB"), *seqs).match([1]) == ([2, 4], [-1, 0])
    assert insert_all(small(max_draft_nodes=2), *seqs).match([1]) == ([3, 2], [-1, -1])


def test_prob_ranks_by_the_product_along_the_path():
    # [1] -> 2 (4 times), 3 (3 times): P(2) = 4/7, P(3) = 3/7. [1, 2] -> 4, 5 (twice each): P(4 | 1 2) = 1/2.
    # Path 1-2-4 has 4/7 * 1/2 = 2/7 < 3/7, so after 2 comes 3 (although 1/2 > 3/7), then 4 (ties 5, pushed first).
    cache = small(match_type="PROB")
    insert_all(cache, [1, 2, 4], [1, 2, 4], [1, 2, 5], [1, 2, 5], [1, 3], [1, 3], [1, 3])
    cache.max_draft_nodes = 3
    assert cache.match([1]) == ([2, 3, 4], [-1, -1, 0])


def test_ties_bfs_most_recent_prob_smaller_token():
    # [1] -> 4 then [1] -> 5, one occurrence each.
    assert insert_all(small(max_draft_nodes=1), [1, 4], [1, 5]).match([1]) == ([5], [-1])
    assert insert_all(small(max_draft_nodes=1, match_type="PROB"), [1, 4], [1, 5]).match([1]) == ([4], [-1])


def test_prob_offers_only_max_breadth_children_per_node():
    # [1] -> 2, 3, 4, 5 with frequencies 4, 3, 2, 1; max_bfs_breadth 3 keeps the three most frequent (2, 3, 4).
    cache = small(match_type="PROB")
    for tok, times in ((2, 4), (3, 3), (4, 2), (5, 1)):
        for _ in range(times):
            cache.insert([1, tok])
    cache._check_invariants()
    assert cache.match([1]) == ([2, 3, 4], [-1, -1, -1])


def test_breadth_shrinks_with_depth_and_the_cap_cuts_in_bfs_order():
    cache = small()
    for x in (2, 3, 4, 5):
        for y in (6, 7, 8):
            cache.insert([1, x, y])
    cache._check_invariants()
    # [1] (depth 1, breadth 3): children by recency 5, 4, 3 (2 is the oldest) -> #0, #1, #2.
    # Each [1, x] (depth 2, breadth 2): 8, 7 (6 is the oldest): #3, #4 under #0; #5, #6 under #1; #7, #8 under #2.
    # [1, x, y] are leaves.
    assert cache.match([1]) == ([5, 4, 3, 8, 7, 8, 7, 8, 7], [-1, -1, -1, 0, 0, 1, 1, 2, 2])
    cache.max_draft_nodes = 4
    assert cache.match([1]) == ([5, 4, 3, 8], [-1, -1, -1, 0])
    cache.max_draft_nodes = 0
    assert cache.match([1]) == ([], [])


def test_longer_window_gets_a_narrower_tree():
    # Windows 1..2, breadth 1..3: breadth(1) = 3, breadth(2) = 1.
    cache = small(max_window=2)
    insert_all(cache, [9, 1, 5], [9, 1, 6], [9, 1, 7], [1, 2], [1, 3])
    # [9, 1] -> 7, 6, 5 (most recent first); [1] -> 3, 2, 7, 6, 5.
    # Context 9, 1: window 2 gives only 7 (#0); window 1 adds 3 and 2, and its third child 7 is #0 again.
    assert cache.match([9, 1]) == ([7, 3, 2], [-1, -1, -1])
    # Context 0, 1: window 1 alone, three wide.
    assert cache.match([0, 1]) == ([3, 2, 7], [-1, -1, -1])


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_anchors_merge_into_one_tree_without_duplicate_siblings(match_type):
    cache = insert_all(small(match_type=match_type), [7, 1, 2, 3], [1, 2, 4])
    # Window 2 [7, 1] -> 2 (#0); [7, 1, 2] -> 3 (#1 under #0); nothing below.
    # Window 1 [1] -> 2 (= #0); [1, 2] has 3 and 4 (one occurrence each): BFS (breadth 2) takes 4 (most recent,
    # new: #2 under #0) and 3 (= #1); PROB pops 3 (= #1, tie won by the smaller token) then 4 (#2 under #0).
    assert cache.match([7, 1]) == ([2, 3, 4], [-1, 0, 0])


def test_batch_match_is_match_per_context():
    cache = insert_all(small(), [7, 1, 2, 3], [1, 2, 4])
    contexts = [[7, 1], [5], [1, 2]]
    assert cache.batch_match(contexts) == [cache.match(c) for c in contexts]
    assert cache.batch_match(contexts)[1] == ([], [])


# ---------------------------------------------------------------------------------------------- counting
def test_frequency_and_tick_of_each_ngram():
    cache = insert_all(small(branch_length=3, max_window=2), [1, 2, 1, 2])
    # Paths by start, each walked from the root; every occurrence takes the next tick:
    # start 0: [1] t1, [1 2] t2, [1 2 1] t3; start 1: [2] t4, [2 1] t5, [2 1 2] t6; start 2: [1] t7, [1 2] t8;
    # start 3: [2] t9.
    assert cache.node_stats([1]) == (2, 7)
    assert cache.node_stats([1, 2]) == (2, 8)
    assert cache.node_stats([1, 2, 1]) == (1, 3)
    assert cache.node_stats([2]) == (2, 9)
    assert cache.node_stats([2, 1]) == (1, 5)
    assert cache.node_stats([2, 1, 2]) == (1, 6)
    assert cache.node_stats([2, 2]) is None
    assert cache.num_nodes == 6


def test_num_new_counts_each_occurrence_once():
    exact = insert_all(small(branch_length=3, max_window=2), [1, 2, 3])
    exact.insert([1, 2, 3, 4], num_new=1)  # a decode step appended 4
    exact._check_invariants()
    # Only n-grams ending in 4 are counted: [4], [3 4], [2 3 4]; [2 3] etc. keep their single occurrence.
    assert [exact.node_stats(g)[0] for g in ([2, 3], [3], [1, 2, 3], [4], [3, 4], [2, 3, 4])] == [1] * 6
    # Re-inserting the whole window without num_new counts the old n-grams again.
    again = insert_all(small(branch_length=3, max_window=2), [1, 2, 3], [1, 2, 3, 4])
    assert again.node_stats([2, 3])[0] == 2 and again.node_stats([1, 2])[0] == 2


def test_chunked_insert_equals_one_insert():
    seq = [1, 2, 3, 1, 2, 4, 1, 2]
    whole = insert_all(small(), seq)
    chunked = small()
    chunked.insert(seq[:3])
    chunked.insert(seq[:6], num_new=3)
    chunked.insert(seq, num_new=2)
    chunked._check_invariants()
    grams = {tuple(seq[i:j]) for i in range(len(seq)) for j in range(i + 1, min(i + 4, len(seq)) + 1)}
    assert all(whole.node_stats(g)[0] == chunked.node_stats(g)[0] for g in grams)
    assert whole.node_stats([1, 2])[0] == 3  # 1 2 occurs three times
    assert whole.num_nodes == chunked.num_nodes == len(grams)


def test_insert_reads_only_the_tail_it_needs():
    cache = small(branch_length=3, max_window=2)
    cache.insert([9, 9, 9, 1, 2, 3], num_new=1)
    cache._check_invariants()
    # B - 1 + num_new = 3 tokens are read: [1, 2, 3]. Counted: [3], [2 3], [1 2 3]; the older prefixes [1], [1 2],
    # [2] are created (freq 1) as the paths to them. Nothing with 9.
    assert cache.node_stats([9]) is None
    assert cache.node_stats([1, 2, 3]) == (1, 3)  # walk order: [1 2 3] t3 after [1] t1 and [1 2] t2
    assert cache.num_nodes == 6


# ---------------------------------------------------------------------------------------------- eviction
def two_gram_cache(capacity: int) -> NgramCache:
    # B = 2: every inserted pair [a, b] makes [a], [a b], [b].
    return NgramCache(capacity=capacity, branch_length=2, min_window=1, max_window=1, max_draft_nodes=4)


def test_eviction_takes_the_least_recently_used_leaf_first():
    cache = two_gram_cache(6)
    insert_all(cache, [1, 2], [3, 4])
    # [1] t1, [1 2] t2, [2] t3, [3] t4, [3 4] t5, [4] t6: full. Leaves by tick: [1 2], [2], [3 4], [4].
    insert_all(cache, [5, 6])
    # [5]: evicts [1 2] (oldest leaf); [1] becomes a leaf with its old tick t1.
    # [5 6]: evicts [1] (t1 < [2]'s t3). [6]: evicts [2] (t3).
    assert cache.num_nodes == 6
    assert [cache.node_stats(g) is None for g in ([1], [1, 2], [2])] == [True] * 3
    assert cache.match([3]) == ([4], [-1]) and cache.match([5]) == ([6], [-1])


def test_a_recently_used_path_survives_eviction():
    cache = two_gram_cache(6)
    insert_all(cache, [1, 2], [3, 4], [1, 2])
    # The second [1, 2] refreshes [1] t7, [1 2] t8, [2] t9. Leaves by tick: [3 4] t5, [4] t6, [1 2] t8, [2] t9.
    insert_all(cache, [5, 6])
    # [5] evicts [3 4]; [3] becomes a leaf (t4). [5 6] evicts [3] (t4 < [4]'s t6). [6] evicts [4].
    assert cache.num_nodes == 6
    assert cache.match([1]) == ([2], [-1])
    assert cache.node_stats([3]) is None and cache.node_stats([4]) is None
    assert cache.match([5]) == ([6], [-1])


def test_the_path_being_extended_is_never_evicted():
    cache = two_gram_cache(3)
    insert_all(cache, [1, 2])  # [1] t1, [1 2] t2, [2] t3: full
    insert_all(cache, [5])  # evicts [1 2]; [1] is now the oldest leaf (t1); [5] t4
    cache.insert([1, 9], num_new=1)  # a step after 1: [1] is only looked up (not refreshed), then extended
    cache._check_invariants()
    # Creating [1 9] needs a node: the oldest leaf is [1] itself, but it is the parent being extended, so [2] (t3)
    # goes. Creating [9] evicts [5] (t4).
    assert cache.num_nodes == 3
    assert cache.match([1]) == ([9], [-1])
    assert cache.node_stats([2]) is None and cache.node_stats([5]) is None


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_random_inserts_keep_the_pool_bounded_and_trees_valid(match_type):
    rng = random.Random(0)
    cache = NgramCache(capacity=60, branch_length=5, min_window=1, max_window=3, max_bfs_breadth=4,
                       match_type=match_type, max_draft_nodes=6)
    seqs: list[list[int]] = [[] for _ in range(4)]
    for step in range(300):
        seq = seqs[step % 4]
        k = rng.randint(1, 4)
        seq.extend(rng.choice([rng.randrange(6), seq[-1] if seq else 0]) for _ in range(k))
        cache.insert(seq, num_new=k)
        assert cache.num_nodes <= 60
        cache._check_invariants()
        tokens, parents = cache.match(seq)
        assert len(tokens) == len(parents) <= 6
        seen = set()
        for i, (tok, par) in enumerate(zip(tokens, parents, strict=True)):
            assert -1 <= par < i  # topological order
            assert (par, tok) not in seen  # no duplicate siblings
            seen.add((par, tok))
        for i in range(len(tokens)):  # every drafted path continues some matched window in the trie
            path, j = [], i
            while j >= 0:
                path.append(tokens[j])
                j = parents[j]
            path.reverse()
            assert any(cache.node_stats(seq[-w:] + path) for w in range(1, 4) if w <= len(seq))


# ---------------------------------------------------------------------------------------------- memory
def test_default_capacity_costs_nothing_until_used_and_memory_follows_use():
    """SGLang's default capacity (10M nodes, ~3.5 GB when full) allocates nothing up front; storage then grows
    with the nodes actually created, at a per-node cost close to the documented measurement."""
    tracemalloc.start()
    try:
        start = time.perf_counter()
        cache = NgramCache(capacity=10_000_000)
        built_s = time.perf_counter() - start
        empty_bytes = tracemalloc.get_traced_memory()[0]
        rng = random.Random(1)
        cache.insert([rng.randrange(30_000) for _ in range(2000)])  # random text: ~18 new nodes per token
        used_bytes = tracemalloc.get_traced_memory()[0] - empty_bytes
    finally:
        tracemalloc.stop()
    assert built_s < 0.5 and empty_bytes < 16_384
    assert cache.allocated_nodes == cache.num_nodes + 1 and 20_000 < cache.num_nodes < 40_000
    per_node = used_bytes / cache.num_nodes
    assert 0.5 * BYTES_PER_NODE["BFS"] < per_node < 1.5 * BYTES_PER_NODE["BFS"], per_node


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_storage_stops_growing_at_capacity(match_type):
    # the cap still holds: once full, new nodes reuse evicted ids, so the lists stay at capacity + 1 entries
    rng = random.Random(2)
    cache = NgramCache(capacity=200, branch_length=5, min_window=1, max_window=3, match_type=match_type)
    for _ in range(50):
        cache.insert([rng.randrange(100) for _ in range(30)])
        assert cache.num_nodes <= 200 and cache.allocated_nodes == cache.num_nodes + 1
    assert cache.num_nodes == 200
    cache._check_invariants()


def test_capacity_memory_warning_names_the_flag_when_a_full_cache_is_too_big():
    gib = 2**30
    # 10M BFS nodes * 346 B = 3.46e9 B = 3.2 GiB: more than a quarter of 8 GiB, less than a quarter of 16 GiB
    warning = capacity_memory_warning(10_000_000, "BFS", 8 * gib)
    assert warning is not None and "--speculative-ngram-capacity 10000000" in warning and "3.2 GiB" in warning
    assert capacity_memory_warning(10_000_000, "BFS", 16 * gib) is None
    # a quarter of 15 GiB is 4.03e9 B: the BFS cache (3.46e9 B) fits, the PROB one (4.23e9 B) does not
    assert capacity_memory_warning(10_000_000, "BFS", 15 * gib) is None
    assert capacity_memory_warning(10_000_000, "PROB", 15 * gib) is not None
    assert capacity_memory_warning(1_000_000, "PROB", 8 * gib) is None
    assert capacity_memory_warning(10_000_000, "BFS", None) is None  # unknown RAM: nothing to compare with
    assert full_cache_bytes(1000, "PROB") == 423_000


def test_the_ngram_proposer_logs_the_warning(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    from specserve.speculative import ngram

    args = ServerArgs(speculative_algorithm="NGRAM").validate()
    runner = SimpleNamespace(device="cpu")
    monkeypatch.setattr(ngram, "physical_ram_bytes", lambda: 2**30)
    with caplog.at_level(logging.WARNING, logger="specserve.speculative.ngram"):
        ngram.NgramProposer(args, runner, kv=None)
    assert any("--speculative-ngram-capacity" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(ngram, "physical_ram_bytes", lambda: 1024 * 2**30)
    with caplog.at_level(logging.WARNING, logger="specserve.speculative.ngram"):
        proposer = ngram.NgramProposer(args, runner, kv=None)
    assert not caplog.records and proposer.cache.capacity == 10_000_000


def test_reset_empties_the_cache():
    cache = insert_all(small(), [1, 2, 3])
    cache.reset()
    assert cache.num_nodes == 0 and cache.match([1, 2]) == ([], [])
    insert_all(cache, [1, 2])
    assert cache.match([1]) == ([2], [-1])


# ---------------------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("overrides", [
    dict(branch_length=1, min_window=1, max_window=1),
    dict(min_window=0),
    dict(min_window=3, max_window=2),
    dict(max_window=4),  # not < branch_length 4
    dict(min_bfs_breadth=0),
    dict(min_bfs_breadth=4, max_bfs_breadth=3),
    dict(match_type="DFS"),
    dict(capacity=3),  # < branch_length: a full pool could hold nothing but the path being inserted
    dict(max_draft_nodes=-1),
])
def test_bad_parameters_are_rejected(overrides):
    with pytest.raises(ValueError):
        small(**overrides)


def test_from_server_args_maps_every_flag():
    args = ServerArgs(speculative_ngram_capacity=500, speculative_ngram_branch_length=6,
                      speculative_ngram_min_match_window_size=2, speculative_ngram_max_match_window_size=5,
                      speculative_ngram_min_bfs_breadth=2, speculative_ngram_max_bfs_breadth=4,
                      speculative_ngram_match_type="PROB")
    cache = NgramCache.from_server_args(args, num_draft_tokens=8)
    got = (cache.capacity, cache.branch_length, cache.min_window, cache.max_window, cache.min_bfs_breadth,
           cache.max_bfs_breadth, cache.match_type, cache.max_draft_nodes)
    assert got == (500, 6, 2, 5, 2, 4, "PROB", 7)


def test_numpy_ids_work_like_python_ints():
    from_np = small()
    from_np.insert(np.array([10, 11, 12, 13, 14, 15]))
    # same trie as test_prompt_lookup_drafts_the_continuation_of_the_prompt
    assert from_np.match(np.array([99, 10, 11])) == ([12, 13, 14], [-1, 0, 1])
    assert all(type(t) is int for t in from_np.match([99, 10, 11])[0])

"""Batch-aware speculation: the pure tree schedule and the measuring policy on hand-checked inputs."""

from __future__ import annotations

import pytest

from specserve.spec.batch_policy import BatchPolicy, TreeShape, bucket_of, shape_for_batch

FULL = TreeShape(5, 4, 8)


@pytest.mark.parametrize("batch,want", [
    (1, FULL), (8, FULL),  # 8 x 8 = 64 fits the budget
    (9, TreeShape(5, 1, 6)),  # 64 // 9 = 7 nodes, capped at the full depth 5 + 1
    (16, TreeShape(3, 1, 4)),  # 64 // 16 = 4 nodes: a chain of 3 drafts
    (32, TreeShape(1, 1, 2)),  # 2 nodes: one draft
    (33, None),  # fewer than 2 nodes per request: no speculation
])
def test_tree_shrinks_to_a_chain_then_turns_off(batch, want):
    assert shape_for_batch(batch, FULL, 64, None) == want


def test_disable_batch_size_and_no_budget():
    assert shape_for_batch(4, FULL, 64, disable_batch_size=3) is None
    assert shape_for_batch(3, FULL, 64, disable_batch_size=3) == FULL
    assert shape_for_batch(1000, FULL, 0, None) == FULL  # budget 0: never shrink


def test_buckets():
    assert [bucket_of(b) for b in (1, 5, 8, 9, 16, 17, 33)] == [1, 5, 8, 16, 16, 32, 64]


def test_policy_tries_both_then_runs_the_faster_and_explores():
    p = BatchPolicy(FULL, explore_every=4)
    assert p.choose(1) == FULL  # step 1: no estimate yet -> speculate
    p.record(1, True, seconds=0.010, tokens=2)  # 200 tok/s
    assert p.choose(1) is None  # step 2: plain has no estimate -> try it
    p.record(1, False, seconds=0.004, tokens=1)  # 250 tok/s
    assert p.choose(1) is None  # step 3: plain is faster
    assert p.choose(1) == FULL  # step 4: every 4th step tries the loser
    p.record(1, True, seconds=0.010, tokens=4)  # 400 tok/s: spec EMA = 0.8 * 200 + 0.2 * 400 = 240
    assert p.rates[1].spec == pytest.approx(240.0)
    assert p.choose(1) is None  # 240 < 250
    p.record(1, True, seconds=0.001, tokens=4)  # 4000 tok/s: EMA = 0.8 * 240 + 0.2 * 4000 = 992
    assert p.choose(1) == FULL
    assert p.summary()["1"]["winner"] == "spec"


def test_policy_without_auto_off_follows_the_schedule_only():
    p = BatchPolicy(FULL, token_budget=64, auto_off=False)
    p.record(1, True, seconds=1.0, tokens=1)
    p.record(1, False, seconds=0.001, tokens=1)
    assert p.choose(1) == FULL and p.choose(16) == TreeShape(3, 1, 4) and p.choose(40) is None
    assert p.rates == {}  # nothing measured


def test_buckets_are_measured_separately():
    p = BatchPolicy(FULL)
    p.choose(1)
    p.record(1, True, 0.01, 4)
    p.choose(1)
    p.record(1, False, 0.01, 1)
    assert p.choose(2) == FULL  # bucket 2 has no estimate yet: speculate first

"""Batch-aware speculation: the pure tree schedule and the measuring policy on hand-checked inputs."""

from __future__ import annotations

import pytest

from specserve.speculative.batch_policy import (
    CLEAR_BACKOFF,
    CLEAR_LOSS,
    MIN_TRY_TOKENS,
    PLAIN_FIRST_ABOVE,
    SPEC_MARGIN,
    TRY_STEPS,
    WARMUP_STEPS,
    BatchPolicy,
    TreeShape,
    batch_kind,
    bucket_of,
    fit_to_remaining,
    shape_for_batch,
)

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


@pytest.mark.parametrize("shape,most_new,want", [
    (FULL, 6, FULL),  # 5 levels: the deepest node is the 6th new token
    (FULL, 100, FULL),
    (FULL, 5, TreeShape(4, 4, 8)),  # 4 levels hold 1 + 4 + 3 * 16 = 53 >= 8 nodes
    (FULL, 2, TreeShape(1, 4, 5)),  # one level: the root and its 4 children
    (TreeShape(3, 1, 4), 3, TreeShape(2, 1, 3)),  # a chain loses its last node
    (FULL, 1, None),  # one token left: a plain step makes it
    (FULL, 0, None),
])
def test_fit_to_remaining(shape, most_new, want):
    assert fit_to_remaining(shape, most_new) == want


def test_a_step_that_cannot_use_a_draft_is_not_a_choice_of_its_bucket():
    p = BatchPolicy(FULL)
    assert p.choose(3, most_new=1) is None and not p.rates  # plain, and no bucket measured or counted
    assert p.choose(3, most_new=3) == TreeShape(2, 4, 8) and p.rates[(3, "greedy")].steps == 1


def test_a_batch_about_to_end_with_its_drafter_behind_starts_no_try():
    """A shrinking batch's last requests, after plain steps, reach a bucket not measured yet with a few tokens
    left: plain steps, which do not start its estimates; the first batch of that size with MIN_TRY_TOKENS left, or
    with its drafter caught up, measures it."""
    p = _policy(explore_every=1000)
    for left in range(MIN_TRY_TOKENS - 1, 1, -1):
        assert p.choose(3, most_new=left, drafter_behind=True) is None
        p.record(3, False, 1.0, 50)
    assert p.rates[(3, "greedy")].plain.rate is None and p.rates[(3, "greedy")].spec.rate is None
    assert p.choose(3, most_new=MIN_TRY_TOKENS - 1) is not None  # drafter up to date: the try starts
    p = _policy(explore_every=1000)
    flags = []
    for _ in range(2 * TRY_STEPS + 2):
        speculative = p.choose(3, most_new=MIN_TRY_TOKENS, drafter_behind=True) is not None
        p.record(3, speculative, 1.0, 300 if speculative else 200)
        flags.append(speculative)
    assert flags == [True] * TRY_STEPS + [False] * TRY_STEPS + [True] * 2


def test_a_due_refresh_of_speculation_waits_for_a_batch_that_can_use_it():
    p = _policy(explore_every=10)
    assert _run(p, 8, spec_rate=100, plain_rate=200) == [True] * 4 + [False] * 4  # both measured: plain wins
    for _ in range(20):  # speculation's refresh is due from step 10 on, but these steps have 5 tokens left
        assert p.choose(1, most_new=5, drafter_behind=True) is None
        p.record(1, False, 1.0, 200)
    assert p.choose(1, most_new=MIN_TRY_TOKENS, drafter_behind=True) is not None  # now it starts


def test_buckets():
    assert [bucket_of(b) for b in (1, 5, 8, 9, 16, 17, 33)] == [1, 5, 8, 16, 16, 32, 64]


def _run(p: BatchPolicy, steps: int, spec_rate: float, plain_rate: float, batch: int = 1,
         kind: str = "greedy") -> list[bool]:
    """Drive the policy for `steps` steps where speculative / plain steps produce these tokens per second;
    -> which steps speculated."""
    out = []
    for _ in range(steps):
        speculative = p.choose(batch, kind) is not None
        p.record(batch, speculative, 1.0, int(spec_rate if speculative else plain_rate), kind=kind)
        out.append(speculative)
    return out


def _policy(**kw) -> BatchPolicy:
    """A policy without warm-up steps (they have their own test), so schedules count measured steps only."""
    return BatchPolicy(FULL, warmup_steps=0, **kw)


def test_policy_measures_both_then_runs_the_faster():
    p = _policy(explore_every=100)
    # TRY_STEPS = 4 speculative steps, 4 plain steps, then the faster (plain here) until the next try
    assert _run(p, 12, spec_rate=100, plain_rate=200) == [True] * 4 + [False] * 8
    assert p.summary()["1 greedy"] == {"spec_tok_s": pytest.approx(100.0), "plain_tok_s": pytest.approx(200.0),
                                "steps": 12, "winner": "plain"}
    p = _policy(explore_every=100)
    assert _run(p, 12, spec_rate=300, plain_rate=200) == [True] * 4 + [False] * 4 + [True] * 4


def test_warmup_steps_are_not_measured_and_a_cold_start_does_not_turn_speculation_off():
    p = BatchPolicy(FULL, explore_every=1000)  # the default warm-up
    flags = []
    # the first speculative steps are 10x slower (cold), then speculation runs at 300 vs plain's 200 tok/s
    for i in range(2 * (WARMUP_STEPS + TRY_STEPS) + 4):
        speculative = p.choose(1) is not None
        cold = speculative and i < WARMUP_STEPS
        p.record(1, speculative, 10.0 if cold else 1.0, 300 if speculative else 200)
        flags.append(speculative)
    n = WARMUP_STEPS + TRY_STEPS
    assert flags == [True] * n + [False] * n + [True] * 4
    assert p.rates[(1, "greedy")].spec.rate == pytest.approx(300.0)  # the cold steps never entered the estimate


def test_a_tries_warm_up_steps_count_in_speculations_acceptance_not_in_its_time():
    """A warm-up step's time is cold, but what it accepted is as telling as any step's: a try that may end after its
    first measured step still learns acceptance from the steps before it."""
    p = BatchPolicy(FULL, explore_every=1000)  # the default warm-up
    for i in range(WARMUP_STEPS + TRY_STEPS):
        assert p.choose(1) is not None
        warm = i < WARMUP_STEPS
        p.record(1, True, 10.0 if warm else 1.0, 8 if warm else 2)
    spec = p.rates[(1, "greedy")].spec
    assert spec.seconds / spec.steps == pytest.approx(1.0)  # the warm-up steps' 10 s left out
    assert 2 < spec.long_tokens / spec.long_steps < 8  # their 8 tokens each counted with the measured steps' 2


def test_every_try_starts_with_unmeasured_steps():
    """After a switch the other mode's first steps run cold (its weights left the CPU caches): each later try of the
    losing mode also runs WARMUP_STEPS steps unmeasured before its measured ones."""
    p = BatchPolicy(FULL, explore_every=10)  # the default warm-up
    flags, run_length = [], 0
    for _ in range(40):
        speculative = p.choose(1) is not None
        run_length = run_length + 1 if flags and flags[-1] == speculative else 1
        # speculative steps make 300 tok/s; plain ones 200, but 50 for the first two after a switch
        rate = 300 if speculative else (50 if run_length <= 2 and flags else 200)
        p.record(1, speculative, 1.0, rate)
        flags.append(speculative)
    n = WARMUP_STEPS + TRY_STEPS
    first = [True] * n + [False] * n  # both modes measured, speculation wins (300 > 200 x 1.03)
    assert flags[: 2 * n] == first
    later = flags[2 * n:].index(False) + 2 * n  # the next try of plain decoding
    # its cold steps unmeasured; its first measured step (200 against 300: clearly behind) ends it
    assert flags[later : later + WARMUP_STEPS + 1] == [False] * (WARMUP_STEPS + 1)
    assert flags[later + WARMUP_STEPS + 1] is True
    assert p.rates[(1, "greedy")].plain.rate == pytest.approx(200.0)  # the two cold plain steps were not measured


def test_a_try_keeps_the_previous_estimate_until_its_first_measured_step():
    p = BatchPolicy(FULL, explore_every=10)
    _run(p, 2 * (WARMUP_STEPS + TRY_STEPS), spec_rate=300, plain_rate=200)  # both measured: speculation wins
    while p.choose(1) is not None:  # speculative steps until the next try of plain decoding
        p.record(1, True, 1.0, 300)
    p.record(1, False, 1.0, 50)  # the try's first (warm-up) step
    assert p.summary()["1 greedy"]["plain_tok_s"] == pytest.approx(200.0)
    assert p.summary()["1 greedy"]["winner"] == "spec"
    for _ in range(WARMUP_STEPS - 1):
        assert p.choose(1) is None
        p.record(1, False, 1.0, 50)
    assert p.choose(1) is None
    p.record(1, False, 1.0, 100)  # the first measured step: the estimate restarts from it
    assert p.summary()["1 greedy"]["plain_tok_s"] == pytest.approx(100.0)


def test_steps_that_built_compiled_graphs_are_not_measured():
    """--enable-torch-compile builds graphs for new shapes after the warm-up: such a step (here 20 s) is run but
    not measured, and its try gets one more step, so a try still measures TRY_STEPS steady steps."""
    p = _policy(explore_every=1000)
    flags = []
    compiling = {1, 5}  # a speculative step of the first try, a plain step of the second
    for i in range(2 * TRY_STEPS + len(compiling) + 4):
        speculative = p.choose(1) is not None
        p.record(1, speculative, 20.0 if i in compiling else 1.0, 300 if speculative else 200,
                 compiled=i in compiling)
        flags.append(speculative)
    assert flags == [True] * (TRY_STEPS + 1) + [False] * (TRY_STEPS + 1) + [True] * 4
    one = p.rates[(1, "greedy")]
    assert one.spec.rate == pytest.approx(300.0) and one.plain.rate == pytest.approx(200.0)
    p.record(1, True, 50.0, 1, compiled=True)  # outside a try: not measured either
    assert p.rates[(1, "greedy")].spec.rate == pytest.approx(300.0) and p.choose(1) == FULL


def test_speculation_must_win_by_the_margin():
    """Speculation's costs outside its steps (the drafter's prompt catch-up, staggered finishes) make a tie a loss:
    a speculative rate within the margin above plain's runs plain steps, one beyond it speculates."""
    p = _policy(explore_every=1000)
    faster = 100 * (1 + SPEC_MARGIN / 2)  # speculation a little faster than plain: within the margin
    assert _run(p, 12, spec_rate=faster, plain_rate=100)[8:] == [False] * 4
    p = _policy(explore_every=1000)
    assert _run(p, 12, spec_rate=100, plain_rate=100)[8:] == [False] * 4  # a tie
    p = _policy(explore_every=1000)
    assert _run(p, 12, spec_rate=100 * (1 + 2 * SPEC_MARGIN), plain_rate=100)[8:] == [True] * 4


def test_exploration_backs_off_while_the_loser_keeps_losing():
    p = _policy(explore_every=10)
    flags = _run(p, 120, spec_rate=180, plain_rate=200)  # speculation behind by 10%: a narrow loss
    tries = [i + 1 for i, f in enumerate(flags) if f and i >= 4]  # speculative steps after the first measurement
    # both measured by step 8; tries of 4 steps 10 steps later (18), then 20 (41) and 40 (84) steps after the
    # previous try: the interval doubles each time the try loses
    assert tries == [18, 19, 20, 21, 41, 42, 43, 44, 84, 85, 86, 87]
    assert p.rates[(1, "greedy")].interval == 80


def test_a_try_that_falls_clearly_behind_ends_at_once_and_backs_off_further():
    """A refreshed estimate more than CLEAR_LOSS below the winner's ends its try at that step (the rest would repeat
    the loss), and the next try comes CLEAR_BACKOFF times later instead of twice."""
    assert 100 < 200 * (1 - CLEAR_LOSS)
    p = _policy(explore_every=10)
    flags = _run(p, 240, spec_rate=100, plain_rate=200)
    assert flags[:8] == [True] * 4 + [False] * 4  # the first estimates: whole tries
    tries = [i + 1 for i, f in enumerate(flags) if f and i >= 4]
    # one step each: at step 18 (interval 10), then 40 steps later (58), then 160 (218)
    assert tries == [18, 58, 218]
    assert p.rates[(1, "greedy")].interval == 10 * CLEAR_BACKOFF ** 3


def test_large_batches_measure_plain_steps_first_and_a_clear_loss_ends_the_first_try_of_speculation():
    """Above PLAIN_FIRST_ABOVE requests a bucket measures plain steps first; one speculative step there sums the
    acceptance of all its requests, so a first try of speculation that falls clearly behind ends at that step."""
    batch = PLAIN_FIRST_ABOVE + 1
    shape = TreeShape(3, 1, 4)
    p = BatchPolicy(shape, warmup_steps=0, explore_every=100)
    assert _run(p, 8, spec_rate=100, plain_rate=200, batch=batch) == [False] * TRY_STEPS + [True] + [False] * 3
    assert p.summary()[f"{bucket_of(batch)} greedy"]["winner"] == "plain"
    assert p.rates[(bucket_of(batch), "greedy")].interval == 100 * CLEAR_BACKOFF
    p = BatchPolicy(shape, warmup_steps=0, explore_every=100)  # speculation ahead: both tries run whole
    assert _run(p, 10, spec_rate=300, plain_rate=200, batch=batch) == [False] * TRY_STEPS + [True] * 6
    p = BatchPolicy(shape, warmup_steps=0, explore_every=100)  # a small batch still starts with speculation
    assert _run(p, 5, spec_rate=100, plain_rate=200, batch=PLAIN_FIRST_ABOVE)[:TRY_STEPS] == [True] * TRY_STEPS


def test_a_try_measures_afresh_so_speculation_comes_back_when_it_pays_again():
    p = _policy(explore_every=10)
    assert _run(p, 17, spec_rate=100, plain_rate=200)[8:] == [False] * 9  # plain wins for now
    assert _run(p, 8, spec_rate=400, plain_rate=200) == [True] * 8  # the try at step 18 finds 400 > 200
    assert p.rates[(1, "greedy")].interval == 10 and p.summary()["1 greedy"]["winner"] == "spec"


def test_policy_without_auto_off_follows_the_schedule_only():
    p = BatchPolicy(FULL, token_budget=64, auto_off=False)
    _run(p, 20, spec_rate=1, plain_rate=1000)
    assert p.choose(1) == FULL and p.choose(16) == TreeShape(3, 1, 4) and p.choose(40) is None
    assert p.rates == {}  # nothing measured


def test_buckets_are_measured_separately():
    p = _policy(explore_every=100)
    _run(p, 10, spec_rate=100, plain_rate=200, batch=1)
    assert p.choose(2) == FULL  # bucket 2 has no estimate yet: speculation is measured first


def test_batch_kinds():
    assert [batch_kind(g) for g in ([True], [True, True], [False], [False, False], [True, False])] == \
        ["greedy", "greedy", "sampled", "sampled", "mixed"]
    assert [batch_kind([True, False], c) for c in ([False, False], [True, False], [False, True])] == \
        ["mixed", "mixed+grammar", "mixed+grammar"]
    assert batch_kind([True], [True]) == "greedy+grammar" and batch_kind([False], [False]) == "sampled"


def test_sampled_and_greedy_batches_are_measured_separately():
    """Sampled batches where speculation loses do not turn it off for greedy batches of the same size, nor the
    reverse."""
    p = _policy(explore_every=100)
    _run(p, 12, spec_rate=100, plain_rate=200, batch=4, kind="sampled")
    _run(p, 12, spec_rate=300, plain_rate=200, batch=4, kind="greedy")
    assert p.choose(4, "sampled") is None and p.choose(4, "greedy") == FULL
    summary = p.summary()
    assert summary["4 sampled"]["winner"] == "plain" and summary["4 greedy"]["winner"] == "spec"
    assert p.choose(4, "mixed") == FULL and "4 mixed" in p.summary()  # a kind of its own, measured afresh


def test_a_few_unlucky_steps_do_not_outweigh_speculations_acceptance():
    """Acceptance varies step to step far more than step time: four poor steps in a row (2 tokens where 5 is usual)
    do not turn speculation off, since its tokens per step come from its last ~50 steps (a 10-step window of them
    alone would put it at 3.97 tok/s, under plain decoding's 4 with the margin)."""
    p = _policy(explore_every=1000)
    assert _run(p, 48, spec_rate=5, plain_rate=4) == [True] * 4 + [False] * 4 + [True] * 40
    assert _run(p, 4, spec_rate=2, plain_rate=4) == [True] * 4
    one = p.rates[(1, "greedy")]
    assert one.spec.rate > one.plain.rate * (1 + SPEC_MARGIN) and p.choose(1) is not None


def test_a_lasting_drop_in_acceptance_turns_speculation_off():
    p = _policy(explore_every=10)
    _run(p, 8, spec_rate=5, plain_rate=4)  # both measured: speculation wins
    flags = _run(p, 200, spec_rate=2, plain_rate=4)  # acceptance falls for good
    assert flags[-20:] == [False] * 20  # the longer window follows it within its ~50 steps
    assert p.summary()["1 greedy"]["winner"] == "plain"


def test_speculations_step_time_restarts_with_each_try_and_its_acceptance_does_not():
    p = _policy(explore_every=1000)
    _run(p, 8, spec_rate=5, plain_rate=4)
    spec = p.rates[(1, "greedy")].spec
    spec.restart()
    assert spec.rate is None and spec.long_tokens > 0  # no step time until a measured step: no rate
    spec.add(5, 2.0)  # a slower step: the rate follows the new step time at the kept acceptance
    assert spec.rate == pytest.approx(2.5)

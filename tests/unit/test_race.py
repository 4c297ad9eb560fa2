"""The exponential race of seeded sampling: the hash against a plain-Python reference, purity, the Exp(1)
distribution, independence across positions, and race winners distributed as the probabilities."""

import math

import pytest
import torch

from specserve.sampling import race
from specserve.sampling.race import (
    exponentials,
    grid_keys,
    position_key,
    race_argmax,
    race_keys,
    race_sample,
    race_scores,
)
from tests.unit.race_reference import reference_exponential


def test_grid_keys_key_each_row_from_its_start():
    keys = grid_keys([42, 7], [5, 0], 3, "cpu")  # [2, 3, 2]
    assert keys.tolist() == [[list(position_key(42, t)) for t in (5, 6, 7)],
                             [list(position_key(7, t)) for t in (0, 1, 2)]]


def test_splitmix64_matches_the_reference_stream():
    # SplitMix64 started at state 0 (the reference splitmix64.c) outputs these three values first
    stream = [race._mix64(k * race._GOLDEN_GAMMA & race._U64) for k in (1, 2, 3)]
    assert stream == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_position_keys_are_pure_and_differ_by_seed_and_position():
    assert position_key(42, 5) == position_key(42, 5)
    assert len({position_key(42, 5), position_key(43, 5), position_key(42, 4)}) == 3
    assert all(-(2**31) <= k < 2**31 for k in position_key(2**64 - 1, 10**9))
    keys = race_keys([42, 7], [5, 0], "cpu")
    assert keys.dtype == torch.int32 and keys.tolist() == [list(position_key(42, 5)), list(position_key(7, 0))]
    with pytest.raises(ValueError):
        race_keys([1], [0, 1], "cpu")


@pytest.mark.parametrize("seed, position", [(0, 0), (42, 7), (2**63 + 5, 123456)])
def test_exponentials_match_the_plain_python_reference(seed, position):
    key = position_key(seed, position)
    ids = torch.tensor([0, 1, 2, 3, 1000, 49151, 2**20])
    got = exponentials(torch.tensor([key], dtype=torch.int32), ids)[0].tolist()
    want = [reference_exponential(key, i) for i in ids.tolist()]
    assert got == pytest.approx(want, rel=1e-6)


def test_a_token_gets_the_same_value_whatever_else_is_asked():
    keys = race_keys([3, 4], [0, 9], "cpu")
    full = exponentials(keys, torch.arange(300))  # [2, 300]
    some = torch.tensor([[299, 5, 17], [0, 0, 123]])  # per-row id lists
    assert torch.equal(exponentials(keys, some), full.gather(1, some))
    assert torch.equal(exponentials(keys[1:], torch.arange(300)), full[1:])


def test_compiled_kernel_equals_eager():
    keys = race_keys(list(range(8)), list(range(8)), "cpu")
    ids = torch.arange(5000, dtype=torch.int32).view(1, -1)
    eager = race._exponentials(keys[:, :1].contiguous(), keys[:, 1:].contiguous(), ids)
    assert torch.allclose(exponentials(keys, ids.view(-1)), eager, rtol=1e-6, atol=0)


def test_values_are_exponential_and_independent_across_positions_seeds_and_tokens():
    n = 20_000
    expo = exponentials(race_keys([1] * 2 + [2], [0, 1, 0], "cpu"), torch.arange(n))  # [3, n]
    u = torch.exp(-expo.double())  # uniform in (0, 1) if E ~ Exp(1)
    sigma = math.sqrt(n * 0.1 * 0.9)
    for row in u:
        counts = torch.histc(row, bins=10, min=0.0, max=1.0).tolist()
        assert all(abs(c - n / 10) < 6 * sigma for c in counts), counts
    corr = torch.corrcoef(u)  # row 1: the next position of the same seed; row 2: another seed
    assert abs(corr[0, 1].item()) < 0.05 and abs(corr[0, 2].item()) < 0.05, corr
    neighbours = torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1].item()  # adjacent token ids
    assert abs(neighbours) < 0.05


def test_race_argmax_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.5, 0.3, 0.2, 0.0]])
    e = torch.tensor([[2.0, 0.5, 1.0, 1e-9], [0.1, 0.5, 1.0, 1e-9]])
    # row 0: .25, .6, .2, 0 -> 1; row 1: 5, .6, .2, 0 -> 0; a zero-probability token never wins
    assert race_argmax(p, e).tolist() == [1, 0]


def test_race_winners_follow_the_probabilities():
    n = 20_000
    p = torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4])
    got = race_sample(p.expand(n, 5), list(range(n)), [3] * n)
    counts = torch.bincount(got, minlength=5).tolist()
    assert counts[2] == 0
    for count, prob in zip(counts, p.tolist(), strict=True):
        assert abs(count - n * prob) <= 6 * math.sqrt(n * prob * (1 - prob)) + 1e-9, counts


def test_race_scores_argmax_is_the_drafts_race_winner_with_the_targets_noise():
    # a draft whose distribution equals the target's picks exactly the target's token (coupling), over the
    # target ids of its columns (here a draft vocabulary of 3 of the target's 6 tokens, in another order)
    torch.manual_seed(0)
    keys = race_keys(list(range(200)), [4] * 200, "cpu")
    target = torch.softmax(torch.randn(200, 6), -1)
    target[:, [1, 3, 5]] = 0.0
    draft_ids = torch.tensor([4, 0, 2])
    logq = torch.log(target[:, draft_ids] / target[:, draft_ids].sum(-1, keepdim=True))
    drafted = draft_ids[race_scores(logq, torch.log(exponentials(keys, draft_ids))).argmax(-1)]
    full = race_argmax(target, exponentials(keys, torch.arange(6)))
    assert torch.equal(drafted, full)

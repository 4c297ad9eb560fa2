"""The acceptance formulas of benchmarks/bench_sampled_schemes.py on hand-checked inputs."""

import math

import pytest
import torch

from bench_sampled_schemes import coupled, specinfer, target_only

P = torch.tensor([0.5, 0.3, 0.2, 0.0])
Q = torch.tensor([0.1, 0.6, 0.3, 0.0])


def expo(draws: int, seed: int = 0) -> torch.Tensor:
    return -torch.log1p(-torch.rand(draws, 4, generator=torch.Generator().manual_seed(seed)))


def test_target_only_sums_the_targets_mass_on_the_drafts_top_k():
    assert target_only(P, Q, 1) == pytest.approx(0.3) and target_only(P, Q, 2) == pytest.approx(0.5)
    assert target_only(P, Q, 4) == pytest.approx(1.0)


def test_coupled_drafting_with_the_targets_own_distribution_always_matches():
    assert coupled(P, P, 1, expo(500)) == 1.0
    assert coupled(P, Q, 3, expo(500)) == 1.0  # the three tokens either can pick


def test_coupled_single_draft_lies_between_independent_draws_and_the_optimal_coupling():
    got = coupled(P, Q, 1, expo(20_000))
    independent = float((P * Q).sum())  # 0.26: draft and target sampled apart
    optimal = float(torch.minimum(P, Q).sum())  # 0.6 = 1 - TV
    assert independent < got < optimal


def test_specinfer_accepts_one_minus_tv_with_one_draft():
    gen = torch.Generator().manual_seed(1)
    assert specinfer(P, P, 1, 200, gen) == 1.0
    n, want = 4000, float(torch.minimum(P, Q).sum())
    got = specinfer(P, Q, 1, n, gen)
    assert abs(got - want) < 6 * math.sqrt(want * (1 - want) / n)
    assert specinfer(P, Q, 3, 2000, gen) > got  # more drafts, more chances

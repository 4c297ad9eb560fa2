"""Simulated accept length (SPECSERVE_SIMULATE_ACC_LEN): the pure walk on hand-drawn trees, the length sampler's
distribution, the env parsing, and the engine with a tiny target + random EAGLE head (drafts that are naturally
almost never accepted)."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.config import ConfigError
from specserve.speculative import build_tree
from specserve.speculative.accept_stats import accept_length
from specserve.speculative.simulate import AcceptSimulator, read_simulate_env, sample_accept_lengths
from specserve.speculative.verify import simulate_accept
from specserve.test.tiny import make_eagle_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import spec_kwargs


def t(x):
    return torch.tensor(x, dtype=torch.int64)


# The hand-drawn tree of test_verify (node: token); first children: 1 under 0, 4 under 1, 7 under 4.
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
TARGET = [90, 91, 92, 93, 94, 95, 96, 97]  # the target's argmax at node i is 90 + i (never matches a draft)


def test_accepts_first_child_path_up_to_the_prescribed_length():
    tree = build_tree(t([10] * 4), t([TOKENS] * 4), t([PARENTS] * 4))
    res = simulate_accept(tree, t([TARGET] * 4), t([1, 2, 4, 9]))
    assert res.accept_len.tolist() == [0, 1, 3, 3]  # 9 tokens asked, the path holds 3 drafts
    assert res.accepted_nodes.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 4, 7], [0, 1, 4, 7]]
    assert res.bonus_tokens.tolist() == [90, 91, 97, 97]  # target at the last accepted node
    assert res.token_lists() == [[90], [11, 91], [11, 14, 17, 97], [11, 14, 17, 97]]


def test_path_ends_at_a_leaf_first_child_and_padding_rows():
    # row 0: the root's first child (node 1) is a leaf, the deep branch hangs off node 2; row 1: root only
    tree = build_tree(t([10, 10]), t([[11, 12, 13], [11, 12, 13]]), t([[0, 0, 2], [0, 0, 2]]), t([4, 1]))
    res = simulate_accept(tree, t([[50, 51, 52, 53]] * 2), t([3, 3]))
    assert res.accept_len.tolist() == [1, 0]
    assert res.token_lists() == [[11, 51], [50]]


def test_match_expected_mean_and_support():
    g = torch.Generator().manual_seed(0)
    x = sample_accept_lengths(2.3, 20000, 6, g)
    assert set(x.unique().tolist()) == {2, 3}
    assert abs(x.double().mean().item() - 2.3) < 0.02
    assert sample_accept_lengths(3.0, 50, 6, g).tolist() == [3] * 50  # an integer mean is exact every step
    assert sample_accept_lengths(9.5, 50, 4, g).tolist() == [4] * 50  # clamped to the deepest draft + 1


def test_multinomial_mean_and_bounds():
    g = torch.Generator().manual_seed(1)
    x = sample_accept_lengths(3.5, 20000, 6, g, method="multinomial")
    assert x.min().item() >= 1 and x.max().item() <= 6
    assert abs(x.double().mean().item() - 3.5) < 0.05  # symmetric clamping: the mean stays put
    assert x.unique().numel() >= 4  # a spread, not two values


def test_env_parsing():
    assert read_simulate_env({}) is None
    assert read_simulate_env({"SPECSERVE_SIMULATE_ACC_LEN": " "}) is None
    assert read_simulate_env({"SGLANG_SIMULATE_ACC_LEN": "2.5"}) == (2.5, "match-expected")
    env = {"SPECSERVE_SIMULATE_ACC_LEN": "4", "SGLANG_SIMULATE_ACC_LEN": "2",
           "SGLANG_SIMULATE_ACC_METHOD": "Multinomial"}
    assert read_simulate_env(env) == (4.0, "multinomial")
    for bad in ("0.5", "abc", "nan", "-1"):
        with pytest.raises(ConfigError, match="SGLANG_SIMULATE_ACC_LEN"):
            read_simulate_env({"SGLANG_SIMULATE_ACC_LEN": bad})
    with pytest.raises(ConfigError, match="SPECSERVE_SIMULATE_ACC_METHOD"):
        read_simulate_env({"SPECSERVE_SIMULATE_ACC_LEN": "2", "SPECSERVE_SIMULATE_ACC_METHOD": "exact"})
    assert AcceptSimulator.from_env(environ={}) is None


# ----------------------------------------------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_head(target, tmp_path_factory):
    return make_eagle_head_dir(str(tmp_path_factory.mktemp("eagle") / "random"), target, kind="random")


def _accept_length(outs: list[dict]) -> float:
    return accept_length([o["meta_info"] for o in outs])


def test_engine_reaches_the_simulated_accept_length(target, random_head, monkeypatch):
    kw = dict(max_total_tokens=4096, **spec_kwargs("EAGLE", random_head, 5, 1, 6))
    with Engine(model_path=target, disable_speculative_auto_off=True, **kw) as e:
        natural = _accept_length(e.generate(PROMPTS[:4], greedy(31)))
    monkeypatch.setenv("SPECSERVE_SIMULATE_ACC_LEN", "3")
    with Engine(model_path=target, **kw) as e:
        outs = e.generate(PROMPTS[:4], greedy(31))
        assert_no_kv_leak(e)
    assert natural < 1.5  # random drafts: the simulation, not the head, makes the difference
    # 31 tokens = 1 from prefill + 10 verify steps of exactly 3 (match-expected with an integer mean)
    assert _accept_length(outs) == pytest.approx(31 / 10)
    assert all(o["meta_info"]["spec_accept_histogram"] == [0, 0, 10] for o in outs)


def test_simulated_length_one_is_plain_decoding(target, random_head, monkeypatch):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS[:4], greedy(12))]
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "1.0")
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE", random_head, 5, 1, 6)) as e:
        outs = e.generate(PROMPTS[:4], greedy(12))
    assert [o["output_ids"] for o in outs] == plain  # only bonus tokens = the target's argmax each step
    # 12 tokens = 1 from prefill + 10 verify steps of one + the last, alone left, from a plain step
    assert _accept_length(outs) == pytest.approx((12 - 1) / 10)


def test_bad_value_fails_at_start_up(target, random_head, monkeypatch):
    monkeypatch.setenv("SPECSERVE_SIMULATE_ACC_LEN", "zero")
    with pytest.raises(ConfigError, match="SPECSERVE_SIMULATE_ACC_LEN"):
        Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE", random_head, 5, 1, 6))

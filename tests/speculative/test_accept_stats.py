"""Per-position acceptance counts (vLLM's definition) on hand-checked steps."""

import pytest

from specserve.speculative.accept_stats import add_step, position_increments, position_rates, sum_counts


def test_position_increments_mark_the_accepted_prefix():
    assert position_increments(0, 3) == [0, 0, 0]
    assert position_increments(2, 3) == [1, 1, 0]
    assert position_increments(3, 3) == [1, 1, 1]
    assert position_increments(0, 0) == []  # a root-only tree (NGRAM without a match)


@pytest.mark.parametrize("accepted, depth", [(4, 3), (-1, 2)])
def test_position_increments_reject_impossible_steps(accepted, depth):
    with pytest.raises(ValueError, match="draft depth"):
        position_increments(accepted, depth)


def test_add_step_accumulates_and_grows():
    # steps (accepted, depth): (2, 3) (0, 3) (3, 3) (1, 4) (0, 0)
    # position 1: steps 1, 3, 4 -> 3; position 2: steps 1, 3 -> 2; position 3: step 3 -> 1; position 4: none
    counts: list[int] = []
    for accepted, depth in [(2, 3), (0, 3), (3, 3), (1, 4), (0, 0)]:
        add_step(counts, accepted, depth)
    assert counts == [3, 2, 1, 0]
    assert sum(counts) == 2 + 0 + 3 + 1 + 0  # the accepted drafted tokens


def test_rates_divide_by_all_verify_steps():
    assert position_rates([3, 2, 1, 0], 5) == [0.6, 0.4, 0.2, 0.0]
    assert position_rates([0, 0], 0) == [0.0, 0.0]


def test_sum_counts_pads_shorter_lists():
    assert sum_counts([[1, 1], [2, 1, 1], []]) == [3, 2, 1]
    assert sum_counts([]) == []


@pytest.fixture(scope="module")
def eagle_target(model_factory):
    # one layer + unit-RMS embeddings: the "self" head mirrors it, so drafts are mostly accepted
    return model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=1024)


@pytest.mark.parametrize("tree", [(3, 1, 4), (4, 2, 7)])  # (num_steps, topk, num_draft_tokens): chain, tree
def test_engine_reports_per_position_counts(eagle_target, tmp_path, tree):
    """Per request, position k's count equals the verify steps whose histogram bucket is >= k (counted
    independently); the server totals are the sums over requests and the rates are totals / verify steps."""
    from specserve import Engine
    from specserve.test.tiny import make_eagle_head_dir
    from tests.engine.helpers import PROMPTS, greedy
    from tests.speculative.helpers import spec_kwargs

    head = make_eagle_head_dir(str(tmp_path / "eagle"), eagle_target, kind="self")
    with Engine(model_path=eagle_target, max_total_tokens=4096, **spec_kwargs("EAGLE", head, *tree)) as e:
        metas = [o["meta_info"] for o in e.generate(PROMPTS[:4], greedy(16))]
        info = e.get_server_info()
    steps = tree[0]
    for m in metas:
        hist, per_pos = m["spec_accept_histogram"], m["spec_accept_per_position"]
        assert len(per_pos) <= steps and len(hist) <= len(per_pos) + 1
        assert per_pos == [sum(hist[k:]) for k in range(1, len(per_pos) + 1)]
    totals = sum_counts([m["spec_accept_per_position"] for m in metas])
    verify = sum(m["spec_verify_ct"] for m in metas)
    assert info["spec_verify_ct"] == verify and info["spec_accepted_per_position"] == totals
    rates = info["spec_accept_rate_per_position"]
    assert rates == pytest.approx([c / verify for c in totals])
    assert rates[0] > 0.5 and all(a >= b for a, b in zip(rates, rates[1:], strict=False))

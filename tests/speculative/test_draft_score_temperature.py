"""--speculative-draft-score-temperature: greedy requests rank draft candidates by sharpened (or flattened) draft
probabilities, sampled requests by the draft's own. Only the verified trees change: greedy output stays plain
decoding's (with drafting and acceptance happening), and a sampled request gets the very trees of T = 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve import Engine
from specserve.speculative.eagle import EagleProposer
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs


def _proposer(temperature: float) -> EagleProposer:
    prop = EagleProposer.__new__(EagleProposer)  # only what _score_scale and _topk read
    prop.score_temperature, prop.device = temperature, torch.device("cpu")
    prop.draft = SimpleNamespace(vocab_ids=lambda hidden: None)  # no one-call ranking: _topk ranks _draft_logits
    return prop


def _req(temperature: float) -> SimpleNamespace:
    return SimpleNamespace(params=SimpleNamespace(is_greedy=temperature == 0))


def test_score_scale_per_row():
    """1/T on greedy requests' rows, 1 on sampled ones; rows request-major, rows_per_req each."""
    mixed = [_req(0), _req(0.8), _req(0)]
    got = _proposer(0.5)._score_scale(mixed, 2)
    assert got.shape == (6, 1)
    assert got.flatten().tolist() == [2.0, 2.0, 1.0, 1.0, 2.0, 2.0]
    assert _proposer(0.5)._score_scale([_req(0), _req(0)], 4) == 2.0  # all greedy: one factor
    assert _proposer(0.5)._score_scale([_req(0.7)], 4) is None  # all sampled: untouched
    assert _proposer(1.0)._score_scale(mixed, 2) is None  # the default: untouched


def test_topk_scores_sharpen_but_keep_the_ids():
    """The top-k ids do not depend on the scale; the probabilities are those of softmax(logits * scale)."""
    prop = _proposer(0.5)
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 1.0, 0.5]])
    prop._draft_logits = lambda h: (h, None)
    p1, ids1 = prop._topk(logits, 2)
    p2, ids2 = prop._topk(logits, 2, 2.0)
    assert ids1.tolist() == ids2.tolist() == [[0, 2], [1, 2]]
    # row 0 at scale 2: exp([4, 0, 2, -2]) normalised, top two 4 and 2
    z = torch.tensor([4.0, 0.0, 2.0, -2.0]).exp()
    assert torch.allclose(p2[0], torch.stack([z[0], z[2]]) / z.sum())
    assert p2[0, 0] > p1[0, 0] and p2[0, 1] < p1[0, 1]  # sharper: more on the top token, less on the next


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("score-temp")
    return {"eagle-self": ("EAGLE", make_eagle_head_dir(str(d / "e-self"), target, kind="self")),
            "eagle-random": ("EAGLE", make_eagle_head_dir(str(d / "e-random"), target, kind="random")),
            "eagle3-random": ("EAGLE3", make_eagle3_head_dir(str(d / "e3-random"), target, kind="random"))}


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


PEAKY = 20.0  # random heads' distributions are near uniform; scaled logits make rankings depend on the temperature


def _run_recording_trees(target: str, kw: dict, params, peaky: bool = True) -> tuple[list[dict], list]:
    """Outputs and every verified tree (tokens, parents) of a run, one request at a time. peaky: the draft's logits
    are multiplied by PEAKY (any draft is allowed: verification decides). Every step speculates (no timing-based
    plain steps), so two runs verify comparable sequences of trees."""
    trees = []
    with Engine(model_path=target, max_total_tokens=4096, disable_speculative_auto_off=True, **kw) as e:
        prop = e.loop.scheduler.decoder.proposer
        propose, draft_logits = prop.propose, prop._draft_logits

        def recording(reqs, shape=None):
            tree = propose(reqs, shape)
            trees.append((tree.tokens.tolist(), tree.parents.tolist()))
            return tree

        def peaky_logits(hidden):
            logits, to_target = draft_logits(hidden)
            return logits * PEAKY, to_target

        prop.propose = recording
        if peaky:
            prop._draft_logits = peaky_logits
        outs = [e.generate(p, params) for p in PROMPTS]
        assert_no_kv_leak(e)
    return outs, trees


@pytest.mark.parametrize("kind", ["eagle-random", "eagle3-random"])
@pytest.mark.parametrize("temperature", [0.3, 3.0])
def test_greedy_output_equals_plain_and_trees_change(target, heads, plain, kind, temperature):
    algorithm, head = heads[kind]
    base = spec_kwargs(algorithm, head, 4, 4, 8)
    outs, trees = _run_recording_trees(target, {**base, "speculative_draft_score_temperature": temperature},
                                       greedy(24))
    _, trees_at_1 = _run_recording_trees(target, base, greedy(24))
    assert [o["output_ids"] for o in outs] == plain
    assert trees != trees_at_1, "the score temperature changed no verified tree"
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0


def test_greedy_output_equals_plain_with_a_draft_that_is_accepted(target, heads, plain):
    algorithm, head = heads["eagle-self"]
    kw = spec_kwargs(algorithm, head, 4, 4, 8, speculative_draft_score_temperature=0.5)
    outs, _ = _run_recording_trees(target, kw, greedy(24), peaky=False)
    assert [o["output_ids"] for o in outs] == plain
    assert_drafting_happened(outs, min_accept_length=1.5)


def test_sampled_requests_keep_the_drafts_own_scores(target, heads):
    """A seeded sampled request verifies exactly the trees it gets at T = 1, and so emits the same tokens."""
    algorithm, head = heads["eagle-random"]
    base = spec_kwargs(algorithm, head, 4, 4, 8)
    params = {"max_new_tokens": 16, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    outs, trees = _run_recording_trees(target, {**base, "speculative_draft_score_temperature": 0.3}, params)
    outs_at_1, trees_at_1 = _run_recording_trees(target, base, params)
    assert trees == trees_at_1 and len(trees) > 0
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in outs_at_1]

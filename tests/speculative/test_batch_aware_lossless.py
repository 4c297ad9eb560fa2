"""Batch-aware speculation is lossless across its transitions: requests join and leave mid-generation, so steps
go from plain (batch above --speculative-disable-batch-size) to shrunk chains to the full tree and back, and every
request's greedy output equals plain decoding; the drafter catches up on plain-decoded tokens (its backlog).
Also: with a draft that is never accepted, the measuring policy runs plain steps instead (auto-off)."""

from __future__ import annotations

import time

import pytest

from specserve import Engine
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import spec_kwargs, staggered

LENGTHS = [8, 20, 32, 44, 56, 68]  # the batch of 6 shrinks one request at a time as they finish
LATE = [PROMPTS[6], PROMPTS[7]]  # join while the others run
# budget 10 with the (3, 2, 5) tree: batch 1-2 full tree, 3 a chain of 3, 4 a chain of 2, 5+ off (disable at > 4)
POLICY = dict(speculative_batch_token_budget=10, speculative_disable_batch_size=4, disable_speculative_auto_off=True)


@pytest.fixture(scope="module")
def drafts(target, self_head, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafts")
    return {
        "EAGLE": self_head,
        "EAGLE3": make_eagle3_head_dir(str(d / "eagle3"), target, kind="random"),
        "STANDALONE": target,
        "NGRAM": None,
    }


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return ([o["output_ids"] for o in e.generate(PROMPTS[:6], [greedy(n) for n in LENGTHS])],
                [o["output_ids"] for o in e.generate(LATE, greedy(24))])


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
def test_shrink_grow_and_off_transitions_are_lossless(target, drafts, plain, algorithm):
    kw = spec_kwargs(algorithm, drafts[algorithm], 3, 2, 5, **POLICY)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        first, late = staggered(e, PROMPTS[:6], [greedy(n) for n in LENGTHS], LATE, greedy(24))
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in first] == plain[0]
    assert [o["output_ids"] for o in late] == plain[1]
    assert info["spec_plain_steps"] > 0  # batch above 4: plain steps (the drafters' backlogs)
    assert info["spec_shrunk_steps"] > 0  # batch 3-4: chains
    assert info["spec_verify_ct"] > 0
    assert any(o["meta_info"]["spec_plain_tokens"] > 0 and o["meta_info"]["spec_verify_ct"] > 0 for o in first)
    if algorithm in ("EAGLE", "STANDALONE"):  # drafts that mirror the target: speculation resumed and accepted
        assert info["avg_spec_accept_length"] > 1.5


def test_auto_off_runs_plain_steps_when_drafts_never_land(target, tmp_path):
    head = make_eagle_head_dir(str(tmp_path / "random"), target, kind="random")
    with Engine(model_path=target, max_total_tokens=4096) as e:
        want = [e.generate(p, greedy(40))["output_ids"] for p in PROMPTS[:3]]
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE", head, 5, 4, 8)) as e:
        outs = [e.generate(p, greedy(40)) for p in PROMPTS[:3]]
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in outs] == want
    # a random head's steps yield ~1 token for a draft + verify's cost: plain steps measure faster and win
    assert info["spec_plain_steps"] > info["spec_verify_ct"] > 0
    assert info["spec_batch_policy"]["1 greedy"]["winner"] == "plain"


def test_the_environment_can_turn_auto_off_off(target, tmp_path, monkeypatch):
    """SPECSERVE_DISABLE_SPECULATIVE_AUTO_OFF=1 (for launch commands kept as written) acts as
    --disable-speculative-auto-off: a random head's drafts never land, yet every step speculates."""
    head = make_eagle_head_dir(str(tmp_path / "random"), target, kind="random")
    monkeypatch.setenv("SPECSERVE_DISABLE_SPECULATIVE_AUTO_OFF", "1")
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE", head, 5, 4, 8)) as e:
        out = e.generate(PROMPTS[0], greedy(40))
        info = e.get_server_info()
    # ~1 token a step, each step a verify but the last (one token left: a plain step, fit_to_remaining)
    assert info["spec_plain_steps"] <= 1 and out["meta_info"]["spec_verify_ct"] >= 38, (info, out["meta_info"])


def test_the_drafters_catch_up_on_plain_steps_is_timed_with_the_next_speculative_step(target, drafts, monkeypatch):
    """The backlog's replay is a cost of speculating: the batch policy sees it in the speculative step it precedes."""
    from specserve.scheduler.spec_decode import SpecDecoder
    from specserve.speculative.batch_policy import BatchPolicy

    flush, record, flushed, recorded = SpecDecoder.flush_backlog, BatchPolicy.record, [], []

    def slow_flush(self, reqs):
        if any(r.spec_backlog is not None for r in reqs):
            time.sleep(0.2)  # stands for a long replay
            flushed.append(len(reqs))
        flush(self, reqs)

    def spy(self, batch, speculative, seconds, tokens, compiled=False, kind="greedy"):
        recorded.append((speculative, seconds))
        record(self, batch, speculative, seconds, tokens, compiled, kind)

    monkeypatch.setattr(SpecDecoder, "flush_backlog", slow_flush)
    monkeypatch.setattr(BatchPolicy, "record", spy)
    kw = spec_kwargs("EAGLE", drafts["EAGLE"], 3, 2, 5, **POLICY)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        staggered(e, PROMPTS[:6], [greedy(n) for n in LENGTHS], LATE, greedy(24))
    assert flushed  # plain steps (batch above 4), then speculative ones with a backlog to replay
    assert sum(1 for spec, secs in recorded if spec and secs >= 0.2) == len(flushed)
    assert not any(secs >= 0.2 for spec, secs in recorded if not spec)


# --------------------------------------------------------------------------- trees fitted to the tokens left
NO_SHRINK = dict(speculative_batch_token_budget=0, disable_speculative_auto_off=True)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
def test_no_node_deeper_than_a_request_can_emit(target, drafts, algorithm, monkeypatch):
    """A request with R new tokens left verifies no node deeper than R - 1, next to a batch mate with many left
    whose tree goes deeper; outputs equal plain decoding."""
    from specserve.scheduler.spec_decode import SpecDecoder

    verify, steps = SpecDecoder._verify_forward, []

    def spy(self, reqs, tree, *args):
        depth = tree.depth.masked_fill(~tree.valid, 0).max(dim=1).values.tolist()
        steps.append([(r.remaining_new_tokens(), d) for r, d in zip(reqs, depth, strict=True)])
        return verify(self, reqs, tree, *args)

    monkeypatch.setattr(SpecDecoder, "_verify_forward", spy)
    lengths = [3, 5, 30]
    with Engine(model_path=target, max_total_tokens=4096) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS[:3], [greedy(n) for n in lengths])]
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs(algorithm, drafts[algorithm], 3, 1, 4,
                                                                        **NO_SHRINK)) as e:
        outs = e.generate(PROMPTS[:3], [greedy(n) for n in lengths])
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in outs] == want
    assert steps and all(depth <= left - 1 for step in steps for left, depth in step)
    if algorithm != "NGRAM":  # a model draft fills every chain to depth 3: the short requests' chains were cut
        assert any(max(d for _, d in step) == 3 and any(d == left - 1 < 3 for left, d in step) for step in steps)


def test_a_step_that_can_emit_one_token_is_plain(target, drafts):
    """One new token left to every request: the step drafts nothing (a plain step makes the same token); with more
    left to some request the tree keeps only the levels it can use."""
    kw = spec_kwargs("EAGLE", drafts["EAGLE"], 3, 2, 5, **NO_SHRINK)
    with Engine(model_path=target, max_total_tokens=4096) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS[:4], greedy(2))] + [e.generate(PROMPTS[4], greedy(3))
                                                                                 ["output_ids"]]
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        two = e.generate(PROMPTS[:4], greedy(2))  # prefill makes one token, one decode step is left
        info = e.get_server_info()
        three = e.generate(PROMPTS[4], greedy(3))  # one decode step with two tokens left: a single draft level
        after = e.get_server_info()
    assert [o["output_ids"] for o in two] + [three["output_ids"]] == want
    assert info["spec_verify_ct"] == 0 and info["spec_plain_steps"] == 1
    assert all(o["meta_info"]["spec_plain_tokens"] == 1 for o in two)
    assert after["spec_verify_ct"] == 1 and after["spec_shrunk_steps"] == 1
    assert three["meta_info"]["completion_tokens"] == 3 and three["meta_info"]["spec_verify_ct"] == 1

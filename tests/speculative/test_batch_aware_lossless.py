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

"""When the scheduler sends a request's tokens: a streamed request every --stream-interval tokens (its first token at
once), a non-streaming one at its first token and at its finish. Whatever the grouping, the caller gets the same
ids, logprobs and text, and an abort still delivers every token generated before it."""

from __future__ import annotations

import threading
import time

import pytest

from specserve import Engine
from specserve.config import ConfigError, ServerArgs
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy


def record_outputs(engine: Engine, monkeypatch) -> dict[str, list]:
    """rid -> the ReqOutputs the scheduler loop delivered for it, in order."""
    seen: dict[str, list] = {}
    original = engine.loop._dispatch

    def dispatch(outputs):
        for out in outputs:
            seen.setdefault(out.rid, []).append(out)
        original(outputs)

    monkeypatch.setattr(engine.loop, "_dispatch", dispatch)
    return seen


@pytest.fixture(scope="module")
def target(model_factory):
    return model_factory("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engine(target):
    e = Engine(model_path=target, max_total_tokens=4096)
    yield e
    e.shutdown()


def test_non_streaming_requests_get_two_outputs_and_the_same_result(engine, monkeypatch):
    seen = record_outputs(engine, monkeypatch)
    params = [greedy(20, stop=["never-emitted"]), greedy(7), greedy(1)]
    outs = engine.generate(PROMPTS[:3], params, return_logprob=True, top_logprobs_num=2, rid=["a", "b", "c"])
    sizes = {rid: [len(o.new_token_ids) for o in seen[rid]] for rid in ("a", "b", "c")}
    assert sizes == {"a": [1, 19], "b": [1, 6], "c": [1]}  # the first token at once, the rest at the finish
    for rid, out, p in zip("abc", outs, params, strict=True):
        assert seen[rid][-1].finished_reason is not None
        assert sum((o.new_token_ids for o in seen[rid]), []) == out["output_ids"]
        assert len(out["meta_info"]["output_token_logprobs"]) == p["max_new_tokens"]
        streamed = list(engine.generate(PROMPTS["abc".index(rid)], p, return_logprob=True, top_logprobs_num=2,
                                         stream=True))
        assert len(streamed) == p["max_new_tokens"]  # interval 1: one chunk per token
        assert sum((c["output_ids"] for c in streamed), []) == out["output_ids"]
        assert "".join(c["text"] for c in streamed) == out["text"]
        lps = sum((c["meta_info"]["output_token_logprobs"] for c in streamed), [])
        want = out["meta_info"]["output_token_logprobs"]  # alone vs in a batch of 3: fp32 rounding may differ
        assert [t for _, t, _ in lps] == [t for _, t, _ in want]
        assert [lp for lp, _, _ in lps] == pytest.approx([lp for lp, _, _ in want], abs=1e-4)
        tops = sum((c["meta_info"]["output_top_logprobs"] for c in streamed), [])
        assert [[t for _, t, _ in row] for row in tops] == \
            [[t for _, t, _ in row] for row in out["meta_info"]["output_top_logprobs"]]


def test_stream_interval_groups_streamed_tokens(target):
    with Engine(model_path=target, max_total_tokens=4096, stream_interval=4) as e:
        for extra in ({}, {"stop": ["never-emitted"]}):  # detokenized by the caller / by the scheduler
            whole = e.generate(PROMPTS[4], greedy(18, **extra))
            chunks = list(e.generate(PROMPTS[4], greedy(18, **extra), stream=True))
            assert [len(c["output_ids"]) for c in chunks] == [1, 4, 4, 4, 4, 1]
            assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
            assert "".join(c["text"] for c in chunks) == whole["text"]
        assert_no_kv_leak(e)


def test_an_abort_delivers_the_tokens_not_sent_yet(engine):
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(engine.generate(PROMPTS[5], greedy(400), rid="slow")))
    worker.start()

    def generated(s):
        return next((len(r.output_ids) for r in s.running if r.rid == "slow"), 0)

    deadline = time.monotonic() + 60
    while engine.loop.call(generated) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.abort_request("slow")
    worker.join(timeout=60)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) == result["meta_info"]["completion_tokens"] >= 5
    assert result["output_ids"] == engine.generate(PROMPTS[5], greedy(len(result["output_ids"])))["output_ids"]
    assert_no_kv_leak(engine)


@pytest.mark.parametrize("value", [0, -2])
def test_stream_interval_must_be_positive(target, value):
    with pytest.raises(ConfigError, match=rf"^--stream-interval must be a positive integer, got {value}"):
        ServerArgs(model_path=target, stream_interval=value).validate()

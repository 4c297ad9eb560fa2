"""Every model-based proposer under mixed work: a stream dropped mid-generation (abort), memory pressure
(retraction), stop strings, seeded sampling and greedy requests together; afterwards every KV slot is free or in
the prefix cache (the drafters' scratch and held slots included)."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import spec_kwargs


@pytest.fixture(scope="module")
def target(model_factory):
    return model_factory("llama", num_hidden_layers=4, unit_embeddings=True, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafts")
    return {
        "EAGLE": make_eagle_head_dir(str(d / "eagle"), target, kind="random"),
        "EAGLE3": make_eagle3_head_dir(str(d / "eagle3"), target, kind="random"),
        "STANDALONE": target,
        "NGRAM": None,
    }


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
def test_mixed_work_leaves_no_leak(target, drafts, algorithm):
    kw = spec_kwargs(algorithm, drafts[algorithm], 3, 2, 5, disable_speculative_auto_off=True)  # every step
    sampled = {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 24, "seed": 7, "ignore_eos": True}
    with Engine(model_path=target, max_total_tokens=150, chunked_prefill_size=8, **kw) as e:
        stream = e.generate(PROMPTS[0], greedy(60), stream=True)
        next(stream)
        next(stream)
        stream.close()  # the consumer leaves mid-generation: the request is aborted
        params = [greedy(24), greedy(24, stop=["e"]), sampled] + [greedy(20)] * 5
        outs = e.generate(PROMPTS, params)
        assert len(outs) == 8 and all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
        assert e.get_server_info()["num_retractions"] > 0
        assert_no_kv_leak(e)

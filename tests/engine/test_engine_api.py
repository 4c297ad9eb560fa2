"""The offline Engine API: sampling, stop handling, streaming, async, abort, logprobs, errors, no KV leak."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from specserve import Engine
from specserve.frontend import RequestError
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy


@pytest.fixture(scope="module")
def engine(model_factory):
    e = Engine(model_path=model_factory("llama", max_position_embeddings=1024), max_total_tokens=4096)
    yield e
    e.shutdown()


def sampled(seed=None, n_tokens=24, **extra):
    p = {"temperature": 1.0, "max_new_tokens": n_tokens, "ignore_eos": True, **extra}
    if seed is not None:
        p["seed"] = seed
    return p


# ---------------------------------------------------------------- seeded sampling
def test_seeded_sampling_reproducible_across_runs_and_batch_mates(engine):
    alone = engine.generate(PROMPTS[0], sampled(seed=7))["output_ids"]
    again = engine.generate(PROMPTS[0], sampled(seed=7))["output_ids"]
    in_batch = engine.generate(
        [PROMPTS[3], PROMPTS[0], PROMPTS[5]], [sampled(seed=1), sampled(seed=7), greedy(30)]
    )[1]["output_ids"]
    assert alone == again == in_batch
    other_seed = engine.generate(PROMPTS[0], sampled(seed=8))["output_ids"]
    assert other_seed != alone


def test_unseeded_requests_differ(engine):
    a = engine.generate(PROMPTS[1], sampled())["output_ids"]
    b = engine.generate(PROMPTS[1], sampled())["output_ids"]
    assert a != b


# ---------------------------------------------------------------- what penalties / filters do
def _counts(engine, params, n=24):
    outs = engine.generate([PROMPTS[3]] * n, [dict(params, seed=i) for i in range(n)])
    return [o["output_ids"] for o in outs]


def test_logit_bias_forces_and_bans(engine):
    forced = engine.generate(PROMPTS[0], sampled(seed=3, logit_bias={"42": 100.0}))["output_ids"]
    assert set(forced) == {42}
    free = engine.generate(PROMPTS[0], greedy(24))["output_ids"]
    banned_tok = free[0]
    banned = engine.generate(PROMPTS[0], greedy(24, logit_bias={str(banned_tok): -100.0}))["output_ids"]
    assert banned_tok not in banned


def test_penalties_reduce_repetition(engine):
    def distinct(params):
        return sum(len(set(o)) for o in _counts(engine, params, n=8))

    base = distinct(sampled(temperature=0.7))
    assert distinct(sampled(temperature=0.7, frequency_penalty=2.0)) > base
    assert distinct(sampled(temperature=0.7, presence_penalty=2.0)) > base
    assert distinct(sampled(temperature=0.7, repetition_penalty=2.0)) > base


def test_top_k_1_is_greedy_and_filters_never_emit_masked_tokens(engine, model_factory):
    g = engine.generate(PROMPTS[2], greedy(16))["output_ids"]
    assert engine.generate(PROMPTS[2], sampled(seed=5, n_tokens=16, top_k=1))["output_ids"] == g
    # min_p = 1.0 keeps only the most likely token: equals greedy too
    assert engine.generate(PROMPTS[2], sampled(seed=5, n_tokens=16, min_p=1.0))["output_ids"] == g
    # top_p tiny keeps only the top token
    assert engine.generate(PROMPTS[2], sampled(seed=5, n_tokens=16, top_p=1e-6))["output_ids"] == g
    # top_k=3: every sampled token is among the 3 most likely at its step (checked via logprobs)
    out = engine.generate(PROMPTS[2], sampled(seed=9, n_tokens=16, top_k=3), return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    for (_, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert tok in [t for _, t, _ in top]


# ---------------------------------------------------------------- finishing
def test_stop_token_ids_and_eos(engine):
    free = engine.generate(PROMPTS[0], greedy(24))["output_ids"]
    stop_tok = free[5]
    out = engine.generate(PROMPTS[0], greedy(24, stop_token_ids=[stop_tok]))
    first = free.index(stop_tok)
    assert out["output_ids"] == free[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert engine.generate(PROMPTS[0], greedy(7))["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


def test_matched_stop_token_text_is_trimmed(engine):
    """SGLang's rule: a matched stop token stays in output_ids, its text is not in the text (even with
    skip_special_tokens false, with or without stop strings), unless no_stop_trim."""
    free = engine.generate(PROMPTS[0], greedy(24))["output_ids"]
    stop_tok = free[5]
    first = free.index(stop_tok)
    tok = engine.tokenizer
    for extra in ({}, {"stop": ["never-in-this-text"]}):
        params = greedy(24, stop_token_ids=[stop_tok], skip_special_tokens=False, **extra)
        out = engine.generate(PROMPTS[0], params)
        assert out["output_ids"][-1] == stop_tok
        assert out["text"] == tok.decode(free[:first], skip_special_tokens=False)
        kept = engine.generate(PROMPTS[0], dict(params, no_stop_trim=True))
        assert kept["text"] == tok.decode(free[: first + 1], skip_special_tokens=False)


def test_stop_string_spanning_tokens_is_trimmed(engine):
    full = engine.generate(PROMPTS[4], greedy(24))
    text = full["text"]
    stop = text[6:10]  # 4 characters from inside the output, likely across a token boundary
    out = engine.generate(PROMPTS[4], greedy(24, stop=[stop]))
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate(PROMPTS[4], greedy(24, stop=[stop], no_stop_trim=True))
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    streamed = "".join(c["text"] for c in engine.generate(PROMPTS[4], greedy(24, stop=[stop]), stream=True))
    assert streamed == out["text"]


def test_min_new_tokens_blocks_early_stop(engine):
    free = engine.generate(PROMPTS[0], greedy(24))["output_ids"]
    stop_tok = free[1]
    out = engine.generate(PROMPTS[0], greedy(24, stop_token_ids=[stop_tok], min_new_tokens=10))
    assert len(out["output_ids"]) >= 10


# ---------------------------------------------------------------- streaming, async, n, logprobs
def test_stream_equals_non_stream(engine):
    full = engine.generate(PROMPTS[6], greedy(20))
    chunks = list(engine.generate(PROMPTS[6], greedy(20), stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert [c["meta_info"]["finish_reason"] is not None for c in chunks].count(True) == 1
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def test_async_generate_and_async_stream(engine):
    full = engine.generate(PROMPTS[1], greedy(12))

    async def run():
        single = await engine.async_generate(PROMPTS[1], greedy(12))
        batch = await asyncio.gather(*[engine.async_generate(p, greedy(12)) for p in PROMPTS[:4]])
        gen = await engine.async_generate(PROMPTS[1], greedy(12), stream=True)
        text = "".join([c["text"] async for c in gen])
        return single, batch, text

    single, batch, text = asyncio.run(run())
    assert single["output_ids"] == full["output_ids"] == batch[1]["output_ids"]
    assert text == full["text"]


def test_n_samples(engine):
    outs = engine.generate(PROMPTS[0], sampled(seed=11, n=3))
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    assert outs[2]["output_ids"] == engine.generate(PROMPTS[0], sampled(seed=13))["output_ids"]  # sample i: seed+i


def test_logprobs_consistent(engine):
    out = engine.generate(PROMPTS[0], greedy(8), return_logprob=True, top_logprobs_num=4)
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(top) == 4 and top[0][1] == tok and math.isclose(top[0][0], lp, abs_tol=1e-5)  # greedy = top-1
        assert all(top[i][0] >= top[i + 1][0] for i in range(3)) and lp <= 0


def test_sglang_generate_arguments(engine):
    """SGLang's Engine.generate arguments: the logprob ones work (prompt logprobs, probes, text), the ones
    specserve does not honour pass at their off value and are refused otherwise; get_server_info has SGLang's
    internal_states."""
    out = engine.generate(PROMPTS[0], greedy(4), return_logprob=True, logprob_start_len=0, token_ids_logprob=[3, 5],
                          return_text_in_logprobs=True, lora_path=None, custom_logit_processor=None)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] and meta["input_token_logprobs"][0][0] is None
    assert [e[1] for e in meta["output_token_ids_logprobs"][0]] == [3, 5]
    assert all(text == engine.tokenizer.decode([t]) for _, t, text in meta["output_token_logprobs"])
    with pytest.raises(ValueError, match="lora_path"):
        engine.generate(PROMPTS[0], greedy(4), lora_path="adapter")
    with pytest.raises(TypeError, match="no_such_argument"):
        engine.generate(PROMPTS[0], greedy(4), no_such_argument=1)
    info = engine.get_server_info()
    assert info["internal_states"][0]["max_total_num_tokens"] == info["max_total_num_tokens"] > 0


# ---------------------------------------------------------------- abort and leaks
def test_abort_running_and_waiting_requests_free_everything(model_factory):
    path = model_factory("llama", max_position_embeddings=1024)
    with Engine(model_path=path, max_total_tokens=2048, max_running_requests=1) as e:
        results = {}

        def run(rid):
            results[rid] = e.generate(PROMPTS[0], greedy(400), rid=rid)

        def wait_for(key: str) -> None:
            deadline = time.time() + 30
            while e.get_server_info()[key] == 0 and time.time() < deadline:
                time.sleep(0.01)

        threads = [threading.Thread(target=run, args=(r,)) for r in ("a", "b")]
        threads[0].start()
        wait_for("num_running_reqs")  # "a" runs first ...
        threads[1].start()
        wait_for("num_waiting_reqs")  # ... and "b" waits behind it (only one may run)
        e.abort_request("b")  # waiting
        e.abort_request("a")  # running
        for t in threads:
            t.join(timeout=60)
        assert results["a"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert results["b"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert results["b"]["output_ids"] == []
        assert_no_kv_leak(e)


def test_no_leak_after_mixed_work(model_factory):
    """finish + abort (stream closed early) + retraction + stop strings, then every slot is accounted for."""
    path = model_factory("llama", max_position_embeddings=1024)
    with Engine(model_path=path, max_total_tokens=160, chunked_prefill_size=8) as e:
        stream = e.generate(PROMPTS[0], greedy(60), stream=True)
        next(stream)
        stream.close()  # consumer leaves: the request is aborted
        outs = e.generate(PROMPTS, [greedy(24), greedy(24, stop=["e"]), sampled(seed=1)] + [greedy(20)] * 5)
        assert len(outs) == 8
        assert e.scheduler.stats.num_retractions > 0
        assert_no_kv_leak(e)


@pytest.mark.parametrize("chunk", [-1, 8])  # whole prompts / chunked prefill (the request is also `chunked`)
def test_failing_prefill_aborts_its_requests_and_the_engine_keeps_serving(model_factory, monkeypatch, chunk):
    """A prefill forward that raises ends the requests in it with an abort (while it runs they are in no queue, so
    nothing else would answer their callers), gives back their KV, and later requests are served as before."""
    path = model_factory("llama", max_position_embeddings=1024)
    with Engine(model_path=path, max_total_tokens=2048, chunked_prefill_size=chunk) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS[:3], greedy(8))]
        e.flush_cache()
        runner, real_forward = e.scheduler.runner, e.scheduler.runner.forward
        failures = []

        def forward(fb):
            if fb.mode.value == "extend" and not failures:
                failures.append(fb.mode)
                raise RuntimeError("injected prefill failure")
            return real_forward(fb)

        monkeypatch.setattr(runner, "forward", forward)
        outs = e.generate(PROMPTS[:3], greedy(8))
        assert failures
        aborted = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"]
        assert aborted and all("injected prefill failure" in o["meta_info"]["finish_reason"]["message"]
                               for o in aborted)
        assert_no_kv_leak(e)
        assert [o["output_ids"] for o in e.generate(PROMPTS[:3], greedy(8))] == want
        assert_no_kv_leak(e)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("params,field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"top_k": -5}, "top_k"), ({"bogus": 1}, "bogus"), ({"max_new_tokens": 10**6}, "max_new_tokens"),
])
def test_bad_params_raise_value_error_naming_the_field(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(PROMPTS[0], params)


def test_bad_prompts(engine):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 2, 10**6])
    with pytest.raises(RequestError, match="empty"):
        engine.generate(input_ids=[])
    with pytest.raises(RequestError, match="context length"):
        engine.generate(input_ids=[5] * 2000)
    # the engine still serves after rejecting bad requests
    assert engine.generate(PROMPTS[0], greedy(4))["meta_info"]["completion_tokens"] == 4


def test_server_args_errors_name_the_flag(model_factory):
    from specserve.config import ConfigError

    path = model_factory("llama")
    with pytest.raises(ConfigError, match="--schedule-policy"):
        Engine(model_path=path, schedule_policy="random")
    with pytest.raises(ConfigError, match="--mem-fraction-static"):
        Engine(model_path=path, mem_fraction_static=1.5)
    with pytest.raises(ConfigError, match="unknown server argument"):
        Engine(model_path=path, not_a_flag=1)


@pytest.mark.parametrize("algorithm", ["STANDALONE", "NGRAM"])
def test_kv_capacity_pays_for_the_draft(model_factory, algorithm):
    """With speculation the memory budget also pays the draft model's weights, and a slot costs the draft's KV
    too (its pool has a slot per target slot); the figures match what the drafter then allocates. NGRAM has no
    draft model."""
    path, draft = model_factory("llama"), model_factory("llama", num_hidden_layers=1, seed=5)
    kw = dict(speculative_algorithm=algorithm, speculative_num_steps=3, speculative_eagle_topk=1,
              speculative_num_draft_tokens=4)
    if algorithm == "STANDALONE":
        kw["speculative_draft_model_path"] = draft
    with Engine(model_path=path, mem_fraction_static=0.5, cpu_memory_budget_gb=0.01, **kw) as e:
        runner, proposer = e.scheduler.runner, e.scheduler.decoder.proposer
        spec = runner.spec
        target_per_tok = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
        if algorithm == "NGRAM":
            draft_w = draft_per_tok = 0
        else:
            draft_w = sum(p.numel() * p.element_size() for p in proposer.head.parameters())
            pool = proposer.kv_pool
            draft_per_tok = sum(t.numel() * t.element_size() for t in pool.k + pool.v) // (pool.num_slots + 1)
        assert runner.draft_memory.weight_bytes == draft_w and runner.draft_memory.kv_bytes_per_token == draft_per_tok
        expected = (int(0.01 * 2**30 * 0.5) - runner.weight_bytes() - draft_w) // (target_per_tok + draft_per_tok)
        assert runner.max_total_tokens == min(expected, runner.max_running_requests * runner.context_len + 1)
        if algorithm == "STANDALONE":
            assert 0 < draft_w and 0 < draft_per_tok < target_per_tok


def test_kv_capacity_from_mem_fraction(model_factory):
    path = model_factory("llama")
    with Engine(model_path=path, mem_fraction_static=0.5, cpu_memory_budget_gb=0.01) as e:
        runner = e.scheduler.runner
        per_tok = 2 * runner.spec.num_layers * runner.spec.num_kv_heads * runner.spec.head_dim * 4
        expected = (int(0.01 * 2**30 * 0.5) - runner.weight_bytes()) // per_tok
        assert runner.max_total_tokens == min(expected, runner.max_running_requests * runner.context_len + 1)
        assert torch.equal(e.scheduler.kv.allocator.free_slots_sorted(), torch.arange(1, runner.max_total_tokens + 1))

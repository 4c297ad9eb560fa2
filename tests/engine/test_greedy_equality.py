"""Greedy output: equal to transformers, and invariant to batching, chunked prefill, radix reuse, retraction."""

from __future__ import annotations

import pytest

from specserve import Engine
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy, hf_greedy


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def solo(path):
    """Each prompt's greedy output, generated alone (batch of one, no cache reuse, no chunking)."""
    with Engine(model_path=path, max_total_tokens=4096, disable_radix_cache=True) as e:
        return [e.generate(p, greedy(24))["output_ids"] for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_generate(model_factory, arch):
    path = model_factory(arch)
    with Engine(model_path=path, max_total_tokens=2048) as e:
        for prompt in PROMPTS[:4]:
            ids = e.tokenizer.encode(prompt)
            ours = e.generate(input_ids=ids, sampling_params=greedy(20))["output_ids"]
            assert ours == hf_greedy(path, ids, 20), prompt


def test_batch_of_8_mixed_lengths_equals_solo(path, solo):
    with Engine(model_path=path, max_total_tokens=4096, disable_radix_cache=True) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == solo
        assert_no_kv_leak(e)


def test_chunked_prefill_size_4_equals_solo(path, solo):
    with Engine(model_path=path, max_total_tokens=4096, chunked_prefill_size=4) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == solo
        assert e.scheduler.stats.num_prefill_steps > len(PROMPTS)  # prompts really were split
        assert_no_kv_leak(e)


def test_radix_reuse_reports_cached_tokens_and_same_output(path, solo):
    with Engine(model_path=path, max_total_tokens=4096) as e:
        first = e.generate(PROMPTS[4], greedy(24))
        again = e.generate(PROMPTS[4], greedy(24))
        assert first["meta_info"]["cached_tokens"] == 0
        assert again["meta_info"]["cached_tokens"] > 0
        assert first["output_ids"] == again["output_ids"] == solo[4]
        # a different continuation of a shared prefix: reuses the prefix, output as if alone
        shared = e.generate(PROMPTS[4] + " the", greedy(24))
        assert shared["meta_info"]["cached_tokens"] > 0
        assert_no_kv_leak(e)


def test_lpm_policy_same_outputs(path, solo):
    with Engine(model_path=path, max_total_tokens=4096, schedule_policy="lpm", max_running_requests=3) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == solo
        assert_no_kv_leak(e)


@pytest.mark.parametrize("radix", [True, False])
def test_retraction_under_a_small_pool_keeps_outputs(path, solo, radix):
    with Engine(model_path=path, max_total_tokens=160, disable_radix_cache=not radix, chunked_prefill_size=16) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert e.scheduler.stats.num_retractions > 0, "the pool was meant to force retraction"
        assert [o["output_ids"] for o in outs] == solo
        assert all(o["meta_info"]["completion_tokens"] == 24 for o in outs)
        assert_no_kv_leak(e)


def test_max_running_requests_limits_concurrency(path, solo):
    with Engine(model_path=path, max_total_tokens=4096, max_running_requests=2) as e:
        seen = []
        orig = e.scheduler._run_decode

        def spy():
            seen.append(len(e.scheduler.running))
            return orig()

        e.scheduler._run_decode = spy
        outs = e.generate(PROMPTS, greedy(24))
        assert max(seen) == 2
        assert [o["output_ids"] for o in outs] == solo


def test_context_length_above_config_positions(model_factory):
    path = model_factory("llama", max_position_embeddings=64)
    with Engine(model_path=path, max_total_tokens=1024, context_length=200) as e:
        out = e.generate(input_ids=list(range(10, 70)), sampling_params=greedy(100))
        assert out["meta_info"]["completion_tokens"] == 100


def test_request_joins_while_another_decodes(path, solo):
    """Continuous batching: a short request submitted mid-generation of a long one finishes first."""
    import threading
    import time

    with Engine(model_path=path, max_total_tokens=4096, disable_radix_cache=True) as e:
        long_out, done_order = {}, []

        def long_request():
            long_out["r"] = e.generate(PROMPTS[0], greedy(300))
            done_order.append("long")

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.time() + 30
        while e.get_server_info()["generated_tokens"] < 5 and time.time() < deadline:
            time.sleep(0.005)
        short = e.generate(PROMPTS[1], greedy(24))
        done_order.append("short")
        t.join(timeout=120)
        assert done_order == ["short", "long"]
        assert short["output_ids"] == solo[1]
        assert long_out["r"]["output_ids"][:24] == solo[0]


STAGGERED = [24, 10, 17, 24, 6, 13, 20, 8]  # max_new_tokens per prompt: requests finish, others join mid-decode


@pytest.mark.parametrize("chunk", [4, 2048])
def test_mixed_chunk_equals_solo(path, solo, chunk):
    """--enable-mixed-chunk: the running requests decode in the forward of a joining request's prefill chunk;
    outputs equal each prompt's solo run, and mixed steps really ran."""
    with Engine(model_path=path, max_total_tokens=4096, enable_mixed_chunk=True, max_running_requests=3,
                chunked_prefill_size=chunk, disable_radix_cache=True) as e:
        outs = e.generate(PROMPTS, [greedy(n) for n in STAGGERED])
        assert [o["output_ids"] for o in outs] == [s[:n] for s, n in zip(solo, STAGGERED, strict=True)]
        info = e.get_server_info()
        assert info["num_mixed_steps"] > 0, "no prefill ran beside a decode"
        if chunk == 4:
            assert info["num_mixed_steps"] > len(PROMPTS)  # chunks of one prompt mixed step after step
        assert_no_kv_leak(e)


@pytest.mark.parametrize("radix", [True, False])
def test_mixed_chunk_with_retraction(path, solo, radix):
    """A pool too small for all prompts: retracted requests come back as prefills beside the running ones."""
    with Engine(model_path=path, max_total_tokens=100, enable_mixed_chunk=True, chunked_prefill_size=16,
                disable_radix_cache=not radix) as e:
        outs = e.generate(PROMPTS, [greedy(n) for n in STAGGERED])
        assert [o["output_ids"] for o in outs] == [s[:n] for s, n in zip(solo, STAGGERED, strict=True)]
        assert e.scheduler.stats.num_mixed_steps > 0 and e.scheduler.stats.num_retractions > 0
        assert_no_kv_leak(e)


def test_mixed_chunk_seeded_sampling_equals_unmixed(path):
    params = [{"temperature": 1.0, "top_p": 0.9, "seed": 100 + i, "max_new_tokens": n} for i, n in enumerate(STAGGERED)]
    runs = []
    for mixed in (False, True):
        with Engine(model_path=path, max_total_tokens=4096, enable_mixed_chunk=mixed, max_running_requests=3) as e:
            runs.append([o["output_ids"] for o in e.generate(PROMPTS, params)])
            assert (e.scheduler.stats.num_mixed_steps > 0) is mixed
    assert runs[0] == runs[1]


@pytest.mark.parametrize("mixed", [False, True])
def test_prefill_attended_request_by_request_equals_solo(path, solo, monkeypatch, mixed):
    """Prefill batches attended one request at a time (the split forced on every batch): outputs equal each
    prompt's solo run, first without cached prefixes, then again with them (radix hits: chunks after a prefix),
    and with --enable-mixed-chunk (split prefill groups beside decode rows). The split really ran."""
    from specserve.attention import sdpa as backend

    monkeypatch.setattr(backend, "MIN_PADDING_PER_REQUEST", 0)
    splits = []
    real = backend.per_request_metadata
    monkeypatch.setattr(backend, "per_request_metadata", lambda *a: splits.append(len(a[1])) or real(*a))
    with Engine(model_path=path, max_total_tokens=4096, enable_mixed_chunk=mixed, max_running_requests=4) as e:
        for _ in range(2):
            outs = e.generate(PROMPTS, [greedy(n) for n in STAGGERED])
            assert [o["output_ids"] for o in outs] == [s[:n] for s, n in zip(solo, STAGGERED, strict=True)]
        assert outs[4]["meta_info"]["cached_tokens"] > 0
        assert max(splits) > 1, "no prefill batch of several requests was split"
        if mixed:
            assert e.scheduler.stats.num_mixed_steps > 0
        assert_no_kv_leak(e)

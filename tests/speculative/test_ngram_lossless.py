"""NGRAM: the lossless gate (greedy output with speculation == without) on prompts with repetition, with the
vacuity guard; sampling through the same lossless path; the force-greedy switch; no-match behaviour."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve import Engine
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_chunked_radix_and_retraction_lossless, assert_drafting_happened

REPETITIVE = [
    "def f(x):\n    return x\ndef f(x):\n    return x\ndef f(",
    "a b c d e f a b c d e f a b c",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
    "x = 1\ny = 2\nx = 1\ny = 2\nx =",
] + PROMPTS[:4]
# every step speculates: on this tiny target a verify step costs several plain ones, so the batch policy would run
# plain steps, and the gate needs drafts to judge
NGRAM = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8, "disable_speculative_auto_off": True}


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=8192) as e:
        return [o["output_ids"] for o in e.generate(REPETITIVE, greedy(48))]


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_greedy_batch_of_8_equals_plain(target, plain, match_type):
    with Engine(model_path=target, max_total_tokens=8192, speculative_ngram_match_type=match_type, **NGRAM) as e:
        outs = e.generate(REPETITIVE, greedy(48))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=1.3)
        assert_no_kv_leak(e)


def test_greedy_batch_of_1_equals_plain(target, plain):
    with Engine(model_path=target, max_total_tokens=8192, **NGRAM) as e:
        outs = [e.generate(p, greedy(48)) for p in REPETITIVE[:2]]
    assert [o["output_ids"] for o in outs] == plain[:2]
    assert_drafting_happened(outs)


def test_chunked_prefill_radix_reuse_retraction(target, plain):
    assert_chunked_radix_and_retraction_lossless(target, NGRAM, REPETITIVE, greedy(48), plain,
                                                 retraction_tokens=260)


def test_sampling_top_k_1_is_greedy_and_seeded_runs_repeat(target, plain):
    """Sampled verification: top_k=1 must give the greedy output. Seeded runs repeat on a fresh engine with the
    same workload."""
    sp = {"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True, "seed": 99}
    runs = []
    for _ in range(2):
        with Engine(model_path=target, max_total_tokens=8192, **NGRAM) as e:
            outs = e.generate(REPETITIVE, {**greedy(48), "temperature": 0.7, "top_k": 1})
            assert [o["output_ids"] for o in outs] == plain
            assert_drafting_happened(outs)
            runs.append([o["output_ids"] for o in e.generate(REPETITIVE, sp)])
    assert runs[0] == runs[1]


def test_seeded_sampling_is_the_same_alone_batched_and_without_speculation(target):
    """A seeded request samples each output position with the race noise of (seed, position), and lossless
    verification races with that noise: with NGRAM its tokens equal plain decoding's, alone or among other
    requests, although its drafts differ completely (alone on a fresh engine its sampled text matches nothing;
    afterwards the shared trie holds that text, so in the batch whole runs of it are drafted and accepted)."""
    sp = {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 40, "ignore_eos": True, "seed": 99}
    mates = [{"temperature": 0.8, "max_new_tokens": 40, "ignore_eos": True, "seed": 5 + i} for i in range(3)]
    with Engine(model_path=target, max_total_tokens=8192) as e:
        plain_ids = e.generate(REPETITIVE[1], sp)["output_ids"]
    # NGRAM always speculates (see NGRAM above): the guard below counts drafts of every step
    with Engine(model_path=target, max_total_tokens=8192, **NGRAM) as e:
        alone = e.generate(REPETITIVE[1], sp)
        batch = e.generate(REPETITIVE[:5], [mates[0], sp, *mates[1:], greedy(40)])
        assert_no_kv_leak(e)
        # the default --speculative-ngram-capacity (10M nodes) is a cap: storage holds only the nodes in use
        cache = e.scheduler.decoder.proposer.cache
        assert cache.capacity == 10_000_000 and cache.allocated_nodes == cache.num_nodes + 1 < 20_000
    assert alone["output_ids"] == batch[1]["output_ids"] == plain_ids
    assert alone["meta_info"]["spec_accept_histogram"] != batch[1]["meta_info"]["spec_accept_histogram"]
    assert_drafting_happened([batch[1]], min_accept_length=2.0)


@pytest.mark.parametrize("threshold_acc, rule", [(1.0, "race_verify"), (0.5, "verify_sampling")])
def test_sampled_rows_race_unless_thresholds_are_lossy(target, monkeypatch, threshold_acc, rule):
    """Lossless thresholds: the exponential race of each position (plain decoding's tokens); SGLang's lossy accept
    thresholds need its running-sum rule."""
    from specserve.scheduler import spec_decode

    calls = []

    def spy(name):
        real = getattr(spec_decode, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapper

    for name in ("verify_sampling", "race_verify"):
        monkeypatch.setattr(spec_decode, name, spy(name))
    with Engine(model_path=target, max_total_tokens=8192, speculative_accept_threshold_acc=threshold_acc,
                **NGRAM) as e:
        e.generate(REPETITIVE[:2], {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 1})
    assert calls and set(calls) == {rule}


def test_force_greedy_verify_env_is_lossy_argmax(target, plain, monkeypatch):
    """With the documented lossy switch, a sampled request is verified by argmax: its drafted tokens are judged
    greedily (so a temperature-1 request accepts drafts a lossless sampler would often reject)."""
    monkeypatch.setenv("SGLANG_NGRAM_FORCE_GREEDY_VERIFY", "True")
    with Engine(model_path=target, max_total_tokens=8192, **NGRAM) as e:
        assert e.scheduler.decoder.proposer.force_greedy_verify
        outs = e.generate(REPETITIVE, {"temperature": 1.0, "max_new_tokens": 48, "ignore_eos": True, "seed": 3})
    # every token after the first comes from an argmax walk + argmax bonus: the greedy continuation of token 1
    with Engine(model_path=target, max_total_tokens=8192) as e:
        for o, p in zip(outs, REPETITIVE, strict=True):
            ids = e.tokenizer.encode(p) + o["output_ids"][:1]
            assert o["output_ids"][1:] == e.generate(input_ids=ids, sampling_params=greedy(47))["output_ids"]


def test_no_match_gives_a_root_only_tree(target):
    with Engine(model_path=target, max_total_tokens=1024, **NGRAM) as e:
        proposer = e.scheduler.decoder.proposer
        proposer.cache.reset()
        req = SimpleNamespace(fill_ids=[11, 12, 13, 14], last_token=14)
        tree = proposer.propose([req])
        assert tree.num_nodes.tolist() == [1] and tree.tokens[0, 0].item() == 14
        proposer.cache.insert([5, 14, 15, 16])
        tree = proposer.propose([req])
        assert tree.num_nodes.tolist() == [3] and tree.tokens[0, 1:3].tolist() == [15, 16]

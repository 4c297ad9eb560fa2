"""Sampled requests under every speculative algorithm (EAGLE, EAGLE-3 with the target's vocabulary and with a
smaller draft vocabulary, STANDALONE, MTP, NGRAM): a seeded request's tokens are plain decoding's with its seed
(alone, in a batch of 8, with the batch policy switching modes), and the sampled distribution matches plain
decoding's at temperatures 0.3 / 0.7 / 1.0 with top_p 0.9 and with top_k 20 (two-sample chi-square, with a broken
verifier that must fail it). The drafting guard checks every speculative run accepted drafted tokens."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.scheduler import spec_decode
from specserve.speculative.accept_stats import accept_length
from specserve.speculative.verify import verify_greedy
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir, make_mimo_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, joint_counts, spec_kwargs

ALGORITHMS = ["EAGLE", "EAGLE3", "EAGLE3-d2t", "STANDALONE", "MTP", "NGRAM"]
CONFIGS = [(0.3, {"top_p": 0.9}), (0.7, {"top_k": 20}), (1.0, {"top_p": 0.9}), (1.0, {"top_k": 20}),
           (0.3, {"top_k": 20}), (0.7, {"top_p": 0.9})]
N = 300  # seeded requests per run of the distribution test
PROMPT = PROMPTS[3]
ALWAYS = {"speculative_batch_token_budget": 0, "disable_speculative_auto_off": True}  # a tree at every step


@pytest.fixture(scope="module")
def target(model_factory):
    """A one-layer bigram-like target that the EAGLE and EAGLE-3 "self" heads both mirror."""
    return model_factory("llama", num_hidden_layers=1, unit_embeddings=True, identity_layers=True,
                         max_position_embeddings=1024)


@pytest.fixture(scope="module")
def mimo(tmp_path_factory, tokenizer_dir):
    """A MiMo target whose MTP layer mirrors it (MTP drafts from the target's own layer)."""
    return make_mimo_dir(str(tmp_path_factory.mktemp("mimo")), kind="self", tokenizer_dir=tokenizer_dir,
                         max_position_embeddings=1024)


@pytest.fixture(scope="module")
def setups(target, mimo, tmp_path_factory):
    """algorithm -> (target folder, engine flags)."""
    import json
    import os

    root = tmp_path_factory.mktemp("sampled")
    with open(os.path.join(target, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    half = make_eagle3_head_dir(str(root / "eagle3-d2t"), target, kind="self", draft_vocab=list(range(0, vocab, 2)))
    return {
        "EAGLE": (target, spec_kwargs("EAGLE", make_eagle_head_dir(str(root / "eagle"), target, kind="self"), 3, 2, 5)),
        "EAGLE3": (target, spec_kwargs("EAGLE3", make_eagle3_head_dir(str(root / "eagle3"), target, kind="self"),
                                       3, 2, 5)),
        "EAGLE3-d2t": (target, spec_kwargs("EAGLE3", half, 3, 2, 5)),  # every other token id (draft -> target map)
        "STANDALONE": (target, spec_kwargs("STANDALONE", target, 3, 1, 4)),
        "MTP": (mimo, spec_kwargs("EAGLE", None, 3, 2, 5)),
        "NGRAM": (target, {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}),
    }


def sampled(seed: int, n: int = 24, temperature: float = 0.8, **extra) -> dict:
    return {"temperature": temperature, "max_new_tokens": n, "ignore_eos": True, "seed": seed, **extra}


# ---------------------------------------------------------------- reproducible seeds
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_seeded_request_gives_plain_decodings_tokens_in_every_mode(setups, algorithm):
    target, flags = setups[algorithm]
    sp = sampled(77, top_p=0.9)
    mates = [sampled(5 + i, temperature=0.6 + 0.1 * i) for i in range(4)] + [greedy(24)] * 3
    with Engine(model_path=target, max_total_tokens=8192) as e:
        plain = e.generate(PROMPTS[1], sp)["output_ids"]
        assert plain != e.generate(PROMPTS[1], {**sp, "seed": 78})["output_ids"]  # the seed matters
    with Engine(model_path=target, max_total_tokens=8192, **flags, **ALWAYS) as e:
        alone = e.generate(PROMPTS[1], sp)
        batch = e.generate([PROMPTS[0], PROMPTS[1], *PROMPTS[2:8]], [mates[0], sp, *mates[1:]])
        assert_no_kv_leak(e)
    # NGRAM's trie holds only the prompt on a fresh engine; in the batch it holds the request's own earlier text
    assert_drafting_happened([batch[1] if algorithm == "NGRAM" else alone], min_accept_length=1.2)
    with Engine(model_path=target, max_total_tokens=8192, **flags) as e:  # the batch policy decides
        policy = e.generate(PROMPTS[1], sp)["output_ids"]
    assert alone["output_ids"] == batch[1]["output_ids"] == policy == plain


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_requests_sampling_the_tempered_softmax_alone_give_plain_decodings_tokens(setups, algorithm, monkeypatch):
    """Requests without penalties, bias or filters skip the per-node processing in verification (the softmax of the
    tempered logits at every node): alone and four together, each gets plain decoding's tokens for its seed."""
    target, flags = setups[algorithm]
    params = [sampled(40 + i, n=32, temperature=0.5 + 0.2 * i) for i in range(4)]
    with Engine(model_path=target, max_total_tokens=8192) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS[:4], params)]
    shortcut = spec_decode.SpecDecoder._plain_temperatures
    taken = []

    def watched(self, reqs, grammar_ban):
        temps = shortcut(self, reqs, grammar_ban)
        taken.append(temps is not None)
        return temps

    monkeypatch.setattr(spec_decode.SpecDecoder, "_plain_temperatures", watched)
    with Engine(model_path=target, max_total_tokens=8192, **flags, **ALWAYS) as e:
        alone = e.generate(PROMPTS[0], params[0])
        together = e.generate(PROMPTS[:4], params)
    assert taken and all(taken)
    assert_drafting_happened([alone, *together], min_accept_length=1.2)
    assert alone["output_ids"] == plain[0]
    assert [o["output_ids"] for o in together] == plain


def test_auto_off_switching_mid_request_keeps_the_tokens(target, setups, monkeypatch):
    """The batch policy alternating speculative and plain steps inside one request changes nothing."""
    from specserve.speculative import batch_policy

    sp = sampled(5, n=40)
    with Engine(model_path=target, max_total_tokens=8192) as e:
        plain = e.generate(PROMPTS[2], sp)["output_ids"]
    flips = iter(range(10**6))
    real = batch_policy.BatchPolicy.choose

    def alternate(self, batch, kind="greedy", most_new=None, drafter_behind=False):
        shape = real(self, batch, kind, most_new, drafter_behind)
        return None if next(flips) % 3 == 2 else (shape or self.full)

    monkeypatch.setattr(batch_policy.BatchPolicy, "choose", alternate)
    with Engine(model_path=target, max_total_tokens=8192, **setups["EAGLE"][1]) as e:
        out = e.generate(PROMPTS[2], sp)
        info = e.get_server_info()
    assert out["output_ids"] == plain
    assert info["spec_plain_steps"] > 0 and info["spec_verify_ct"] > 0
    assert_drafting_happened([out])


# ---------------------------------------------------------------- coupled drafting
@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3-d2t", "MTP"])
def test_coupled_drafting_accepts_more_with_the_same_tokens(setups, algorithm):
    """A draft that mirrors the target, ranking a sampled request's candidates with the noise its verification
    races with, drafts the target's own race winners: nearly every level is accepted. Ranked by the draft's
    probabilities alone, a level is accepted only when the target's sample is among its top-2 children."""
    target, flags = setups[algorithm]
    params = [sampled(s, n=32, temperature=1.0) for s in range(8)]
    runs = {}
    for coupled in (True, False):
        with Engine(model_path=target, max_total_tokens=8192, **flags, **ALWAYS,
                    disable_speculative_coupled_drafting=not coupled) as e:
            runs[coupled] = e.generate(PROMPTS[:8], params)
    assert [o["output_ids"] for o in runs[True]] == [o["output_ids"] for o in runs[False]]
    coupled, uncoupled = (accept_length([o["meta_info"] for o in runs[c]]) for c in (True, False))
    # measured: EAGLE 2.78 against 1.05, MTP 3.12 against 1.04; the half vocabulary 1.73 against 1.04 (the
    # target's winner is outside the draft vocabulary half the time)
    assert coupled > uncoupled + (0.5 if algorithm == "EAGLE3-d2t" else 1.0), (coupled, uncoupled)
    assert_drafting_happened(runs[False])


# ---------------------------------------------------------------- the sampled distribution
def chi_square_pvalue(a: dict, b: dict) -> float:
    """Two-sample chi-square over the joint cells, the cells with fewer than 10 draws in both samples together
    pooled into one (so every expected count is large enough for the test)."""
    from scipy.stats import chi2_contingency

    big = sorted(c for c in set(a) | set(b) if a.get(c, 0) + b.get(c, 0) >= 10)
    rows = [[s.get(c, 0) for c in big] + [sum(v for c, v in s.items() if c not in big)] for s in (a, b)]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    if len(rows[0]) < 2:  # one cell: both samples are the same constant
        return 1.0
    return chi2_contingency(rows).pvalue


def _params(temperature: float, extra: dict, seeds: range) -> list[dict]:
    # 4 tokens: the verify step after the prefill has 3 left, so its tree keeps two levels for tokens 2-3
    return [sampled(s, n=4, temperature=temperature, **extra) for s in seeds]


@pytest.fixture(scope="module")
def plain_runs():
    """plain_runs(target) -> plain decoding per config: (outputs with seeds 0..N-1, joint cells of seeds N..2N-1),
    computed once per target."""
    cache: dict = {}

    def runs(target: str) -> dict:
        if target not in cache:
            cache[target] = {}
            with Engine(model_path=target, max_total_tokens=16384) as e:
                for i, (temp, extra) in enumerate(CONFIGS):
                    same = [o["output_ids"] for o in e.generate([PROMPT] * N, _params(temp, extra, range(N)))]
                    other = joint_counts(e.generate([PROMPT] * N, _params(temp, extra, range(N, 2 * N))))
                    cache[target][i] = (same, other)
        return cache[target]

    return runs


# 6 sigma of a normal: a correct sampler fails this about once in 500 million runs
THRESHOLD = 2e-9


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sampled_distribution_matches_plain(setups, plain_runs, algorithm):
    target, flags = setups[algorithm]
    with Engine(model_path=target, max_total_tokens=16384, **flags, **ALWAYS) as e:
        for i, (temp, extra) in enumerate(CONFIGS):
            outs = e.generate([PROMPT] * N, _params(temp, extra, range(N)))
            same, other = plain_runs(target)[i]
            p_value = chi_square_pvalue(joint_counts(outs), other)
            assert p_value > THRESHOLD, (algorithm, temp, extra, p_value)
            # and seed by seed, the very tokens of plain decoding
            assert [o["output_ids"] for o in outs] == same, (algorithm, temp, extra)
            if algorithm != "NGRAM":  # NGRAM's trie holds the prompt only: its drafts rarely match sampled text
                assert_drafting_happened(outs)


def test_a_broken_verifier_fails_the_distribution_test(target, setups, plain_runs, monkeypatch):
    """Sampled rows verified by the target's argmax instead of its race (a lossy verifier) shift the distribution
    far beyond the threshold at temperature 1."""
    monkeypatch.setattr(spec_decode, "race_node_ids", lambda depth, probs, keys: probs.argmax(dim=-1))
    monkeypatch.setattr(spec_decode, "race_verify",
                        lambda tree, probs, keys, walk=None: verify_greedy(tree, probs.argmax(dim=-1)))
    i = CONFIGS.index((1.0, {"top_k": 20}))
    with Engine(model_path=target, max_total_tokens=16384, **setups["EAGLE"][1], **ALWAYS) as e:
        outs = e.generate([PROMPT] * N, _params(*CONFIGS[i], range(N)))
    assert_drafting_happened(outs)
    assert chi_square_pvalue(joint_counts(outs), plain_runs(target)[i][1]) < THRESHOLD


def test_chi_square_pooling_by_hand():
    a = {(1, 2): 50, (1, 3): 50, (9, 9): 3}
    b = {(1, 2): 50, (1, 3): 50, (8, 8): 4}
    assert chi_square_pvalue(a, b) > 0.5  # the rare cells pooled: 3 against 4 in "rest"
    assert chi_square_pvalue({(1, 2): 100}, {(1, 2): 90}) == 1.0
    assert chi_square_pvalue({(1, 2): 100, (1, 3): 0}, {(1, 2): 0, (1, 3): 100}) < THRESHOLD

"""EAGLE-2: greedy output with speculation == without, token for token (the lossless gate), with a guard that
drafting and acceptance really happened; finishing inside an accepted run; logprobs; sampling path."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.test.tiny import make_eagle_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import (
    assert_chunked_radix_and_retraction_lossless,
    assert_drafting_happened,
    assert_same_outputs,
    joint_counts,
    plain_finish_case,
    spec_kwargs,
)

TREES = [(3, 1, 4), (5, 4, 8), (4, 2, 7), (5, 8, 32)]  # (num_steps, topk, num_draft_tokens)
# 16 mixed-length prompts: the 8 shared ones and variations of them
PROMPTS_16 = PROMPTS + [p + " and then" for p in PROMPTS[::-1]]


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle")
    return {kind: make_eagle_head_dir(str(d / kind), target, kind=kind) for kind in ("self", "random")}


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("kind", ["self", "random"])
def test_greedy_batch_of_8_equals_plain(target, heads, plain, tree, kind):
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE", heads[kind], *tree)) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        if kind == "self":
            assert_drafting_happened(outs, min_accept_length=1.5)
        else:
            assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
        assert e.get_server_info()["avg_spec_accept_length"] >= 1.0
        assert_no_kv_leak(e)


@pytest.mark.parametrize("tree", [(5, 4, 8), (4, 1, 5)])
@pytest.mark.parametrize("kind", ["self", "random"])
def test_draft_stop_threshold_keeps_greedy_output(target, heads, plain, tree, kind):
    """--speculative-draft-stop-threshold cuts drafting short where the best draft path is unlikely: shallower
    trees, and for a chain fewer nodes than N. Greedy output stays plain decoding's."""
    kw = spec_kwargs("EAGLE", heads[kind], *tree, speculative_draft_stop_threshold=0.5)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        outs = e.generate(PROMPTS, greedy(24))
        prop = e.loop.scheduler.decoder.proposer
        assert [o["output_ids"] for o in outs] == plain
        assert prop.draft_forwards < (tree[0] - 1) * prop.draft_trees  # stops happened
        if kind == "self":
            assert_drafting_happened(outs, min_accept_length=1.2)
        assert_no_kv_leak(e)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_batch_sizes_equal_plain(target, heads, batch):
    prompts = PROMPTS_16[:batch] if batch > 1 else PROMPTS_16[5:6]
    with Engine(model_path=target, max_total_tokens=8192) as e:
        want = [o["output_ids"] for o in e.generate(prompts, greedy(24))]
    with Engine(model_path=target, max_total_tokens=8192, **spec_kwargs("EAGLE", heads["self"], 5, 4, 8)) as e:
        outs = e.generate(prompts, greedy(24))
        assert [o["output_ids"] for o in outs] == want
        assert_drafting_happened(outs, min_accept_length=1.5)
        assert_no_kv_leak(e)


def test_always_wrong_draft_accepts_nothing_and_changes_nothing(target, heads, plain):
    """A drafter whose every first token is known to be wrong (the plain output's next token + 1): verification
    must reject everything, each step yields exactly the bonus token, and the output is unchanged."""
    from specserve.speculative.tree import build_chain

    kw = spec_kwargs("EAGLE", heads["self"], 3, 1, 4, disable_speculative_auto_off=True)  # speculate every step
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        proposer = e.scheduler.decoder.proposer
        truth = {p: out for p, out in zip(PROMPTS, plain, strict=True)}
        by_prompt_ids = {tuple(e.tokenizer.encode(p)): truth[p] for p in PROMPTS}

        def wrong(reqs, shape=None):
            roots = torch.tensor([r.last_token for r in reqs])
            drafts = []
            for r in reqs:
                want = by_prompt_ids[tuple(r.origin_input_ids)]
                nxt = want[len(r.output_ids)] if len(r.output_ids) < len(want) else 0
                drafts.append([(nxt + 1) % 300, 7, 7])
            return build_chain(roots, torch.tensor(drafts))

        proposer.propose = wrong
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        for o in outs:  # one token per verify after the prefill's first; the last, alone left, from a plain step
            assert o["meta_info"]["spec_verify_ct"] == 22 and o["meta_info"]["spec_plain_tokens"] == 1
            assert o["meta_info"]["spec_accept_histogram"] == [22]
        assert_no_kv_leak(e)


def test_chunked_prefill_and_radix_reuse(target, heads, plain):
    assert_chunked_radix_and_retraction_lossless(target, spec_kwargs("EAGLE", heads["self"], 3, 2, 5), PROMPTS,
                                                 greedy(24), plain, min_accept_length=1.5)


def test_retraction_under_memory_pressure(target, heads, plain):
    kw = spec_kwargs("EAGLE", heads["self"], 3, 2, 5)
    with Engine(model_path=target, max_total_tokens=160, **kw) as e:
        outs = e.generate(PROMPTS, greedy(24))
        retractions = e.get_server_info()["num_retractions"]
        assert [o["output_ids"] for o in outs] == plain
        assert retractions > 0
        assert_drafting_happened(outs)
        assert_no_kv_leak(e)


def test_deeper_target_random_head(model_factory, tmp_path):
    """A 2-layer target (tree attention in more than one layer) with a draft that is mostly wrong."""
    path = model_factory("llama")
    head = make_eagle_head_dir(str(tmp_path / "h"), path, kind="random", seed=3)
    with Engine(model_path=path, max_total_tokens=4096) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS[:4], greedy(16))]
    with Engine(model_path=path, max_total_tokens=4096, **spec_kwargs("EAGLE", head, 4, 3, 8)) as e:
        assert [o["output_ids"] for o in e.generate(PROMPTS[:4], greedy(16))] == want


@pytest.mark.parametrize("extra", [
    {"max_new_tokens": 7},
    {"stop_token_ids": None},  # filled in the test with a token plain decoding emits
    {"stop": None},  # filled in with text plain decoding emits
    {"stop_regex": None},  # filled in with a regex of text plain decoding emits
    {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3},
    {"min_new_tokens": 10, "logit_bias": {"5": 3.0}},
])
def test_finish_and_processing_inside_accepted_runs(target, heads, extra):
    """The output, finish reason and logprobs equal plain decoding's even when the finish lands inside an
    accepted run of drafted tokens, and with penalties that depend on the drafted path."""
    params, want = plain_finish_case(target, PROMPTS[:2], greedy(24, return_logprob=True, top_logprobs_num=2), extra)
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE", heads["self"], 4, 1, 5)) as e:
        got = e.generate(PROMPTS[:2], params)
        assert_no_kv_leak(e)
    assert_drafting_happened(got)
    assert_same_outputs(got, want)


def test_sampling_top_k_1_is_greedy_and_seeded_runs_repeat(target, heads, plain):
    """Sampled verification: top_k=1 leaves one token of probability 1, so the lossless sampler must return the
    greedy output; and a seeded request repeats itself exactly, alone or in a batch."""
    kw = spec_kwargs("EAGLE", heads["self"], 3, 2, 5)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        outs = e.generate(PROMPTS, {**greedy(24), "temperature": 0.8, "top_k": 1})
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=1.5)
        sp = {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True, "seed": 1234}
        alone = e.generate(PROMPTS[1], sp)["output_ids"]
        batch = e.generate(PROMPTS, sp)[1]["output_ids"]
        assert alone == batch == e.generate(PROMPTS[1], sp)["output_ids"]
        assert_no_kv_leak(e)


@pytest.mark.parametrize("stop_threshold", [0.0, 0.999999])
def test_sampled_distribution_matches_plain(target, heads, stop_threshold):
    """Two-sample chi-square test: 600 seeded samples of tokens 2-3 with speculation vs 600 without, at
    temperature 1 with top_k 3 (a small support, so every cell is well filled). Deterministic seeds, so the
    test is repeatable; a verifier that judged drafts against the wrong node's distribution fails it. With a draft
    stop threshold above every score this head ranks a sampled row's candidates with (its top-3 distribution
    perturbed by the row's race noise: a score reaches 1 - 1e-6 only when one candidate's noise makes it a million
    times likelier than the others), each tree is cut to the root's 3 children (4 nodes instead of 5)."""
    from scipy.stats import chi2_contingency

    # 4 tokens: the verify step after the prefill has 3 left, so its tree keeps both levels for tokens 2-3
    params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": 4, "ignore_eos": True, "seed": s}
              for s in range(600)]
    prompts = [PROMPTS[3]] * len(params)
    with Engine(model_path=target, max_total_tokens=8192) as e:
        plain = joint_counts(e.generate(prompts, params))
    # the whole tree at any batch size (no batch-aware shrinking or turning off), so every step drafts one
    kw = spec_kwargs("EAGLE", heads["self"], 2, 3, 5, speculative_draft_stop_threshold=stop_threshold,
                     speculative_batch_token_budget=0, disable_speculative_auto_off=True)
    with Engine(model_path=target, max_total_tokens=8192, **kw) as e:
        outs = e.generate(prompts, [{**p, "seed": p["seed"] + 10_000} for p in params])
        prop = e.loop.scheduler.decoder.proposer
    assert_drafting_happened(outs)
    # every step drafted a tree; with the threshold none reached its one draft level
    assert prop.draft_trees > 0 and prop.draft_forwards == (0 if stop_threshold else prop.draft_trees)
    spec = joint_counts(outs)
    cells = sorted(set(plain) | set(spec))
    table = [[plain.get(c, 0) for c in cells], [spec.get(c, 0) for c in cells]]
    assert max(len(c) for c in cells) == 2
    p_value = chi2_contingency(table).pvalue
    assert p_value > 1e-3, (p_value, table)


def test_periodic_log_line_reports_accept_length(target, heads, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="specserve.scheduler.scheduler"):
        with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE", heads["self"], 3, 1, 4)) as e:
            e.generate(PROMPTS[0], greedy(200))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode:")]
    assert lines and "accept len" in lines[0] and "gen throughput" in lines[0]

"""Helpers for speculative-decoding tests: draft folders and the lossless gate."""

from __future__ import annotations

import re
import threading
import time

import pytest

from specserve import Engine
from specserve.speculative.accept_stats import accept_length


def spec_kwargs(algorithm: str, draft: str | None, steps: int, topk: int, tokens: int, **extra) -> dict:
    kw = dict(speculative_algorithm=algorithm, speculative_num_steps=steps, speculative_eagle_topk=topk,
              speculative_num_draft_tokens=tokens, **extra)
    if draft is not None:
        kw["speculative_draft_model_path"] = draft
    return kw


def run(path: str, prompts, params, **engine_kwargs) -> list[dict]:
    with Engine(model_path=path, **engine_kwargs) as e:
        outs = e.generate(prompts, params)
        info = e.get_server_info()
    return outs, info


def assert_drafting_happened(outs: list[dict], min_accept_length: float = 1.0) -> None:
    """The vacuity guard: verification ran and accepted drafted tokens (so equality is not trivially true)."""
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    accepted = sum(sum(k * c for k, c in enumerate(o["meta_info"]["spec_accept_histogram"])) for o in outs)
    assert verify > 0, "no verify step ran"
    assert accepted > 0, "no drafted token was ever accepted"
    assert accept_length([o["meta_info"] for o in outs]) > min_accept_length, verify


#: prompts that repeat themselves, so that NGRAM finds drafts in them, and two ordinary ones
REPEATING_PROMPTS = ["a b c d e f a b c d e f a b c", "x = 1\ny = 2\nx = 1\ny = 2\nx ="]


def assert_ngram_equals_plain(prompts: list[str], new_tokens: int = 24, **engine_kwargs) -> list[dict]:
    """NGRAM (8 draft tokens) on an engine with ``engine_kwargs`` gives plain decoding's greedy output token for token,
    with drafting checked (accept length >= 1.2) -> NGRAM's outputs."""
    params = {"temperature": 0, "max_new_tokens": new_tokens}
    with Engine(**engine_kwargs) as e:
        want = [o["output_ids"] for o in e.generate(prompts, params)]
    with Engine(**engine_kwargs, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8) as e:
        outs = e.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == want
    assert_drafting_happened(outs, min_accept_length=1.2)
    return outs


def joint_counts(outs: list[dict]) -> dict:
    """How often each pair (output token 2, output token 3) occurs: both come from verify steps (token 1 from the
    prefill), the cells of the two-sample sampling tests."""
    counts: dict = {}
    for o in outs:
        key = tuple(o["output_ids"][1:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def assert_chunked_radix_and_retraction_lossless(target: str, engine_kwargs: dict, prompts, params, want,
                                                 min_accept_length: float = 1.0,
                                                 retraction_tokens: int | None = None) -> None:
    """The gate under chunked prefill (size 4) and radix reuse (the same prompts twice: the second time from the
    prefix cache) and, with retraction_tokens, under a pool small enough to force retraction: every output
    equals `want`, drafting happened, and no KV slot leaks."""
    from tests.engine.helpers import assert_no_kv_leak

    with Engine(model_path=target, max_total_tokens=4096, chunked_prefill_size=4, **engine_kwargs) as e:
        first, again = e.generate(prompts, params), e.generate(prompts, params)
        assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again] == want
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
        assert_drafting_happened(first + again, min_accept_length)
        assert_no_kv_leak(e)
    if retraction_tokens is None:
        return
    with Engine(model_path=target, max_total_tokens=retraction_tokens, **engine_kwargs) as e:
        outs = e.generate(prompts, params)
        assert [o["output_ids"] for o in outs] == want
        assert e.get_server_info()["num_retractions"] > 0
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
        assert_no_kv_leak(e)


def staggered(engine: Engine, prompts, params, late_prompts, late_params) -> tuple[list[dict], list[dict]]:
    """`prompts` in one batch; `late_prompts` join once generation is under way (12 tokens generated)."""
    box: dict = {}
    first = threading.Thread(target=lambda: box.setdefault("first", engine.generate(prompts, params)))
    first.start()
    deadline = time.monotonic() + 60
    while engine.get_server_info()["generated_tokens"] < 12 and time.monotonic() < deadline:
        time.sleep(0.005)
    late = engine.generate(late_prompts, late_params)
    first.join()
    return box["first"], late


def plain_finish_case(target: str, prompts, params: dict, extra: dict) -> tuple[dict, list[dict]]:
    """A finish case and plain decoding's outputs for it: a None ``stop_token_ids`` / ``stop`` / ``stop_regex`` in
    `extra` is filled with a token / text / a regex of text plain decoding emits for prompts[0] (mid-generation, so
    the finish lands inside an accepted run). -> (the request params, plain outputs for `prompts`)."""
    with Engine(model_path=target, max_total_tokens=4096) as e:
        ref = e.generate(prompts[0], params)
        if "stop_token_ids" in extra:
            extra = {"stop_token_ids": [ref["output_ids"][9]], "ignore_eos": False}
        if "stop" in extra:
            extra = {"stop": [e.tokenizer.decode(ref["output_ids"][10:12])]}
        if "stop_regex" in extra:  # the same text as a regex, with a character class
            text = e.tokenizer.decode(ref["output_ids"][10:12])
            extra = {"stop_regex": ["[" + re.escape(text[0]) + "]" + re.escape(text[1:])]}
        params = {**params, **extra}
        return params, e.generate(prompts, params)


def assert_same_outputs(got: list[dict], want: list[dict]) -> None:
    """Ids, text, finish reason, completion tokens and logprobs (chosen and top lists) equal `want`'s."""
    for g, w in zip(got, want, strict=True):
        assert (g["output_ids"], g["text"]) == (w["output_ids"], w["text"])
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        assert g["meta_info"]["completion_tokens"] == w["meta_info"]["completion_tokens"]
        gl, wl = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in gl] == [t for _, t, _ in wl]
        assert [lp for lp, _, _ in gl] == pytest.approx([lp for lp, _, _ in wl], abs=1e-4)
        gt, wt = g["meta_info"]["output_top_logprobs"], w["meta_info"]["output_top_logprobs"]
        assert [[t for _, t, _ in row] for row in gt] == [[t for _, t, _ in row] for row in wt]

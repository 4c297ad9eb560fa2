"""Jump-forward in plain decoding: the tokens a grammar forces (a JSON key, a tool call's wrapper) are appended without
a forward of their own and run in the next forward beside the request's last sampled token. The outputs are those of
decoding every token (``--disable-grammar-jump-forward``), greedy and for each seed, whatever cuts a forced run short
(a stop string, max_new_tokens, a small KV pool, a forward with fewer rows than the forced tokens), for both grammar
backends; requests that want logprobs are not jumped."""

from __future__ import annotations

import json

import pytest

from specserve import Engine
from tests.engine.grammars import GRAMMARS, REGEX, SCHEMA, constrained
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy

BACKENDS = ["llguidance", "xgrammar"]


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=1024)


def run(path: str, prompts, params, rows: int | None = None, room: bool = False, **kw) -> tuple[list[dict], dict]:
    """-> (outputs, server info); rows: the most rows a decode forward takes (``ModelRunner.decode_rows``), and with
    room, the rows sampling fills with forced tokens (``OutputProcessor.jump_rows``; without: every forced token is
    appended, the forwards taking them as they can)."""
    with Engine(model_path=path, max_total_tokens=kw.pop("max_total_tokens", 4096), **kw) as e:
        if rows is not None:
            e.loop.call(lambda s: setattr(s.runner, "decode_rows", rows))
        if room:
            e.loop.call(lambda s: setattr(s.outputs, "jump_rows", rows))
        outs = e.generate(prompts, params)
        info = e.get_server_info()
        assert_no_kv_leak(e)
    return outs, info


def same_outputs(jumped: list[dict], stepped: list[dict]) -> None:
    for a, b in zip(jumped, stepped, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["text"] == b["text"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]


def mixed_params() -> list[dict]:
    """Eight requests: both grammars' JSON and tool calls, a regex, a free one, seeded sampled ones."""
    return [constrained("json_schema", 40), constrained("structural_tag", 60), constrained("regex"), greedy(24),
            {"temperature": 0.9, "seed": 3, "max_new_tokens": 40, "json_schema": SCHEMA},
            {"temperature": 0.9, "top_p": 0.9, "seed": 5, "max_new_tokens": 60, "structural_tag": GRAMMARS[
                "structural_tag"]},
            constrained("json_schema", 40), {"temperature": 0.7, "seed": 11, "max_new_tokens": 24, "regex": REGEX}]


@pytest.mark.parametrize("backend", BACKENDS)
def test_jump_forward_gives_the_outputs_of_decoding_every_token(path, backend):
    params = mixed_params()
    stepped, off = run(path, PROMPTS, params, grammar_backend=backend, disable_grammar_jump_forward=True)
    jumped, on = run(path, PROMPTS, params, grammar_backend=backend)
    same_outputs(jumped, stepped)
    assert off["grammar_jump_forward_tokens"] == 0
    # the JSON keys and the tool calls' wrappers were jumped over: fewer decode steps for the same tokens
    assert on["grammar_jump_forward_tokens"] >= 10
    assert on["generated_tokens"] == off["generated_tokens"]
    assert on["num_decode_steps"] < off["num_decode_steps"]
    for o, p in zip(jumped, params, strict=True):
        if "json_schema" in p and o["meta_info"]["finish_reason"]["type"] == "stop":
            json.loads(o["text"])
    alone_stepped, _ = run(path, PROMPTS[:1], constrained("json_schema", 40), grammar_backend=backend,
                           disable_grammar_jump_forward=True)
    alone, info = run(path, PROMPTS[:1], constrained("json_schema", 40), grammar_backend=backend)
    same_outputs(alone, alone_stepped)
    assert info["grammar_jump_forward_tokens"] > 0


@pytest.mark.parametrize(("rows", "room"), [(1, False), (10, False), (10, True)])
def test_a_forward_with_fewer_rows_than_forced_tokens_runs_them_over_several(path, rows, room):
    """rows 1: every forward has its one row per request, so a request holding forced tokens runs one a step and
    samples nothing until they are all in; rows 10 over 8 requests: a few forced tokens ride along each step; with
    room, sampling appends only as many forced tokens as the step's batch leaves rows for (fewer as it fills)."""
    params = mixed_params()
    stepped, _ = run(path, PROMPTS, params, disable_grammar_jump_forward=True)
    jumped, info = run(path, PROMPTS, params, rows=rows, room=room)
    same_outputs(jumped, stepped)
    assert info["grammar_jump_forward_tokens"] > 0
    if room:
        _, unlimited = run(path, PROMPTS, params, rows=rows)
        assert info["grammar_jump_forward_tokens"] < unlimited["grammar_jump_forward_tokens"]


def test_stop_strings_max_tokens_and_a_small_pool_cut_forced_runs_as_they_cut_decoding(path):
    # the enum value "gamma delta" is forced after its first token: the stop string lands inside the forced run
    params = [constrained("json_schema", 60, stop=["delta"]),
              constrained("json_schema", 3), constrained("json_schema", 7), constrained("structural_tag", 5),
              constrained("structural_tag", 60), constrained("json_schema", 40), constrained("json_schema", 40),
              constrained("json_schema", 40)]
    kw = dict(max_total_tokens=200, chunked_prefill_size=16)
    stepped, _ = run(path, PROMPTS, params, disable_grammar_jump_forward=True, **kw)
    jumped, info = run(path, PROMPTS, params, **kw)
    same_outputs(jumped, stepped)
    assert info["num_retractions"] > 0, "the pool was meant to force retraction"
    assert jumped[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "delta"}
    assert [o["meta_info"]["completion_tokens"] for o in jumped[1:4]] == [3, 7, 5]


def test_mixed_chunks_and_logprobs(path):
    """--enable-mixed-chunk: decode rows ride in a prefill forward only when no request holds forced tokens; a request
    that wants logprobs decodes every token (one logprob each, as without jump-forward)."""
    params = mixed_params()
    params[0] = constrained("json_schema", 40, return_logprob=True, top_logprobs_num=2)
    kw = dict(enable_mixed_chunk=True, chunked_prefill_size=8, max_running_requests=4)
    stepped, _ = run(path, PROMPTS, params, disable_grammar_jump_forward=True, **kw)
    jumped, info = run(path, PROMPTS, params, **kw)
    same_outputs(jumped, stepped)
    assert info["grammar_jump_forward_tokens"] > 0 and info["num_mixed_steps"] > 0
    lp, ref = jumped[0]["meta_info"], stepped[0]["meta_info"]
    assert len(lp["output_token_logprobs"]) == len(jumped[0]["output_ids"])
    # the same tokens and log-probabilities (up to float32 rounding: the batch's other rows differ between the runs)
    assert [t for _, t, _ in lp["output_token_logprobs"]] == [t for _, t, _ in ref["output_token_logprobs"]]
    assert [x for x, _, _ in lp["output_token_logprobs"]] == pytest.approx(
        [x for x, _, _ in ref["output_token_logprobs"]], abs=1e-4)

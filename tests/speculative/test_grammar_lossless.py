"""Structured outputs under speculation: for every algorithm, the verify step masks each tree node with the grammar's
state after its ancestors, so greedy outputs equal constrained plain decoding token for token (batch 1, batch 8,
a batch mixing constrained and free requests), and seeded sampled outputs equal plain decoding's for the same seeds
(the per-position coins), which keeps its distribution. Both grammar backends."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from specserve import Engine
from specserve.grammar.llguidance_backend import LLGuidanceMatcher
from specserve.scheduler.spec_decode import SpecDecoder
from specserve.test.tiny import make_eagle3_head_dir, make_mimo_dir
from specserve.tools.formats import TaggedJsonFormat
from specserve.tools.stream import ToolCallStream
from tests.engine.grammars import GRAMMARS, REGEX, SCHEMA, constrained
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

ALGORITHMS = ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM", "MTP"]


@pytest.fixture(scope="module")
def setups(target, self_head, model_factory, tmp_path_factory, tokenizer_dir):
    """algorithm -> (target folder, engine kwargs): drafts that mirror their target, so many drafts land."""
    d = tmp_path_factory.mktemp("grammar-drafts")
    mimo = make_mimo_dir(str(d / "mimo"), kind="self", tokenizer_dir=tokenizer_dir, max_position_embeddings=1024)
    bigram = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)
    eagle3 = make_eagle3_head_dir(str(d / "e3"), bigram, kind="self")
    return {
        "EAGLE": (target, spec_kwargs("EAGLE", self_head, 3, 2, 5)),
        "EAGLE3": (bigram, spec_kwargs("EAGLE3", eagle3, 3, 2, 5)),
        "STANDALONE": (target, spec_kwargs("STANDALONE", target, 3, 2, 5)),
        "NGRAM": (target, spec_kwargs("NGRAM", None, 3, 2, 5)),
        "MTP": (mimo, spec_kwargs("EAGLE", None, 3, 1, 4)),  # EAGLE with no draft: the model's own MTP layer
    }


def generate(path: str, prompts, params, **kw) -> tuple[list[dict], dict]:
    with Engine(model_path=path, max_total_tokens=4096, disable_speculative_auto_off=True, **kw) as e:
        outs = e.generate(prompts, params)
        info = e.get_server_info()
        assert_no_kv_leak(e)
    return outs, info


def ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_constrained_greedy_equals_constrained_plain(setups, algorithm, backend):
    path, kw = setups[algorithm]
    # batch 8 over both grammars and free requests; then one request alone
    params = [constrained("regex"), constrained("json_schema", 40), greedy(24), constrained("regex", 30),
              constrained("json_schema", 40), greedy(16), constrained("structural_tag", 60),
              constrained("json_schema", 40)]
    plain, _ = generate(path, PROMPTS[:8], params, grammar_backend=backend)
    spec, info = generate(path, PROMPTS[:8], params, grammar_backend=backend, **kw)
    assert ids(spec) == ids(plain)
    assert_drafting_happened([o for o, p in zip(spec, params, strict=True) if p.keys() & GRAMMARS.keys()])
    # jump-forward: tokens the grammar forces (the tool call's wrapper and name, JSON punctuation) were appended to
    # the trees and accepted
    assert sum(o["meta_info"]["spec_forced_tokens"] for o in spec) > 0 and info["spec_forced_tokens"] > 0
    alone_plain, _ = generate(path, PROMPTS[3:4], constrained("json_schema", 40), grammar_backend=backend)
    alone, _ = generate(path, PROMPTS[3:4], constrained("json_schema", 40), grammar_backend=backend, **kw)
    assert ids(alone) == ids(alone_plain)
    # the outputs really follow their grammars (the tiny model alone does not: see the free requests)
    for o, p in zip(plain, params, strict=True):
        if "regex" in p:
            assert re.fullmatch(REGEX, o["text"]), o["text"]
        if "json_schema" in p and o["meta_info"]["finish_reason"]["type"] == "stop":
            json.loads(o["text"])
        if "structural_tag" in p:
            assert o["text"].startswith("<tool_call>\n{\"name\": "), o["text"]
            if o["meta_info"]["finish_reason"]["type"] == "stop":
                assert ToolCallStream(TaggedJsonFormat()).feed(o["text"], final=True)[1]
    free = [o["text"] for o, p in zip(plain, params, strict=True) if not GRAMMARS.keys() & p.keys()]
    assert not any(re.fullmatch(REGEX, text) for text in free)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_check_first_sampling_equals_masking_every_token(target, backend, monkeypatch):
    """Plain decoding draws a greedy, or untruncated sampled, constrained token without its mask and builds the mask
    only where the grammar refuses the token and does not name the one it forces: the same tokens as masking first,
    greedy and for each seed; rows with top_p are masked first."""
    picks = []  # (drawn, picked) of llguidance's picks: the token itself, the forced one, or None (the mask)
    if backend == "llguidance":
        pick = LLGuidanceMatcher.pick

        def counted(self, token, unforced=False):
            picks.append((token, pick(self, token, unforced)))
            return picks[-1][1]

        monkeypatch.setattr(LLGuidanceMatcher, "pick", counted)
    params = [constrained("regex"), constrained("json_schema", 40), greedy(24), constrained("structural_tag", 60)]
    params += [{"temperature": 0.9, "seed": seed, "max_new_tokens": 24, "ignore_eos": True, "regex": REGEX}
               for seed in range(3)]
    params += [{"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_new_tokens": 24, "ignore_eos": True,
                "json_schema": SCHEMA}]
    masked, masked_info = generate(target, PROMPTS[:8], params, grammar_backend=backend,
                                   disable_grammar_check_first=True)
    checked, info = generate(target, PROMPTS[:8], params, grammar_backend=backend)
    assert ids(checked) == ids(masked)
    assert masked_info["grammar_checked_tokens"] == 0
    # both ways ran: tokens the grammar took as drawn, and refused ones drawn again under the mask; the top_p row
    # (24 tokens) and the free one were never checked
    drawn_constrained = sum(len(o["output_ids"]) for o, p in zip(checked, params, strict=True)
                            if p.keys() & GRAMMARS.keys() and "top_p" not in p)
    assert 0 < info["grammar_check_refusals"] < info["grammar_checked_tokens"] <= drawn_constrained
    if backend == "llguidance":  # refused tokens replaced by the forced one without a mask, and others redrawn
        assert any(p is not None and p != t for t, p in picks) and any(p is None for _, p in picks)


@pytest.mark.parametrize("algorithm", ["EAGLE", "NGRAM"])
def test_seeded_constrained_sampling_equals_plain_for_each_seed(setups, algorithm):
    path, kw = setups[algorithm]
    params = [{"temperature": 0.9, "top_p": 0.95, "seed": seed, "max_new_tokens": 24, "ignore_eos": True,
               "regex": REGEX} for seed in range(16)]
    prompts = [PROMPTS[s % 8] for s in range(16)]
    plain, _ = generate(path, prompts, params)
    spec, _ = generate(path, prompts, params, **kw)
    assert ids(spec) == ids(plain)
    assert sum(o["meta_info"]["spec_verify_ct"] for o in spec) > 0
    assert len({tuple(x) for x in ids(plain)}) > 8  # the seeds matter: sampling, not a fixed answer


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_grammar_aware_drafting_accepts_more_than_blind_drafting(setups, algorithm):
    """The same outputs (both lossless), so their accept lengths compare like for like: drafting only what the
    grammar allows accepts more per step than drafting blind to it (other engines' way: only verification masks)."""
    path, kw = setups[algorithm]
    params = [constrained("regex", 30), constrained("json_schema", 40), constrained("regex", 30),
              constrained("json_schema", 40)]
    plain, _ = generate(path, PROMPTS[:4], params)
    aware, _ = generate(path, PROMPTS[:4], params, disable_grammar_jump_forward=True, **kw)
    blind, _ = generate(path, PROMPTS[:4], params, disable_grammar_jump_forward=True,
                        disable_grammar_aware_drafting=True, **kw)
    assert ids(aware) == ids(plain) and ids(blind) == ids(plain)
    assert_drafting_happened(aware)
    assert_drafting_happened(blind)

    def accept(outs):  # completion tokens per verify step
        return sum(o["meta_info"]["completion_tokens"] for o in outs) / sum(
            o["meta_info"]["spec_verify_ct"] for o in outs)

    assert accept(aware) > accept(blind), (accept(aware), accept(blind))


def test_forced_tokens_stay_within_the_rows_a_forward_keeps_fused(setups, monkeypatch):
    """Where the platform's fused decoder layers take at most R rows (``ModelRunner.decode_rows``), a lone constrained
    request's tree grows with forced tokens up to R nodes, not past them; the outputs stay constrained plain
    decoding's."""
    path, kw = setups["EAGLE3"]  # tree 3/2/5: forced tokens may grow it to 9 nodes
    rows, widest = 7, []
    verify_forward = SpecDecoder._verify_forward

    def spied(self, reqs, tree, root_pos, n_nodes, slots):
        widest.append(max(n_nodes))
        return verify_forward(self, reqs, tree, root_pos, n_nodes, slots)

    monkeypatch.setattr(SpecDecoder, "_verify_forward", spied)
    params = [constrained("structural_tag", 60), constrained("json_schema", 40)]
    plain = [generate(path, PROMPTS[b : b + 1], params[b])[0][0] for b in range(2)]
    with Engine(model_path=path, max_total_tokens=4096, disable_speculative_auto_off=True, **kw) as e:
        e.loop.call(lambda s: setattr(s.runner, "decode_rows", rows))
        spec = [e.generate(PROMPTS[b], params[b]) for b in range(2)]
        info = e.get_server_info()
    assert ids(spec) == ids(plain)
    assert info["spec_forced_tokens"] > 0
    assert max(widest) == rows  # forced tokens filled the room, and no more


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_plain_steps_of_a_speculative_engine_jump_forward_losslessly(setups, algorithm, monkeypatch):
    """Batch-aware speculation's plain steps jump over forced tokens as plain decoding does; a step after one that left
    forced tokens without KV is plain too, and the drafter catches up on all of them: every third step plain here,
    the outputs constrained plain decoding's."""
    path, kw = setups[algorithm]
    choose, steps = SpecDecoder.choose_shape, itertools.count()

    def every_third_plain(self, reqs, kind):
        shape = choose(self, reqs, kind)
        return None if next(steps) % 3 == 0 else shape

    monkeypatch.setattr(SpecDecoder, "choose_shape", every_third_plain)
    params = [constrained("json_schema", 40), constrained("structural_tag", 60), constrained("regex"), greedy(24)]
    plain, _ = generate(path, PROMPTS[:4], params, disable_grammar_jump_forward=True)
    spec, info = generate(path, PROMPTS[:4], params, **kw)
    assert ids(spec) == ids(plain)
    assert info["grammar_jump_forward_tokens"] > 0 and info["spec_plain_steps"] > 0
    assert_drafting_happened(spec[:3])
    for o in spec:  # plain steps' tokens, forced ones included, stay out of the accept length
        meta = o["meta_info"]
        assert meta["spec_plain_tokens"] + meta["spec_accept_length"] * meta["spec_verify_ct"] == pytest.approx(
            meta["completion_tokens"])

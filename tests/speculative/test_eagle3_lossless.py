"""EAGLE-3: the lossless gate (greedy output with speculation == without) with a vacuity guard, across draft
vocabularies (target's, a permutation through d2t, a strict subset), tree shapes and chunked prefill."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import Engine
from specserve.speculative.draft_models import eagle3_capture_layers
from specserve.test.tiny import make_eagle3_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs


@pytest.fixture(scope="module")
def target(model_factory):
    return model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)


@pytest.fixture(scope="module")
def vocab(target) -> int:
    with open(os.path.join(target, "config.json")) as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(20))]


def _perm(n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("tree", [(3, 1, 4), (4, 3, 8)])
@pytest.mark.parametrize("draft_vocab", ["target", "identity", "permuted", "half"])
def test_greedy_equals_plain_with_self_head(target, vocab, plain, tmp_path, tree, draft_vocab):
    # identity: the head's own LM head over the whole target vocabulary in target order (d2t all zero), as
    # train-eagle writes a whole-vocabulary head
    ids = {"target": None, "identity": list(range(vocab)), "permuted": _perm(vocab),
           "half": sorted(_perm(vocab)[: vocab // 2])}[draft_vocab]
    head = make_eagle3_head_dir(str(tmp_path / "h"), target, kind="self", draft_vocab=ids)
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE3", head, *tree)) as e:
        outs = e.generate(PROMPTS, greedy(20))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=1.2)
        assert_no_kv_leak(e)
        # an identity d2t maps nothing (no gather per draft level); a real map is kept
        assert (e.loop.scheduler.decoder.proposer.d2t_ids is None) == (draft_vocab in ("target", "identity"))
        assert e.loop.scheduler.decoder.proposer.distinct_ids  # every map here is injective: no duplicate merge


def test_d2t_with_repeats_keeps_merging_duplicate_siblings(target, vocab, plain, tmp_path):
    """Two draft ids per target id: top-k gives a node two children with one token, so the duplicate merge of
    build_tree must stay on (an injective d2t skips it); greedy output is still plain decoding's."""
    half = sorted(_perm(vocab)[: vocab // 2])
    head = make_eagle3_head_dir(str(tmp_path / "h"), target, kind="self", draft_vocab=half + half)
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("EAGLE3", head, 4, 3, 8)) as e:
        assert e.loop.scheduler.decoder.proposer.distinct_ids is False
        outs = e.generate(PROMPTS, greedy(20))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=1.2)
        assert_no_kv_leak(e)


def test_random_head_chunked_prefill_equals_plain(target, vocab, plain, tmp_path):
    head = make_eagle3_head_dir(str(tmp_path / "h"), target, kind="random", draft_vocab=_perm(vocab), seed=1,
                                aux_layer_ids=[0, 1, 2])
    kw = spec_kwargs("EAGLE3", head, 3, 2, 6)
    with Engine(model_path=target, max_total_tokens=4096, chunked_prefill_size=4, **kw) as e:
        outs = e.generate(PROMPTS, greedy(20))
        assert [o["output_ids"] for o in outs] == plain
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
        assert_no_kv_leak(e)


def test_capture_layers():
    assert eagle3_capture_layers(32, None) == (2, 16, 29)  # SGLang's default: inputs of [2, L//2, L-3]
    assert eagle3_capture_layers(32, [1, 15, 28]) == (2, 16, 29)  # config ids are layer OUTPUTS
    assert eagle3_capture_layers(4, None) == (2, 2, 1)
    assert eagle3_capture_layers(2, None) == (2, 1, 0)  # clamped into 0..L


def test_heads_that_do_not_fit_the_target_fail_at_start_up(target, model_factory, tmp_path):
    from specserve.config import ConfigError
    from specserve.test.tiny import make_eagle_head_dir

    narrow = model_factory("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    eagle = make_eagle_head_dir(str(tmp_path / "e"), narrow, kind="random")
    with pytest.raises(ConfigError, match="^--speculative-draft-model-path: the draft head's hidden_size 32"):
        Engine(model_path=target, **spec_kwargs("EAGLE", eagle, 3, 1, 4))
    eagle3 = make_eagle3_head_dir(str(tmp_path / "e3"), narrow, kind="random", draft_vocab=[1, 2, 3, 4])
    with pytest.raises(ConfigError, match="^--speculative-draft-model-path: the EAGLE-3 head expects"):
        Engine(model_path=target, **spec_kwargs("EAGLE3", eagle3, 3, 1, 4))


def test_prompt_catch_up_attended_request_by_request(target, plain, tmp_path, monkeypatch):
    """The draft's extend over prompts may attend request by request, as the target's prefill does (forced here on
    every batch): outputs equal plain decoding, every request's accept figures equal those of a padded catch-up
    (float32: the draft's states are the same), and a draft extend of several requests was really split. (A one-layer
    head's long catch-ups attend their last rows alone, test_catch_up_rows.py: turned off here; deeper drafts split.)"""
    from specserve.attention import sdpa as backend
    from specserve.speculative import eagle

    monkeypatch.setattr(eagle, "last_rows_only", lambda q_lens: False)
    head = make_eagle3_head_dir(str(tmp_path / "h"), target, kind="self")
    kw = dict(model_path=target, max_total_tokens=4096, dtype="float32", **spec_kwargs("EAGLE3", head, 4, 3, 8))

    def figures(outs):
        return [(o["meta_info"]["spec_verify_ct"], o["meta_info"]["spec_accept_histogram"]) for o in outs]

    with Engine(**kw) as e:
        padded = e.generate(PROMPTS, greedy(20))
    monkeypatch.setattr(backend, "MIN_PADDING_PER_REQUEST", 0)
    split_sizes = []
    real = eagle.extend_batch

    def spy(*args, **kwargs):
        fb = real(*args, **kwargs)
        if fb.attn.groups is not None:
            split_sizes.append(len(fb.attn.groups))
        return fb

    monkeypatch.setattr(eagle, "extend_batch", spy)
    with Engine(**kw) as e:
        split = e.generate(PROMPTS, greedy(20))
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in split] == plain
    assert_drafting_happened(split, min_accept_length=1.2)
    assert figures(split) == figures(padded)
    assert split_sizes and max(split_sizes) > 1, "no draft extend of several requests was split"

"""STANDALONE: a separate small LM drafts; the lossless gate with a vacuity guard. A self-draft (draft = target)
must accept (nearly) everything; a foreign draft must still give identical output."""

from __future__ import annotations

import pytest

from specserve import Engine
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import (
    assert_chunked_radix_and_retraction_lossless,
    assert_drafting_happened,
    spec_kwargs,
)


@pytest.fixture(scope="module")
def target(model_factory):
    return model_factory("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def other(model_factory):
    return model_factory("llama", num_hidden_layers=1, seed=5)


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


@pytest.mark.parametrize("tree", [(3, 1, 4), (4, 3, 8)])
def test_self_draft_accepts_everything(target, plain, tree):
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("STANDALONE", target, *tree)) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=2.5)
        if tree[1] == 1:  # a chain drafted by the target itself: every step accepts all S drafts (S + 1 tokens) but
            for o in outs:  # the last, whose chain is cut to the tokens left (23 = 5 x 4 + 3)
                hist = o["meta_info"]["spec_accept_histogram"]
                assert hist[3] == 5 and hist[2] == 1 == sum(hist) - 5 and o["meta_info"]["spec_accept_rate"] == 1.0
        assert_no_kv_leak(e)


def test_draft_stop_threshold_cuts_chains_to_one_draft(target, plain):
    """A threshold above every draft probability of this random target stops each 4-token chain before its first
    draft level: every step verifies the root and one draft, which a self-draft always gets right."""
    kw = spec_kwargs("STANDALONE", target, 4, 1, 5, speculative_draft_stop_threshold=0.99)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        outs = e.generate(PROMPTS, greedy(24))
        prop = e.loop.scheduler.decoder.proposer
        assert [o["output_ids"] for o in outs] == plain
        assert prop.draft_trees > 0 and prop.draft_forwards == 0
        for o in outs:
            hist = o["meta_info"]["spec_accept_histogram"]
            assert len(hist) <= 2 and hist[1] == sum(hist) > 0
        assert_no_kv_leak(e)


@pytest.mark.parametrize("tree", [(3, 1, 4), (3, 3, 6)])
def test_foreign_draft_equals_plain(target, other, plain, tree):
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs("STANDALONE", other, *tree)) as e:
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0
        assert_no_kv_leak(e)


def test_chunked_prefill_radix_reuse_and_retraction(target, plain):
    assert_chunked_radix_and_retraction_lossless(target, spec_kwargs("STANDALONE", target, 3, 2, 5), PROMPTS,
                                                 greedy(24), plain, min_accept_length=2.0, retraction_tokens=200)


def test_draft_with_another_tokenizer_fails_at_start_up(target, tmp_path):
    import json
    import shutil

    from specserve.config import ConfigError

    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different tokenizer
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="^--speculative-draft-model-path: the draft's tokenizer differs"):
        Engine(model_path=target, **spec_kwargs("STANDALONE", str(draft), 3, 1, 4))


def _without_tokenizer(src: str, dst) -> str:
    """A copy of the model folder src with its tokenizer files left out (a draft shipped to go with one target)."""
    import shutil

    from specserve.speculative.draft_models import VOCAB_FILES

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*VOCAB_FILES, "tokenizer_config.json",
                                                            "special_tokens_map.json"))
    return str(dst)


def test_draft_without_tokenizer_files_is_checked_by_its_config(target, plain, tmp_path):
    """No tokenizer in the draft folder: the vocabulary size and BOS / EOS ids decide; a match drafts losslessly."""
    draft = _without_tokenizer(target, tmp_path / "draft")
    with Engine(model_path=target, max_total_tokens=4096, disable_speculative_auto_off=True,
                **spec_kwargs("STANDALONE", draft, 3, 2, 5)) as e:
        outs = e.generate(PROMPTS, greedy(24))
    assert [o["output_ids"] for o in outs] == plain
    assert_drafting_happened(outs, min_accept_length=2.0)


@pytest.mark.parametrize("key,value", [("vocab_size", 640), ("eos_token_id", 7), ("bos_token_id", 9)])
def test_draft_without_tokenizer_files_and_another_vocabulary_fails(target, model_factory, tmp_path, key, value):
    import json

    from specserve.config import ConfigError

    # another vocabulary size needs weights of that size: a model built so (its extra rows padding, as Qwen pads)
    source = model_factory("llama", num_hidden_layers=1, vocab_size=value) if key == "vocab_size" else target
    draft = _without_tokenizer(source, tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"^--speculative-draft-model-path: the draft has no tokenizer files and "
                                          f"its config differs from the target's in {key} "):
        Engine(model_path=target, **spec_kwargs("STANDALONE", draft, 3, 1, 4))

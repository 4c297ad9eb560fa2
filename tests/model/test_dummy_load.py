"""--load-format dummy: random weights from config.json alone (targets and draft heads), and the errors around it."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from specserve import Engine
from specserve.config import ConfigError, ServerArgs
from specserve.models.loader import ModelLoadError, load_model
from specserve.test.tiny import make_eagle3_head_dir
from tests.engine.helpers import PROMPTS, greedy
from tests.speculative.helpers import spec_kwargs


def _without_weights(src: str, dst) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not [f for f in os.listdir(dst) if "safetensors" in f]
    return str(dst)


@pytest.fixture(scope="module")
def bare_dir(model_factory, tmp_path_factory) -> str:
    """config.json + tokenizer, no weights."""
    return _without_weights(model_factory("llama"), tmp_path_factory.mktemp("bare") / "m")


def test_dummy_serves_a_folder_without_weights(bare_dir):
    with Engine(model_path=bare_dir, load_format="dummy", max_total_tokens=2048) as e:
        vocab = e.scheduler.runner.spec.vocab_size
        outs = e.generate(PROMPTS[:3], greedy(8), return_logprob=True)
    for o in outs:
        assert len(o["output_ids"]) == 8 and all(0 <= t < vocab for t in o["output_ids"])
        assert all(math.isfinite(lp) for lp, _, _ in o["meta_info"]["output_token_logprobs"])


def test_without_the_flag_the_missing_weights_error_stays(bare_dir):
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        Engine(model_path=bare_dir, max_total_tokens=2048)


def test_dummy_values_are_seeded_and_shaped_like_the_rule(model_factory, tmp_path):
    bare = _without_weights(model_factory("qwen2"), tmp_path / "q")
    a, _, _ = load_model(bare, "bfloat16", load_format="dummy", seed=3)
    b, _, _ = load_model(bare, "bfloat16", load_format="dummy", seed=3)
    c, _, _ = load_model(bare, "bfloat16", load_format="dummy", seed=4)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)  # same seed, same weights
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
    for name, p in pa.items():
        assert p.dtype == torch.bfloat16
        if p.dim() >= 2:
            assert abs(p.float().std().item() - 0.02) < 0.004, name
        elif "norm" in name:
            assert torch.all(p == 1), name
        else:  # qwen2's q/k/v biases
            assert "bias" in name and torch.all(p == 0), name


def test_dummy_draft_head_too(model_factory, tmp_path):
    target = model_factory("llama")
    head = make_eagle3_head_dir(str(tmp_path / "full"), target, kind="random", draft_vocab=list(range(0, 400, 2)))
    bare_head = _without_weights(head, tmp_path / "bare_head")
    kw = spec_kwargs("EAGLE3", bare_head, 3, 1, 4)
    with Engine(model_path=_without_weights(target, tmp_path / "t"), load_format="dummy", max_total_tokens=2048,
                **kw) as e:
        d2t = e.scheduler.decoder.proposer.head.d2t
        outs = e.generate(PROMPTS[:2], greedy(8))
    assert d2t.numel() == 200 and torch.all(d2t == 0)  # identity draft -> target map
    assert all(len(o["output_ids"]) == 8 for o in outs)
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0


def test_bad_load_format_names_the_flag():
    with pytest.raises(ConfigError, match="--load-format"):
        ServerArgs(model_path="x", load_format="pickle").validate()

"""The code family (``specserve/demo_models``, source tree) and what the wheel bundles: present, the wheel within
its size budget, in the published formats, and every algorithm drafts on the code family with accept length > 1 and
greedy output equal to plain decoding."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import Engine
from specserve.demo_models import (
    BUNDLED,
    DEMO_NAMES,
    DEMO_ROOT,
    SIZE_BUDGET,
    TOKEN_MAP,
    bundled_files,
    demo_available,
    demo_path,
)
from specserve.speculative.accept_stats import accept_length
from specserve.speculative.tree import EagleCandidates
from specserve.train.corpus import held_out_prompts

GREEDY = {"max_new_tokens": 32, "temperature": 0}


@pytest.fixture(scope="module")
def prompts():
    return held_out_prompts(3, context_chars=300)


def test_the_code_family_is_present_in_bf16():
    assert demo_available()
    for name in DEMO_NAMES:
        with open(os.path.join(demo_path(name), "config.json")) as f:
            cfg = json.load(f)
        assert cfg["torch_dtype"] == "bfloat16", name


def test_the_wheel_bundles_smollm2_heads_within_budget_and_not_the_code_family():
    import tomllib

    with open(os.path.join(DEMO_ROOT, "..", "..", "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["specserve.demo_models"]
    assert tuple(package_data) == BUNDLED
    files = [os.path.relpath(f, DEMO_ROOT) for f in bundled_files()]
    assert {"smollm2-eagle3/model.safetensors", "smollm2-eagle/model.safetensors", "smollm2-fr-spec/freq_8192.pt",
            "smollm2-held-out.jsonl", "smollm2-draft/model.safetensors", "smollm2-draft/config.json"} <= set(files)
    assert not any(f.split(os.sep)[0] in DEMO_NAMES for f in files)
    total = sum(os.path.getsize(os.path.join(DEMO_ROOT, f)) for f in files)
    assert total <= SIZE_BUDGET, total


def test_published_formats():
    from safetensors import safe_open

    arch = {n: json.load(open(os.path.join(demo_path(n), "config.json")))["architectures"][0] for n in DEMO_NAMES}
    assert arch == {"demo": "LlamaForCausalLM", "demo-eagle": "LlamaForCausalLMEagle",
                    "demo-eagle3": "LlamaForCausalLMEagle3", "demo-draft": "LlamaForCausalLM",
                    "demo-mtp": "MiMoForCausalLM"}
    with safe_open(os.path.join(demo_path("demo-eagle3"), "model.safetensors"), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert f.get_tensor("lm_head.weight").shape[0] == d2t.numel() == int(t2d.sum())
    assert torch.equal((torch.arange(d2t.numel()) + d2t).sort().values, t2d.nonzero().flatten())
    with safe_open(os.path.join(demo_path("demo-mtp"), "model.safetensors"), "pt") as f:
        assert any(k.startswith("model.mtp_layers.0.") for k in f.keys())
    hot = torch.load(demo_path(TOKEN_MAP))
    assert hot.numel() == 1024


def test_transformers_loads_the_target_and_draft():
    import transformers

    for name in ("demo", "demo-draft"):
        m = transformers.AutoModelForCausalLM.from_pretrained(demo_path(name))
        assert m.config.vocab_size == 4096


CASES = {
    "EAGLE": ("demo", {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "demo-eagle"}),
    "EAGLE+FR-Spec": ("demo", {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "demo-eagle",
                               "speculative_token_map": TOKEN_MAP}),
    "EAGLE3": ("demo", {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "demo-eagle3"}),
    "STANDALONE": ("demo", {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "demo-draft"}),
    "MTP": ("demo-mtp", {"speculative_algorithm": "EAGLE", "speculative_num_steps": 1,
                         "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2}),
    "NGRAM": ("demo", {"speculative_algorithm": "NGRAM"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_algorithm_drafts_on_the_demo_family(prompts, case):
    model, kw = CASES[case]
    # float32: in bf16 a tree verify and a decode step sum attention in different orders, so a logit near-tie
    # (within one bf16 step) can break either way; lossless equality is checked where rounding cannot decide it
    with Engine(model_path=model, dtype="float32") as e:
        want = [o["output_ids"] for o in e.generate(prompts, GREEDY)]
    with Engine(model_path=model, dtype="float32", **kw) as e:
        outs = e.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == want
    assert accept_length([o["meta_info"] for o in outs]) > 1.0, case


def _eagle3_trees(prompts, monkeypatch, full_depth: bool, **kw):
    """Greedy outputs, the verified trees (tokens, parents) step by step, the draft forwards, and the levels each
    tree could draft (5, fewer where the tokens left cap it) of the demo EAGLE-3 pair (5/4/8 tree, float32)."""
    from specserve.speculative.eagle import EagleProposer

    select, propose, trees, levels = EagleCandidates.select, EagleProposer.propose, [], []

    def recording_select(self, root_tokens, n, **kw):
        tree = select(self, root_tokens, n, **kw)
        trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    def recording_propose(self, reqs, shape=None):
        levels.append(self.steps if shape is None else shape.steps)
        return propose(self, reqs, shape)

    monkeypatch.setattr(EagleCandidates, "select", recording_select)
    monkeypatch.setattr(EagleProposer, "propose", recording_propose)
    if full_depth:  # the draft before the stop existed: every tree drafts all its levels
        monkeypatch.setattr(EagleCandidates, "can_stop", lambda self, keep, threshold=0.0: False)
    with Engine(model_path="demo", dtype="float32", **CASES["EAGLE3"][1], speculative_num_steps=5,
                speculative_eagle_topk=4, speculative_num_draft_tokens=8, **kw) as e:
        outs = e.generate(prompts, GREEDY)
        prop = e.loop.scheduler.decoder.proposer
    monkeypatch.undo()
    assert prop.draft_trees == sum(n > 1 for n in levels) and len(trees) == len(levels)
    return [o["output_ids"] for o in outs], trees, prop.draft_forwards, levels


def test_draft_stop_on_the_demo_pair(prompts, monkeypatch):
    """The exact stop verifies exactly the trees a full-depth draft selects, with fewer draft forwards; a stop
    threshold drafts less still and changes trees but not the greedy output."""
    with Engine(model_path="demo", dtype="float32") as e:
        want = [o["output_ids"] for o in e.generate(prompts, GREEDY)]
    full, full_trees, full_fw, levels = _eagle3_trees(prompts, monkeypatch, full_depth=True)
    stop, stop_trees, stop_fw, stop_levels = _eagle3_trees(prompts, monkeypatch, full_depth=False)
    assert full == stop == want
    assert stop_trees == full_trees and stop_levels == levels and levels.count(5) > 0
    assert full_fw == sum(n - 1 for n in levels) and stop_fw < full_fw  # full depth: every level below the first
    lossy, lossy_trees, lossy_fw, _ = _eagle3_trees(prompts, monkeypatch, full_depth=False,
                                                    speculative_draft_stop_threshold=0.2)
    assert lossy == want
    assert lossy_trees != full_trees and lossy_fw / len(lossy_trees) < stop_fw / len(stop_trees)

"""The bundled demo family (``specserve/demo_models``): present, within the size budget, in the published formats,
and every algorithm drafts on it with accept length > 1 and greedy output equal to plain decoding."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import Engine
from specserve.cli import main as cli_main
from specserve.demo_models import DEMO_NAMES, DEMO_ROOT, TOKEN_MAP, demo_available, demo_path
from specserve.speculative.accept_stats import accept_length
from specserve.speculative.tree import EagleCandidates
from specserve.train.corpus import held_out_prompts

GREEDY = {"max_new_tokens": 32, "temperature": 0}
SIZE_BUDGET = 40 * 1024 * 1024


@pytest.fixture(scope="module")
def prompts():
    return held_out_prompts(3, context_chars=300)


def test_bundled_family_is_present_and_within_budget():
    assert demo_available()
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(DEMO_ROOT) for f in files
                if "__pycache__" not in d)
    assert total < SIZE_BUDGET, total
    for name in DEMO_NAMES:
        with open(os.path.join(demo_path(name), "config.json")) as f:
            cfg = json.load(f)
        assert cfg["torch_dtype"] == "bfloat16", name


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
    """Greedy outputs, the verified trees (tokens, parents) step by step, and the draft forwards / trees counts
    of the demo EAGLE-3 pair (5/4/8 tree, float32)."""
    select, trees = EagleCandidates.select, []

    def recording_select(self, root_tokens, n, **kw):
        tree = select(self, root_tokens, n, **kw)
        trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    monkeypatch.setattr(EagleCandidates, "select", recording_select)
    if full_depth:  # the draft before the stop existed: every tree drafts all its levels
        monkeypatch.setattr(EagleCandidates, "can_stop", lambda self, keep, threshold=0.0: False)
    with Engine(model_path="demo", dtype="float32", **CASES["EAGLE3"][1], speculative_num_steps=5,
                speculative_eagle_topk=4, speculative_num_draft_tokens=8, **kw) as e:
        outs = e.generate(prompts, GREEDY)
        prop = e.loop.scheduler.decoder.proposer
    monkeypatch.undo()
    return [o["output_ids"] for o in outs], trees, prop.draft_forwards, prop.draft_trees


def test_draft_stop_on_the_demo_pair(prompts, monkeypatch):
    """The exact stop verifies exactly the trees a full-depth draft selects, with fewer draft forwards; a stop
    threshold drafts less still and changes trees but not the greedy output."""
    with Engine(model_path="demo", dtype="float32") as e:
        want = [o["output_ids"] for o in e.generate(prompts, GREEDY)]
    full, full_trees, full_fw, n_full = _eagle3_trees(prompts, monkeypatch, full_depth=True)
    stop, stop_trees, stop_fw, n_stop = _eagle3_trees(prompts, monkeypatch, full_depth=False)
    assert full == stop == want
    assert stop_trees == full_trees and len(full_trees) == n_full == n_stop > 0
    assert full_fw == 4 * n_full and stop_fw < full_fw
    lossy, lossy_trees, lossy_fw, _ = _eagle3_trees(prompts, monkeypatch, full_depth=False,
                                                    speculative_draft_stop_threshold=0.2)
    assert lossy == want
    assert lossy_trees != full_trees and lossy_fw / len(lossy_trees) < stop_fw / n_stop


def test_generate_without_model_path_uses_the_demo_with_eagle3(capsys):
    assert cli_main(["generate", "def fibonacci(n):", "--max-new-tokens", "24"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def fibonacci(n):")
    assert "accept length" in captured.err and "EAGLE3" in captured.err


def test_serve_without_model_path_serves_the_demo_with_eagle3(tmp_path):
    """The README's main command (`make serve` = `specserve serve`): the demo target, EAGLE-3 on, over HTTP."""
    import subprocess
    import sys

    import openai
    import requests

    from specserve.utils import free_port, terminate_process, wait_for_server
    from tests.server.conftest import server_env

    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the server writes it for its whole life
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), "--num-threads",
                             "1"], stdout=log, stderr=subprocess.STDOUT, env=server_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, timeout=120, process=proc)
        client = openai.Client(base_url=url + "/v1", api_key="None")
        model = client.models.list().data[0].id
        assert model == "demo"
        resp = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=32, temperature=0)
        assert resp.usage.completion_tokens > 0 and resp.choices[0].text
        info = requests.get(url + "/get_server_info", timeout=10).json()
        assert info["speculative_algorithm"] == "EAGLE3"
        assert info["avg_spec_accept_length"] > 1.0
    finally:
        terminate_process(proc)
        log.close()

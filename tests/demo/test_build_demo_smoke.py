"""`specserve build-demo` end to end at a tiny scale (a few steps per stage, a spread of 40 corpus files): every
folder is written in the served formats and each algorithm runs on it losslessly."""

from __future__ import annotations

import os

import pytest

from specserve import Engine
from specserve.cli import main as cli_main
from specserve.demo_models import DEMO_NAMES

GREEDY = {"max_new_tokens": 12, "temperature": 0}
PROMPT = "def mean(data):\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo-build"))
    work = str(tmp_path_factory.mktemp("demo-work"))
    rc = cli_main(["build-demo", "--out", out, "--work-dir", work, "--scale", "0.002", "--max-corpus-files", "40",
                   "--no-progress", "--device", "cpu"])
    assert rc == 0
    return out, work


def test_every_folder_and_marker_is_written(built):
    out, work = built
    for name in DEMO_NAMES:
        assert os.path.isfile(os.path.join(out, name, "config.json")), name
        assert os.path.isfile(os.path.join(out, name, "model.safetensors")), name
    assert os.path.isfile(os.path.join(out, "demo", "fr_spec_1024.pt"))
    assert os.path.isfile(os.path.join(out, "demo", "tokenizer.json"))
    assert sorted(f for f in os.listdir(work) if f.endswith(".done")) == sorted(
        f"{s}.done" for s in ("tokenizer", "target", "eagle", "eagle3", "token-map", "draft", "mtp"))
    # a second run skips every finished stage (and so returns at once)
    assert cli_main(["build-demo", "--out", out, "--work-dir", work, "--no-progress"]) == 0


@pytest.mark.parametrize("draft,extra", [
    ("demo-eagle", {"speculative_algorithm": "EAGLE"}),
    ("demo-eagle", {"speculative_algorithm": "EAGLE", "speculative_token_map": "fr"}),
    ("demo-eagle3", {"speculative_algorithm": "EAGLE3"}),
    ("demo-draft", {"speculative_algorithm": "STANDALONE"}),
    (None, {"speculative_algorithm": "EAGLE"}),  # MTP: demo-mtp drafts with its own layer
])
def test_each_algorithm_serves_the_built_folders_losslessly(built, draft, extra):
    out, _ = built
    target = os.path.join(out, "demo-mtp" if draft is None else "demo")
    kw = dict(extra, speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    if draft is not None:
        kw["speculative_draft_model_path"] = os.path.join(out, draft)
    if kw.get("speculative_token_map") == "fr":
        kw["speculative_token_map"] = os.path.join(out, "demo", "fr_spec_1024.pt")
    with Engine(model_path=target, dtype="float32") as e:  # float32: see test_bundled_demo.py
        want = e.generate(PROMPT, GREEDY)["output_ids"]
    with Engine(model_path=target, dtype="float32", **kw) as e:
        got = e.generate(PROMPT, GREEDY)
    assert got["output_ids"] == want
    assert got["meta_info"]["spec_verify_ct"] > 0

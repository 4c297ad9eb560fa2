"""`specserve build-demo --family smollm2` end to end at a tiny scale (a handful of prompts, a few training steps):
every stage writes its output in the served formats, and the EAGLE-3 and EAGLE-2 heads and the STANDALONE draft it
trains load and draft for SmolLM2 losslessly (the EAGLE-2 head with the FR-Spec map it writes; the draft without
tokenizer files). (A few steps teach a drafter nothing: acceptance is tested on the bundled, fully trained ones.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import Engine
from specserve.cli import main as cli_main
from specserve.demo_models import SMOLLM2_HELD_OUT

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("smollm2-build"))
    work = str(tmp_path_factory.mktemp("smollm2-work"))
    rc = cli_main(["build-demo", "--family", "smollm2", "--out", out, "--work-dir", work, "--scale", "0.004",
                   "--no-progress", "--device", "cpu"])
    assert rc == 0
    return out, work


def test_every_stage_writes_its_output(built):
    out, work = built
    assert sorted(f for f in os.listdir(work) if f.endswith(".done")) == sorted(
        f"{s}.done" for s in ("data", "features", "eagle3", "eagle", "token-map", "draft"))
    assert os.path.isfile(os.path.join(work, "features-0.pt"))  # a smoke build writes one shard
    with open(os.path.join(work, "train-0.jsonl")) as f:
        train = [json.loads(line) for line in f]
    assert train and all(r["completion"] and r["prompt"] for r in train)
    held = os.path.join(out, SMOLLM2_HELD_OUT)
    assert os.path.isfile(held)
    with open(held) as f:
        assert not {json.loads(line)["prompt"] for line in f} & {r["prompt"] for r in train}
    with open(os.path.join(out, "smollm2-eagle3", "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 8192
    with open(os.path.join(out, "smollm2-eagle", "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["hidden_size"] == 576
    with open(os.path.join(out, "smollm2-draft", "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 49152 and cfg["hidden_size"] == 96
    assert sorted(os.listdir(os.path.join(out, "smollm2-draft"))) == ["config.json", "model.safetensors"]
    ids = torch.load(os.path.join(out, "smollm2-fr-spec", "freq_8192.pt"))
    assert ids.numel() == 8192 and ids.unique().numel() == 8192
    # the trainer's loss mask: the rows whose next token is an answer's, the first of them the header's last token
    from transformers import AutoTokenizer

    from specserve.train.chat_demo import ChatBuild, assistant_markers, load_features

    build = ChatBuild(out, work, "cpu", False, 0.004, False)
    cache = load_features(build, answers_only=True)
    open_ids, close_id = assistant_markers(AutoTokenizer.from_pretrained(build.target))
    assert 0.1 < cache.mask.float().mean().item() < 0.98  # answers: their share follows what the target wrote
    first = int(cache.mask.int().argmax())
    assert cache.tokens[first - len(open_ids) + 1 : first + 1].tolist() == open_ids
    # a second run of the same build skips every finished stage
    assert cli_main(["build-demo", "--family", "smollm2", "--out", out, "--work-dir", work, "--scale", "0.004",
                     "--no-progress"]) == 0


def test_the_heads_load_and_draft_for_smollm2_losslessly(built):
    out, work = built
    with open(os.path.join(work, "train-0.jsonl")) as f:
        prompt = json.loads(f.readline())["prompt"]
    params = {"max_new_tokens": 24, "temperature": 0}
    msgs = [{"role": "user", "content": prompt}]
    with Engine(model_path="smollm2", dtype="float32") as e:
        text = e.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        want = e.generate(text, params)["output_ids"]
    tree = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4,
                disable_speculative_auto_off=True)
    with Engine(model_path="smollm2", dtype="float32", speculative_algorithm="EAGLE3",
                speculative_draft_model_path=os.path.join(out, "smollm2-eagle3"), **tree) as e:
        got = e.generate(text, params)
    with Engine(model_path="smollm2", dtype="float32", speculative_algorithm="EAGLE",
                speculative_draft_model_path=os.path.join(out, "smollm2-eagle"),
                speculative_token_map=os.path.join(out, "smollm2-fr-spec", "freq_8192.pt"), **tree) as e:
        got2 = e.generate(text, params)
    with Engine(model_path="smollm2", dtype="float32", speculative_algorithm="STANDALONE",
                speculative_draft_model_path=os.path.join(out, "smollm2-draft"), **tree) as e:
        got3 = e.generate(text, params)
    for got_k in (got, got2, got3):
        assert got_k["output_ids"] == want
        assert got_k["meta_info"]["spec_verify_ct"] > 0


def test_unknown_stage_names_the_family(capsys):
    assert cli_main(["build-demo", "--family", "smollm2", "--stages", "target"]) == 2
    assert "--family smollm2" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--family", "smollm2", "--data-shards", "0"],
                                  ["--family", "code", "--data-shards", "2"]])
def test_data_shards_is_a_count_for_smollm2(argv, capsys):
    assert cli_main(["build-demo", *argv]) == 2
    assert "--data-shards" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--family", "code", "--data-from", "."],
                                  ["--family", "smollm2", "--data-from", "/no/such/folder"]])
def test_data_from_is_a_folder_for_smollm2(argv, capsys):
    assert cli_main(["build-demo", *argv]) == 2
    assert "--data-from" in capsys.readouterr().err


def test_import_shards_copies_missing_shards_gzipped_or_not(tmp_path):
    """Shards a folder holds (gzipped or plain) are copied into the work folder, decompressed, where it has none;
    a shard the work folder already has is kept, and one the folder lacks a file of is left to the data stage."""
    import gzip

    from specserve.train.chat_demo import import_shards
    from specserve.train.selfgen import Sample, read_jsonl, write_jsonl

    src, work = tmp_path / "src", tmp_path / "work"
    src.mkdir()
    work.mkdir()
    shard = {k: [Sample(f"question {k}", "chat", "t", f"answer {k}", "stop")] for k in range(4)}
    held = {k: [Sample(f"held {k}", "chat", "t")] for k in range(4)}
    write_jsonl(str(src / "train-0.jsonl"), shard[0])  # plain
    write_jsonl(str(src / "held-0.jsonl"), held[0])
    for k in (1, 2):  # gzipped
        for name, samples in ((f"train-{k}.jsonl", shard[k]), (f"held-{k}.jsonl", held[k])):
            write_jsonl(str(tmp_path / name), samples)
            (src / (name + ".gz")).write_bytes(gzip.compress((tmp_path / name).read_bytes()))
    write_jsonl(str(src / "train-3.jsonl"), shard[3])  # no held file: not a whole shard
    mine = [Sample("already here", "chat", "t", "kept", "stop")]
    write_jsonl(str(work / "train-2.jsonl"), mine)

    assert import_shards(str(src), str(work), 4) == [0, 1]
    assert read_jsonl(str(work / "train-0.jsonl")) == shard[0]
    assert read_jsonl(str(work / "train-1.jsonl")) == shard[1]
    assert read_jsonl(str(work / "held-1.jsonl")) == held[1]
    assert read_jsonl(str(work / "train-2.jsonl")) == mine
    assert not (work / "train-3.jsonl").exists()
    assert sorted(os.listdir(work)) == ["held-0.jsonl", "held-1.jsonl", "train-0.jsonl", "train-1.jsonl",
                                        "train-2.jsonl"]


def test_asking_for_more_shards_runs_the_stages_again(tmp_path):
    """A stage's marker records the number of data shards it was done for: the same number skips it, another runs
    it again (each shard file already written is kept by the stage itself); an older build's bare marker counts
    for any number."""
    from specserve.train.chat_demo import ChatBuild
    from specserve.train.demo import build

    runs = []
    funcs = {"data": lambda b: runs.append(b.shards())}

    def run(shards: int) -> None:
        b = ChatBuild(str(tmp_path / "out"), str(tmp_path / "work"), "cpu", False, 1.0, False, data_shards=shards)
        build(b, ["data"], funcs)

    for shards in (3, 3, 4, 4):
        run(shards)
    assert runs == [3, 4]
    (tmp_path / "work" / "data.done").write_text("done\n")
    run(5)
    assert runs == [3, 4]

"""The trainers end to end on tiny models: the output loads in the server with greedy equality to no speculation,
drafting happens, a trained head beats an untrained one, runs are deterministic and resumable, bad flags fail."""

from __future__ import annotations

import os

import pytest
import torch

from specserve import Engine
from specserve.cli import main as cli_main
from specserve.speculative.accept_stats import accept_length
from specserve.test.tiny import corpus_text, make_mimo_dir
from specserve.train.eagle import EagleOptions, EagleTrainer, train_eagle
from specserve.train.loop import TrainConfig
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

PROMPTS = ["def mean(data):", "import os\nclass Path:", "    return self._", "for i in range(10):"]
GREEDY = {"max_new_tokens": 24, "temperature": 0}
HEAD_TRAIN = TrainConfig(steps=120, batch_size=8, seq_len=32, lr=2e-2, warmup_steps=10, checkpoint_every=1000,
                         progress=False, bf16=False)


def _plain(target: str) -> list[list[int]]:
    with Engine(model_path=target) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, GREEDY)]


def _spec(target: str, algorithm: str, draft: str | None, **extra) -> list[dict]:
    # speculate every step: these tests compare acceptance (batch-aware auto-off would turn a poor head off)
    with Engine(model_path=target, **spec_kwargs(algorithm, draft, 3, 1, 4, disable_speculative_auto_off=True,
                                                 **extra)) as e:
        return e.generate(PROMPTS, GREEDY)


def _accept_length(outs: list[dict]) -> float:
    return accept_length([o["meta_info"] for o in outs])


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_trained_head_is_lossless_and_beats_an_untrained_one(bigram_target, tokens, tmp_path, algorithm):
    trained, untrained = str(tmp_path / "trained"), str(tmp_path / "untrained")
    opts = EagleOptions(algorithm, draft_vocab_size=480)
    metrics = train_eagle(bigram_target, tokens, opts, HEAD_TRAIN, trained, dtype=torch.float32)
    assert metrics["acc0"] > 0.5, metrics
    # the same initialisation, exported before any step
    from specserve.models.loader import load_model, read_config

    target, _, _ = load_model(bigram_target, dtype="float32")
    EagleTrainer(target, read_config(bigram_target), opts, tokens, HEAD_TRAIN.seed, [1]).export(
        untrained, torch.float32, None)

    want = _plain(bigram_target)
    outs = _spec(bigram_target, algorithm, trained)
    assert [o["output_ids"] for o in outs] == want
    assert_drafting_happened(outs, min_accept_length=1.3)
    before = _spec(bigram_target, algorithm, untrained)
    assert [o["output_ids"] for o in before] == want
    print(f"{algorithm}: accept length trained {_accept_length(outs):.2f}, untrained {_accept_length(before):.2f}")
    assert _accept_length(outs) > _accept_length(before) + 0.3, (_accept_length(outs), _accept_length(before))


def test_eagle3_head_over_the_whole_vocabulary_exports_the_published_layout(bigram_target, tokens, tmp_path):
    """draft_vocab_size >= the target's vocabulary: the head trains through the target's LM head and is written with
    that LM head, an all-zero d2t and an all-true t2d (the published layout); it loads and drafts."""
    import json

    from safetensors import safe_open

    from specserve.models.loader import load_model

    out = str(tmp_path / "full-vocab")
    target, spec, _ = load_model(bigram_target, dtype="float32")
    metrics = train_eagle(bigram_target, tokens, EagleOptions("EAGLE3", draft_vocab_size=spec.vocab_size + 10),
                          HEAD_TRAIN, out, dtype=torch.float32)
    assert metrics["acc0"] > 0.3, metrics  # it learned (chance is ~1/vocab); the frozen LM head learns slower
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == spec.vocab_size
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), target.lm_head.weight.detach())
        assert not f.get_tensor("d2t").any() and f.get_tensor("d2t").numel() == spec.vocab_size
        assert f.get_tensor("t2d").all() and f.get_tensor("t2d").numel() == spec.vocab_size
    outs = _spec(bigram_target, "EAGLE3", out)
    assert [o["output_ids"] for o in outs] == _plain(bigram_target)
    assert_drafting_happened(outs, min_accept_length=1.3)


def _cli_train(tmp_path, target: str, data: str, out: str, *extra: str) -> int:
    return cli_main(["train-eagle", "--target", target, "--data", data, "--out", out, "--batch-size", "4",
                     "--seq-len", "32", "--no-progress", "--no-bf16", "--dtype", "float32", *extra])


def test_cli_train_eagle_is_deterministic_and_resumable(bigram_target, tmp_path):
    from specserve.train.loop import STATE_FILE

    data = tmp_path / "data.txt"
    data.write_text(corpus_text(20_000))
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    args = ("--algorithm", "EAGLE3", "--draft-vocab-size", "256", "--checkpoint-every", "2", "--seed", "7",
            "--steps", "6")
    assert _cli_train(tmp_path, bigram_target, str(data), full, *args) == 0
    # the same run stopped after 3 steps, then resumed, ends bit-for-bit where the uninterrupted run did
    assert _cli_train(tmp_path, bigram_target, str(data), split, *args, "--stop-after", "3") == 0
    mid = torch.load(os.path.join(split, ".trainer", STATE_FILE), weights_only=False)
    assert mid["step"] == 3
    assert _cli_train(tmp_path, bigram_target, str(data), split, *args, "--resume") == 0
    want = torch.load(os.path.join(full, ".trainer", STATE_FILE), weights_only=False)
    got = torch.load(os.path.join(split, ".trainer", STATE_FILE), weights_only=False)
    assert got["step"] == want["step"] == 6
    changed = [k for k, v in want["model"].items() if not torch.equal(v, mid["model"][k])]
    assert changed, "training did not change the head"
    for k, v in want["model"].items():
        assert torch.equal(v, got["model"][k]), k
    # the written head loads and drafts losslessly
    outs = _spec(bigram_target, "EAGLE3", full)
    assert [o["output_ids"] for o in outs] == _plain(bigram_target)


def test_cli_accepts_jsonl_chat_data(bigram_target, tmp_path):
    jsonl = tmp_path / "chat.jsonl"
    record = '{"messages": [{"role": "user", "content": "write f"}, {"role": "assistant", "content": "def f(): ' \
             'return 1"}]}\n'
    jsonl.write_text(record * 20)
    out = str(tmp_path / "chat")
    assert _cli_train(tmp_path, bigram_target, str(jsonl), out, "--algorithm", "EAGLE", "--steps", "2",
                      "--seq-len", "16") == 0
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("bad,flag", [(["--steps", "0"], "--steps"), (["--algorithm", "MEDUSA"], "--algorithm")])
def test_cli_bad_flags_fail_naming_the_flag(bigram_target, tmp_path, capsys, bad, flag):
    data = tmp_path / "d.txt"
    data.write_text("x = 1\n" * 50)
    try:
        rc = _cli_train(tmp_path, bigram_target, str(data), str(tmp_path / "o"), *bad)
    except SystemExit as e:  # argparse choices
        rc = e.code
    assert rc == 2
    assert flag in capsys.readouterr().err


def test_cli_missing_data_file(bigram_target, tmp_path, capsys):
    assert _cli_train(tmp_path, bigram_target, str(tmp_path / "nope.txt"), str(tmp_path / "o")) == 2
    assert "--data: no such file" in capsys.readouterr().err


def test_train_draft_gives_a_lossless_standalone_draft(bigram_target, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text(corpus_text(30_000))
    out = str(tmp_path / "draft")
    rc = cli_main(["train-draft", "--target", bigram_target, "--data", str(data), "--out", out, "--steps", "60",
                   "--batch-size", "8", "--seq-len", "32", "--hidden-size", "128", "--num-layers", "1",
                   "--lr", "5e-3", "--no-progress", "--no-bf16", "--dtype", "float32"])
    assert rc == 0
    outs = _spec(bigram_target, "STANDALONE", out)
    assert [o["output_ids"] for o in outs] == _plain(bigram_target)
    assert_drafting_happened(outs)  # (a from-scratch student learns slowly; the demo's draft shows the signal)


def test_train_mtp_trains_the_mtp_layer_losslessly(tokenizer_dir, tmp_path):
    mimo = make_mimo_dir(str(tmp_path / "mimo"), kind="random", tokenizer_dir=tokenizer_dir,
                         max_position_embeddings=1024, identity_layers=True)
    data = tmp_path / "data.txt"
    data.write_text(corpus_text(30_000))
    out = str(tmp_path / "mimo-trained")
    before = _spec(mimo, "EAGLE", None)
    rc = cli_main(["train-mtp", "--target", mimo, "--data", str(data), "--out", out, "--steps", "80",
                   "--batch-size", "8", "--seq-len", "32", "--lr", "5e-3", "--no-progress", "--no-bf16",
                   "--dtype", "float32"])
    assert rc == 0
    outs = _spec(out, "EAGLE", None)
    assert [o["output_ids"] for o in outs] == _plain(mimo) == [o["output_ids"] for o in before]
    assert _accept_length(outs) > _accept_length(before) + 0.3, (_accept_length(outs), _accept_length(before))

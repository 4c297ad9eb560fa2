"""FR-Spec token maps: loading and validation, building from token frequencies (hand-derived), the hot LM-head
rows (plain, tied, oneDNN-packed), the CLI, and the lossless gate with EAGLE + a token map."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specserve import Engine
from specserve.cli import main as cli_main
from specserve.config import ConfigError
from specserve.models.direct_call import Linear
from specserve.models.loader import load_model
from specserve.platform.cpu.packing import PackedLinear, pack_linears_for_cpu
from specserve.speculative.token_map import (
    HotVocabHead,
    count_token_ids,
    lm_head_rows,
    load_token_map,
    read_checkpoint_rows,
    save_token_map,
    select_hot_ids,
    validate_token_map,
)
from specserve.test.tiny import corpus_text, make_eagle_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy, needs_onednn_bf16
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

FLAG = "--speculative-token-map"


# ---------------------------------------------------------------------------------------------- load / validate
@pytest.mark.parametrize("obj, phrase", [
    (torch.tensor([[1, 2], [3, 4]]), "1-D"),
    (torch.tensor([1.0, 2.0]), "integer"),
    (torch.tensor([True, False]), "integer"),
    (torch.tensor([], dtype=torch.int64), "empty"),
    (torch.tensor([3, 5, 3]), "repeats token id 3"),
    (torch.tensor([0, 10]), "token id 10, outside the target vocabulary [0, 10)"),
    (torch.tensor([-1, 2]), "token id -1"),
    ({"ids": [1, 2]}, "1-D integer tensor"),
    ([1, 2.5], "1-D integer tensor"),
])
def test_invalid_maps_are_rejected_naming_the_flag(obj, phrase):
    with pytest.raises(ConfigError) as err:
        validate_token_map(obj, vocab_size=10)
    assert str(err.value).startswith(FLAG)
    assert phrase in str(err.value)


def test_map_smaller_than_topk_is_rejected():
    with pytest.raises(ConfigError, match="2 token ids, fewer than the 4 drafted per step"):
        validate_token_map(torch.tensor([4, 1]), vocab_size=10, min_size=4)


def test_load_roundtrip_and_int_list(tmp_path):
    path = str(tmp_path / "sub" / "map.pt")
    save_token_map(torch.tensor([7, 2, 9], dtype=torch.int32), path)
    ids = load_token_map(path, vocab_size=10)
    assert ids.dtype == torch.int64 and ids.tolist() == [7, 2, 9]  # order kept
    torch.save([5, 0, 3], str(tmp_path / "list.pt"))
    assert load_token_map(str(tmp_path / "list.pt"), vocab_size=10).tolist() == [5, 0, 3]


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match=f"^{FLAG}: .* does not exist"):
        load_token_map(str(tmp_path / "nope.pt"), vocab_size=10)
    with pytest.raises(ConfigError, match=f"^{FLAG}: .*not in the local Hugging Face cache"):
        load_token_map("no-such-owner/no-such-repo/freq_32768.pt", vocab_size=10)
    bad = tmp_path / "bad.pt"
    bad.write_text("not a torch file")
    with pytest.raises(ConfigError, match=f"^{FLAG}: cannot read"):
        load_token_map(str(bad), vocab_size=10)
    out_of_range = str(tmp_path / "big.pt")
    save_token_map(torch.tensor([1, 99]), out_of_range)
    with pytest.raises(ConfigError, match="99, outside the target vocabulary"):
        load_token_map(out_of_range, vocab_size=50)


# ---------------------------------------------------------------------------------------------- counting
def test_count_and_select_hand_checked():
    counts = count_token_ids([[3, 1, 3], [2, 3, 1], [], [5]], vocab_size=6)
    assert counts.tolist() == [0, 2, 1, 3, 0, 1]
    assert select_hot_ids(counts, 3).tolist() == [3, 1, 2]  # 2 and 5 tie at 1: the lower id wins
    assert select_hot_ids(counts, 6).tolist() == [3, 1, 2, 5, 0, 4]  # unseen ids last, lowest first
    assert select_hot_ids(counts, 3, always_include=[4]).tolist() == [4, 3, 1]
    assert select_hot_ids(counts, 2, always_include=[0, 5]).tolist() == [5, 0]  # forced, by count
    with pytest.raises(ValueError, match="1..6"):
        select_hot_ids(counts, 7)
    with pytest.raises(ValueError, match="smaller than the 2 ids"):
        select_hot_ids(counts, 1, always_include=[0, 4])
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_token_ids([[1, 6]], vocab_size=6)


WORDS = ["<eos>", "<unk>", "the", "cat", "dog", "a", "sat", "<user>", "<assistant>"]


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    """A model folder with a word-level tokenizer (id = position in WORDS, split on spaces) and a config only,
    so token counts can be derived by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("words")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(d))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 12,
                                               "eos_token_id": 0}))
    return str(d)


@pytest.fixture(scope="module")
def word_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "plain.txt").write_text("the cat sat\nthe dog sat\nthe cat\na dog\n")
    records = [
        {"messages": [{"role": "user", "content": "a a a"}, {"role": "assistant", "content": "sat"}]},
        {"conversations": [{"from": "human", "value": "dog"}, {"from": "gpt", "value": "dog cat"}]},
        {"text": "a"},
    ]
    (d / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(d / "plain.txt"), str(d / "chat.jsonl")


def test_cli_builds_hand_derived_map(word_model, word_corpus, tmp_path):
    plain, chat = word_corpus
    # plain: the 3, cat 2, sat 2, dog 2, a 1 -> top 4 without EOS: the(2), then cat(3)/dog(4)/sat(6) tie: 3, 4
    out = str(tmp_path / "plain.pt")
    assert cli_main(["build-token-map", "--model", word_model, "--corpus", plain, "--size", "4", "--out", out,
                     "--no-eos"]) == 0
    assert load_token_map(out, vocab_size=12).tolist() == [2, 3, 4, 6]
    # + chat: <user> 2, a 3+1, <assistant> 2, sat 1, dog 2, cat 1 -> totals the 3, cat 3, dog 4, a 5, sat 3,
    # <user> 2, <assistant> 2; with EOS (id 0) forced first: [0, a(5), dog(4), the(2)] (the/cat/sat tie at 3)
    out = str(tmp_path / "both.pt")
    assert cli_main(["build-token-map", "--model", word_model, "--corpus", plain, chat, "--size", "4",
                     "--out", out]) == 0
    assert load_token_map(out, vocab_size=12).tolist() == [0, 5, 4, 2]


def test_cli_errors(word_model, word_corpus, tmp_path, capsys):
    plain, _ = word_corpus
    assert cli_main(["build-token-map", "--model", word_model, "--corpus", str(tmp_path / "x.txt"),
                     "--size", "4"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli_main(["build-token-map", "--model", word_model, "--corpus", plain, "--size", "13"]) == 2
    assert "--size must be in 1..12" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert cli_main(["build-token-map", "--model", word_model, "--corpus", str(bad), "--size", "4"]) == 2
    assert "bad.jsonl:1: expected a 'messages'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- hot LM-head rows
def test_read_checkpoint_rows_across_blocks(tmp_path):
    w = torch.arange(20, dtype=torch.float32).view(10, 2)  # row i = [2i, 2i + 1]
    save_file({"lm_head.weight": w, "other": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    rows = read_checkpoint_rows(str(tmp_path), "lm_head.weight", torch.tensor([7, 0, 3, 9, 4]), block=3)
    assert rows.tolist() == [[14, 15], [0, 1], [6, 7], [18, 19], [8, 9]]
    with pytest.raises(ConfigError, match="has no missing.weight"):
        read_checkpoint_rows(str(tmp_path), "missing.weight", torch.tensor([1]))


def _checkpoint_tensor(model_dir: str, name: str) -> torch.Tensor:
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("tied", [False, True])
@needs_onednn_bf16
def test_hot_rows_of_a_packed_bf16_head(model_factory, tied):
    """On CPU a bf16 LM head is replaced by a PackedLinear without a plain weight: the hot rows come from the
    checkpoint (untied) or the input embedding (tied), equal to the checkpoint's rows."""
    path = model_factory("llama", dtype=torch.bfloat16, tie_word_embeddings=tied)
    model, spec, model_dir = load_model(path, "auto", "cpu")
    assert pack_linears_for_cpu(model) > 0
    assert isinstance(model.lm_head, PackedLinear) and not hasattr(model.lm_head, "weight")
    ids = torch.tensor([300, 2, 77, 511, 0])
    rows = lm_head_rows(model, model_dir, spec.tie_word_embeddings, ids)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert torch.equal(rows, _checkpoint_tensor(path, name)[ids])


def test_hot_head_logits_are_the_target_logits_at_the_hot_ids(model_factory):
    path = model_factory("llama")
    model, spec, model_dir = load_model(path, "auto", "cpu")
    ids = torch.tensor([9, 400, 3, 128])
    head = HotVocabHead(lm_head_rows(model, model_dir, spec.tie_word_embeddings, ids), ids)
    hidden = torch.randn(6, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    logits, id_map = head(hidden)
    assert logits.shape == (6, 4) and logits.dtype == torch.float32
    assert id_map.tolist() == [9, 400, 3, 128]
    torch.testing.assert_close(logits, model.compute_logits(hidden)[:, ids])


# ---------------------------------------------------------------------------------------------- lossless gate
@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


def _record_drafts(engine: Engine) -> list[int]:
    """Wrap the proposer so every drafted (non-root, real) tree token is recorded."""
    proposer = engine.scheduler.decoder.proposer
    drafted: list[int] = []
    propose = proposer.propose

    def recording(reqs, shape=None):
        tree = propose(reqs, shape)
        real = tree.valid.clone()
        real[:, 0] = False
        drafted.extend(tree.tokens[real].tolist())
        return tree

    proposer.propose = recording
    return drafted


def _gate(target, head, token_map, plain, min_accept_length):
    kw = spec_kwargs("EAGLE", head, 4, 3, 8, speculative_token_map=token_map)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        drafted = _record_drafts(e)
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length)
        assert_no_kv_leak(e)
    return drafted


def test_gate_map_covering_the_output(target, self_head, plain, tmp_path, caplog):
    emitted = sorted({t for out in plain for t in out})
    hot = emitted + [i for i in range(40) if i not in emitted]
    path = str(tmp_path / "map.pt")
    save_token_map(torch.tensor(hot), path)
    with caplog.at_level(logging.INFO, logger="specserve.speculative.token_map"):
        drafted = _gate(target, self_head, path, plain, min_accept_length=1.5)
    assert f"restricted to {len(hot)} hot tokens" in caplog.text
    assert drafted and set(drafted) <= set(hot)


def test_gate_map_missing_emitted_tokens(target, self_head, plain, tmp_path):
    """Emitted tokens outside the map can never be drafted, only come as bonus tokens: output is unchanged."""
    emitted = sorted({t for out in plain for t in out})
    hot = emitted[::2]  # half the emitted tokens are missing
    path = str(tmp_path / "half.pt")
    save_token_map(torch.tensor(hot), path)
    drafted = _gate(target, self_head, path, plain, min_accept_length=1.0)
    assert drafted and set(drafted) <= set(hot)


def test_cli_map_loads_in_the_engine(target, self_head, plain, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text(60_000) + "".join(PROMPTS))
    out = str(tmp_path / "freq.pt")
    assert cli_main(["build-token-map", "--model", target, "--corpus", str(corpus), "--size", "256",
                     "--out", out]) == 0
    ids = load_token_map(out, vocab_size=512)
    assert ids.numel() == 256 and 1 in ids.tolist()  # the EOS id is forced in
    drafted = _gate(target, self_head, out, plain, min_accept_length=1.5)
    assert set(drafted) <= set(ids.tolist())


def test_token_map_smaller_than_topk_fails_at_start_up(target, self_head, tmp_path):
    path = str(tmp_path / "tiny.pt")
    save_token_map(torch.tensor([5, 6]), path)
    with pytest.raises(ConfigError, match=f"^{FLAG}: .*fewer than the 3 drafted per step"):
        Engine(model_path=target, max_total_tokens=4096,
               **spec_kwargs("EAGLE", self_head, 4, 3, 8, speculative_token_map=path))


@needs_onednn_bf16
def test_gate_bf16_target_with_packed_lm_head(model_factory, tmp_path):
    """bf16 on CPU with a bf16 draft: the target's LM head is a oneDNN PackedLinear (no plain weight), so the hot
    rows are read from the checkpoint and the hot head is packed too; output still equals plain decoding. (With
    the default --speculative-draft-dtype auto the hot head is a float32 copy:
    tests/speculative/test_draft_dtype.py.)"""
    path = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, dtype=torch.bfloat16)
    head = make_eagle_head_dir(str(tmp_path / "head"), path, kind="self")
    with Engine(model_path=path, max_total_tokens=4096) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
    hot = sorted({t for out in want for t in out} | set(range(40)))
    save_token_map(torch.tensor(hot), str(tmp_path / "map.pt"))
    kw = spec_kwargs("EAGLE", head, 4, 3, 8, speculative_token_map=str(tmp_path / "map.pt"),
                     speculative_draft_dtype="bfloat16")
    with Engine(model_path=path, max_total_tokens=4096, **kw) as e:
        proposer = e.scheduler.decoder.proposer
        assert isinstance(e.scheduler.runner.model.lm_head, PackedLinear)
        assert isinstance(proposer.hot_head.proj, PackedLinear)
        outs = e.generate(PROMPTS, greedy(24))
    assert [o["output_ids"] for o in outs] == want
    assert_drafting_happened(outs, min_accept_length=1.5)


def test_eagle3_ignores_the_token_map(model_factory, tmp_path, caplog):
    """EAGLE-3 heads have their own draft vocabulary: the flag is dropped with a warning. The map here is smaller
    than topk, so using it would fail at start-up; the output equals plain decoding and drafts are accepted."""
    from specserve.test.tiny import make_eagle3_head_dir

    path = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)
    head = make_eagle3_head_dir(str(tmp_path / "h3"), path, kind="self")
    save_token_map(torch.tensor([5, 6]), str(tmp_path / "map.pt"))
    with Engine(model_path=path, max_total_tokens=4096) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS, greedy(20))]
    kw = spec_kwargs("EAGLE3", head, 4, 3, 8, speculative_token_map=str(tmp_path / "map.pt"))
    with caplog.at_level(logging.WARNING, logger="specserve.config"):
        with Engine(model_path=path, max_total_tokens=4096, **kw) as e:
            assert e.scheduler.decoder.proposer.hot_head is None
            outs = e.generate(PROMPTS, greedy(20))
    assert "--speculative-token-map is ignored with EAGLE3" in caplog.text
    assert [o["output_ids"] for o in outs] == want
    assert_drafting_happened(outs, min_accept_length=1.2)


def test_gate_standalone_draft_restricted_to_the_map(target, plain, tmp_path):
    """STANDALONE restricts the DRAFT model's own LM head; a self-draft with a map covering the output accepts."""
    emitted = sorted({t for out in plain for t in out})
    path = str(tmp_path / "map.pt")
    save_token_map(torch.tensor(emitted + [i for i in range(40) if i not in emitted]), path)
    kw = spec_kwargs("STANDALONE", target, 3, 2, 5, speculative_token_map=path)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        drafted = _record_drafts(e)
        outs = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=2.0)
        assert_no_kv_leak(e)
    assert drafted and set(drafted) <= set(emitted) | set(range(40))


@pytest.mark.parametrize("disable", [False, True])
@needs_onednn_bf16
def test_standalone_hot_head_follows_the_packing_flag(model_factory, tmp_path, disable):
    """STANDALONE's hot head (from the draft model's own LM head) is packed like every other bf16 linear on CPU, and
    left plain under --disable-cpu-weight-packing."""
    path = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, dtype=torch.bfloat16)
    save_token_map(torch.arange(64), str(tmp_path / "map.pt"))
    kw = spec_kwargs("STANDALONE", path, 3, 2, 5, speculative_token_map=str(tmp_path / "map.pt"),
                     speculative_draft_dtype="bfloat16")
    with Engine(model_path=path, max_total_tokens=4096, disable_cpu_weight_packing=disable, **kw) as e:
        proj = e.scheduler.decoder.proposer.hot_head.proj
        assert (type(proj) is Linear) if disable else isinstance(proj, PackedLinear)

"""The feature cache a head trainer reads instead of running the target: its pieces on hand-checked inputs, its
features equal to the target's own forward, and a head trained from it lossless and better than untrained."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from specserve.attention.training import train_batch
from specserve.models.loader import load_model, read_config
from specserve.speculative.draft_models import eagle3_capture_layers
from specserve.train.eagle import EagleOptions, EagleTrainer, train_eagle
from specserve.train.features import (
    FeatureCache,
    FeatureShards,
    TopK,
    answer_mask,
    build_feature_cache,
    gather_rows,
    label_mask,
    length_batches,
    topk_cross_entropy,
)
from tests.speculative.helpers import assert_drafting_happened
from tests.train.test_trainers import HEAD_TRAIN, _accept_length, _plain, _spec


def test_topk_cross_entropy_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    # row 0: label mass split evenly over ids 0 and 2; row 1: ids 2 and (absent) -1 -> all on id 2
    label = TopK(torch.tensor([[0, 2], [2, -1]]), torch.tensor([[0.0, 0.0], [1.0, 5.0]]))
    want0 = -(0.5 * math.log(0.5) + 0.5 * math.log(0.25))
    want1 = -math.log(0.8)
    got = topk_cross_entropy(logits, label, torch.tensor([True, True]))
    assert got.item() == pytest.approx((want0 + want1) / 2, rel=1e-6)
    assert topk_cross_entropy(logits, label, torch.tensor([False, True])).item() == pytest.approx(want1, rel=1e-6)


def test_topk_row_with_no_present_id_counts_zero():
    label = TopK(torch.tensor([[-1, -1]]), torch.tensor([[1.0, 2.0]]))
    assert topk_cross_entropy(torch.zeros(1, 3), label, torch.tensor([True])).item() == 0.0


def test_topk_shift_and_map():
    ids = torch.arange(8).view(1, 4, 2)  # [B=1, L+1=4, k=2]
    top = TopK(ids, ids.float())
    s = top.shifted(1, 3)  # row i -> label of row i + 2, wrapping past the end
    assert s.ids.tolist() == [[4, 5], [6, 7], [0, 1]]
    index = torch.tensor([-1, 0, -1, 1, -1, -1, 2, -1])
    assert s.mapped(index).ids.tolist() == [[-1, -1], [2, -1], [-1, 0]]


def test_length_batches_by_hand():
    # sorted by length: 1(2) 3(3) 0(5) 2(9); max 10 padded tokens per group
    assert length_batches([5, 2, 9, 3], 10) == [[0], [1, 3], [2]]
    assert length_batches([4, 4, 4], 8) == [[0, 1], [2]]
    assert length_batches([20], 8) == [[0]]


def test_cached_features_equal_each_sequence_run_alone(bigram_target):
    target, spec, _ = load_model(bigram_target, dtype="float32")
    capture = eagle3_capture_layers(spec.num_layers, None)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 5)]
    cache = build_feature_cache(target, seqs, capture, top_k=4, max_tokens=64, bf16=False, progress=False)
    assert cache.tokens.tolist() == [t for s in seqs for t in s]
    start = 0
    with torch.no_grad():
        for s in seqs:
            out = target(train_batch(torch.tensor([s]), capture_layers=capture))
            n = len(s)
            torch.testing.assert_close(cache.feats[start : start + n].float(), out.hidden.bfloat16().float())
            aux = torch.cat(out.aux_hidden, -1).bfloat16().float()
            torch.testing.assert_close(cache.aux[start : start + n].float(), aux)
            top = out.logits.topk(4, dim=-1)
            assert torch.equal(cache.top.ids[start : start + n].long(), top.indices)
            torch.testing.assert_close(cache.top.logits[start : start + n], top.values)
            start += n


def test_gather_rows_reads_the_concatenation_without_making_it():
    parts = [torch.tensor([[0, 0], [1, 1]]), torch.tensor([[2, 2]]), torch.tensor([[3, 3], [4, 4], [5, 5]])]
    starts = torch.tensor([0, 2, 3])
    idx = torch.tensor([[5, 0, 2], [1, 3, 4]])
    assert gather_rows(parts, starts, idx).tolist() == [[[5, 5], [0, 0], [2, 2]], [[1, 1], [3, 3], [4, 4]]]


def test_shards_read_in_place_give_the_windows_of_the_cache_of_all(bigram_target, tmp_path):
    target, spec, _ = load_model(bigram_target, dtype="float32")
    capture = eagle3_capture_layers(spec.num_layers, None)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in (6, 9, 4, 7)]

    def build(ss):
        return build_feature_cache(target, ss, capture, top_k=3, bf16=False, progress=False)

    whole = build(seqs)
    for k, part in enumerate((seqs[:1], seqs[1:3], seqs[3:])):
        build(part).save(str(tmp_path / f"f{k}.pt"))
    shards = FeatureCache.concat([FeatureCache.load(str(tmp_path / f"f{k}.pt"), mmap=True) for k in range(3)])
    assert isinstance(shards, FeatureShards) and len(shards) == len(whole) == 26
    assert torch.equal(shards.tokens, whole.tokens)
    for step in range(4):  # windows of 8 rows over 26 cross the shards' boundaries
        for a, b in zip(shards.window(3, 7, 0, step), whole.window(3, 7, 0, step), strict=True):
            if isinstance(a, TopK):
                assert torch.equal(a.ids, b.ids)
                torch.testing.assert_close(a.logits, b.logits)
            elif a is not None:
                torch.testing.assert_close(a, b)
    one = build(seqs)
    assert FeatureCache.concat([one]) is one


def _unroll_inputs(bigram_target, tokens, algorithm, seq=16):
    """A trainer and one batch of 2 windows through the target: (trainer, x, z, feats, hidden, cfg, vocab)."""
    target, spec, _ = load_model(bigram_target, dtype="float32")
    trainer = EagleTrainer(target, read_config(bigram_target), EagleOptions(algorithm, draft_vocab_size=480), tokens,
                           0, [1])
    x = tokens[:2 * (seq + 1)].view(2, seq + 1).long()
    with torch.no_grad():
        out = target(train_batch(x, capture_layers=trainer.capture))
    z = out.logits.view(2, seq + 1, -1)
    feats = out.hidden.view(2, seq + 1, -1)
    hidden = (torch.cat(out.aux_hidden, -1).view(2, seq + 1, -1) if trainer.capture else feats)[:, :seq]
    return trainer, x, z, feats, hidden.reshape(2 * seq, -1), replace(HEAD_TRAIN, seq_len=seq), spec.vocab_size


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_topk_labels_over_the_whole_vocabulary_give_the_dense_loss(bigram_target, tokens, algorithm):
    """The cached path's label (the top k ids) with k = the vocabulary is the dense soft label: same loss."""
    trainer, x, z, feats, hidden, cfg, vocab = _unroll_inputs(bigram_target, tokens, algorithm)
    top = z.topk(vocab, dim=-1)
    with torch.no_grad():
        dense, dm = trainer._unroll(x, z, feats, hidden, cfg)
        sparse, sm = trainer._unroll(x, TopK(top.indices, top.values), feats, hidden, cfg)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    assert sm == dm


def test_answer_mask_by_hand():
    # 7 8 = the assistant header, 9 = end of turn
    tokens = torch.tensor([1, 7, 8, 4, 5, 9, 3, 7, 8, 6, 9, 2, 7, 8, 4])
    want = [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1]  # an unfinished last answer runs to the end
    assert answer_mask(tokens, [7, 8], 9).int().tolist() == want
    assert answer_mask(torch.tensor([7]), [7, 8], 9).tolist() == [False]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_a_loss_mask_keeps_only_the_rows_it_marks(bigram_target, tokens, algorithm):
    """An all-true mask is no mask, an all-false one leaves no loss; label_mask moves a token mask to the rows that
    predict those tokens."""
    trainer, x, z, feats, hidden, cfg, _ = _unroll_inputs(bigram_target, tokens, algorithm)
    with torch.no_grad():
        plain, _ = trainer._unroll(x, z, feats, hidden, cfg)
        same, _ = trainer._unroll(x, z, feats, hidden, cfg, torch.ones(x.shape, dtype=torch.bool))
        none, _ = trainer._unroll(x, z, feats, hidden, cfg, torch.zeros(x.shape, dtype=torch.bool))
    torch.testing.assert_close(same, plain)
    assert none.item() == 0.0
    assert label_mask(torch.tensor([False, True, True, False])).tolist() == [True, True, False, False]


def test_head_trained_from_a_feature_cache_is_lossless_and_learns(bigram_target, tokens, tmp_path):
    target, spec, _ = load_model(bigram_target, dtype="float32")
    capture = eagle3_capture_layers(spec.num_layers, None)
    seqs = [tokens[i : i + 200].tolist() for i in range(0, 20_000, 200)]
    # this target's next-token distributions are nearly flat (random weights): a label kept to a few ids carries
    # little of them, so the cache keeps more than a real model needs
    cache = build_feature_cache(target, seqs, capture, top_k=64, bf16=False, progress=False)
    out = str(tmp_path / "cached")
    metrics = train_eagle(bigram_target, None, EagleOptions("EAGLE3", draft_vocab_size=480), HEAD_TRAIN, out,
                          dtype=torch.float32, cache=cache)
    assert metrics["acc0"] > 0.3, metrics  # chance: 1/480
    untrained = str(tmp_path / "untrained")
    opts = EagleOptions("EAGLE3", draft_vocab_size=480)
    EagleTrainer(target, read_config(bigram_target), opts, cache.tokens, HEAD_TRAIN.seed, [1]).export(
        untrained, torch.float32, None)
    want = _plain(bigram_target)
    outs, before = _spec(bigram_target, "EAGLE3", out), _spec(bigram_target, "EAGLE3", untrained)
    assert [o["output_ids"] for o in outs] == want
    assert_drafting_happened(outs)
    print(f"accept length trained {_accept_length(outs):.2f}, untrained {_accept_length(before):.2f}")
    assert _accept_length(outs) > _accept_length(before) + 0.1, (_accept_length(outs), _accept_length(before))


def test_distilling_from_a_feature_cache_is_distilling_from_the_teacher(bigram_target, tokens, tmp_path):
    """The bigram target's distributions do not depend on context, so a cache of its outputs over one sequence (top
    k = the whole vocabulary) labels every window as the teacher itself would: the same run, step for step."""
    from specserve.train.lm import distill

    target, spec, _ = load_model(bigram_target, dtype="float32")
    stream = tokens[:1000]
    cache = build_feature_cache(target, [stream.tolist()], (), top_k=spec.vocab_size, bf16=False, progress=False)
    cfg = replace(HEAD_TRAIN, steps=3, seq_len=16, batch_size=2)
    config = read_config(bigram_target)
    config.update(num_hidden_layers=1)
    online = distill(target, config, stream, cfg, str(tmp_path / "a"), bigram_target, dtype=torch.float32)
    cached = distill(None, config, None, cfg, str(tmp_path / "b"), bigram_target, dtype=torch.float32, cache=cache)
    assert cached["top1_agree"] == online["top1_agree"]
    assert cached["loss"] == pytest.approx(online["loss"], rel=1e-4)

"""Pure pieces of the trainers: the TTT step mask, pool-free forwards, export round trip, LR schedule, windows,
draft vocabulary maps, held-out corpus split."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.attention.training import step_mask, train_batch
from specserve.models.loader import load_model
from specserve.train.corpus import HELD_OUT, held_out_prompts, sample_windows, stdlib_files
from specserve.train.eagle import d2t_t2d, draft_vocabulary
from specserve.train.export import checkpoint_tensors, save_folder
from specserve.train.loop import TrainConfig


def test_step_mask_hand_checked():
    m = step_mask(3, 2, "cpu").int().tolist()
    #            step 0 keys (causal)  step 1 keys (own anchor only)
    assert m == [[1, 0, 0, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0],
                 [1, 1, 1, 0, 0, 1]]
    assert step_mask(2, 1, "cpu").int().tolist() == [[1, 0], [1, 1]]


def test_poolless_forward_matches_transformers_at_every_position(llama_dir):
    """The training forward (no KV pool, causal within each sequence) gives the reference model's logits."""
    import transformers

    model, _spec, _ = load_model(llama_dir, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 33, 7, 2, 81], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        ours = model(train_batch(ids)).logits.view(2, 6, -1)
        want = ref(ids).logits
    torch.testing.assert_close(ours, want, atol=2e-4, rtol=2e-4)


def test_export_round_trip_restores_every_parameter(llama_dir, tmp_path):
    model, _spec, _ = load_model(llama_dir, dtype="float32")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    from specserve.models.loader import read_config

    save_folder(str(tmp_path), read_config(llama_dir), checkpoint_tensors(model), torch.float32, llama_dir)
    again, _, _ = load_model(str(tmp_path), dtype="float32")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert os.path.isfile(tmp_path / "tokenizer.json")


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(0.1)
    assert cfg.lr_at(9) == pytest.approx(1.0)
    assert cfg.lr_at(10) == pytest.approx(1.0)
    assert cfg.lr_at(55) == pytest.approx(0.55)
    assert cfg.lr_at(100) == pytest.approx(0.1)


def test_windows_are_a_pure_function_of_seed_and_step():
    tokens = torch.arange(1000, dtype=torch.int32)
    a = sample_windows(tokens, 4, 16, seed=3, step=7)
    assert a.shape == (4, 17) and torch.equal(a, sample_windows(tokens, 4, 16, seed=3, step=7))
    assert not torch.equal(a, sample_windows(tokens, 4, 16, seed=3, step=8))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 16, dtype=torch.long))  # contiguous windows
    with pytest.raises(ValueError, match="fewer than one window"):
        sample_windows(tokens[:10], 1, 16, 0, 0)


def test_draft_vocabulary_and_maps():
    tokens = torch.tensor([5, 5, 5, 2, 2, 7, 9, 9, 9, 9], dtype=torch.int32)
    ids = draft_vocabulary(tokens, vocab_size=10, size=3, always=[1])
    assert ids.tolist() == [1, 5, 9]  # the two most frequent + the forced EOS, ascending
    d2t, t2d = d2t_t2d(ids, 10)
    assert d2t.tolist() == [1, 4, 7]  # target id = draft id + d2t
    assert t2d.nonzero().flatten().tolist() == [1, 5, 9]


def test_held_out_modules_stay_out_of_the_training_files():
    train = stdlib_files()
    held = stdlib_files(held_out=True)
    assert train and held and not set(train) & set(held)
    names = {os.path.basename(p) for p in held}
    assert {"heapq.py", "bisect.py"} <= names
    assert not any(os.path.basename(p) in ("heapq.py", "bisect.py") and "/test" not in p for p in train)
    prompts = held_out_prompts(5)
    assert len(prompts) == 5 and all(p.rstrip().endswith(":") and "def " in p.splitlines()[-1] for p in prompts)
    assert len(HELD_OUT) >= 5

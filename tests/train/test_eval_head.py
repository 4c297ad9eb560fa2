"""``specserve eval-head``: the row masks by hand, the step-0 agreement equal to a direct forward of the head, and
the command end to end on a tiny target with a trained head."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.training import StepKV, train_batch
from specserve.bench.eval_head import Agreement, head_agreement, head_architectures, row_masks
from specserve.cli import main as cli_main
from specserve.models.loader import load_model, read_config
from specserve.speculative.heads.eagle3 import Eagle3Head
from specserve.train.eagle import EagleOptions, EagleTrainer, train_eagle
from specserve.train.features import build_feature_cache
from tests.train.test_trainers import HEAD_TRAIN


@pytest.fixture(scope="module")
def heads(bigram_target, tokens, tmp_path_factory) -> dict[str, str]:
    """An EAGLE and an EAGLE-3 head trained on the bigram target (folders)."""
    out = {}
    for algorithm in ("EAGLE", "EAGLE3"):
        d = str(tmp_path_factory.mktemp(f"head-{algorithm}"))
        train_eagle(bigram_target, tokens, EagleOptions(algorithm, draft_vocab_size=480), HEAD_TRAIN, d,
                    dtype=torch.float32)
        out[algorithm] = d
    return out


def test_row_masks_by_hand():
    # 6 tokens, the first 3 the prompt's: row p predicts token p + 1
    answer, prompt = row_masks(3, 6)
    assert answer.tolist() == [False, False, True, True, True, False]
    assert prompt.tolist() == [True, True, False, False, False, False]
    assert Agreement.rates([(3, 4), (0, 0)])[0] == 0.75


def _direct_step0(target, head, trainer, seq: list[int], prompt_len: int) -> tuple[int, int]:
    """(rows whose head argmax is the target's argmax, rows) over the rows whose label is an answer token, from one
    forward of the target and one of the head, without the trainer's unroll or the feature cache."""
    x = torch.tensor(seq)[None]  # [1, L+1]
    out = target(train_batch(x, capture_layers=trainer.capture))
    best = out.logits.argmax(-1)  # [L+1]: the target's next token after each position
    hidden = (torch.cat(out.aux_hidden, -1) if trainer.capture else out.hidden)[:-1]  # [L, .]
    fb = train_batch(x[:, 1:], step_kv=StepKV())
    h = head(fb, target.embed(fb.input_ids), hidden)  # row i: token i + 1, the target's hidden at i
    if isinstance(head, Eagle3Head):
        d = head.lm_head(head.norm(h)).argmax(-1)
        pred = d + head.d2t[d]
    else:
        pred = target.compute_logits(h).argmax(-1)
    rows = torch.arange(len(seq) - 1)
    counted = rows + 2 >= prompt_len  # row i's label is the target's choice of token i + 2
    counted &= rows + 2 <= len(seq) - 1
    return int(((pred == best[1:]) & counted).sum()), int(counted.sum())


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_step0_agreement_is_the_heads_direct_forward(bigram_target, tokens, heads, algorithm):
    target, _, _ = load_model(bigram_target, dtype="float32")
    head, _, _ = load_model(heads[algorithm], dtype="float32", registry=head_architectures())
    trainer = EagleTrainer(target, read_config(bigram_target), EagleOptions(algorithm, ttt_steps=3), None, 0, [],
                           head=head)
    seqs = [tokens[a : a + n].tolist() for a, n in ((0, 40), (500, 57), (900, 23))]
    prompt_lens = [10, 30, 4]
    cache = build_feature_cache(target, seqs, trainer.capture, top_k=8, bf16=False, progress=False)
    got = head_agreement(trainer, cache, [(len(s), p) for s, p in zip(seqs, prompt_lens, strict=True)], bf16=False)
    with torch.no_grad():
        direct = [_direct_step0(target, head, trainer, s, p) for s, p in zip(seqs, prompt_lens, strict=True)]
    want = (sum(h for h, _ in direct), sum(r for _, r in direct))
    assert got.answer[0] == want
    assert want[0] > 0.5 * want[1], want  # a trained head: the check compares real agreement, not zeros
    assert len(got.answer) == len(got.prompt) == 3
    # step k's row i predicts token i + 2 + k: every step counts each answer token once (prompts of >= 4 tokens)
    answer_tokens = sum(len(s) - p for s, p in zip(seqs, prompt_lens, strict=True))
    assert [r for _, r in got.answer] == [want[1]] * 3 == [answer_tokens] * 3


def test_eval_head_command(bigram_target, heads, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def mean(data):\nfor i in range(10):\nimport os\n")
    argv = ["eval-head", "--model-path", bigram_target, "--speculative-draft-model-path", heads["EAGLE3"],
            "--prompts", str(prompts), "--max-new-tokens", "24", "--steps", "2", "--num-threads", "1"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    answer = next(line for line in out.splitlines() if line.startswith("answer rows"))
    rates = [float(v) for v in answer.split()[2:]]
    assert len(rates) == 2 and rates[0] > 0.1, out  # chance: 1 in 480 draft ids
    assert "3 requests" in out
    assert cli_main(argv[:-4] + ["--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err

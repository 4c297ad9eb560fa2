"""``specserve eval-head``: how often a trained EAGLE / EAGLE-3 head agrees with its target, teacher-forced, on
held-out requests, in seconds and without a speculative engine.

The target answers each prompt greedily (a plain engine, all prompts in one batch). Its outputs over prompt +
answer are computed once, as a head trainer computes them (``features.build_feature_cache``), and the head is
unrolled over them exactly as in training (``EagleTrainer._unroll``): at step k, row i reads the token x_{i+1+k}
and step k - 1's hidden (step 0: the target's features at i). A row agrees when the head's most likely token is
the target's. Rows are counted apart by what they predict: answer tokens (what speculative decoding drafts) and
prompt tokens (a trainer's loss over every row learns those too, and they read easier: a training run's own
``acc`` figures mix both).

Step 0's answer agreement is close to what serving measures as the acceptance rate of the first drafted token of
a chain (``specserve eval-acceptance --speculative-eagle-topk 1``); later steps are conditioned on the true tokens,
so they read higher than the chain's rates, which also need every earlier draft right.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from specserve.train.features import FeatureCache, TopK, build_feature_cache, label_mask
from specserve.train.loop import TrainConfig, autocast

DEFAULT_STEPS = 5


@dataclass
class Agreement:
    """Per unrolled step: rows whose head argmax is the target's, and rows counted, by kind of label."""

    answer: list[tuple[int, int]]
    prompt: list[tuple[int, int]]

    @staticmethod
    def rates(counts: list[tuple[int, int]]) -> list[float]:
        return [hits / rows if rows else float("nan") for hits, rows in counts]


def row_masks(prompt_len: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (answer, prompt) bool [length] over rows: row p counts where token p + 1 is an answer (a prompt) token;
    the last row predicts nothing."""
    answer_tokens = torch.arange(length) >= prompt_len
    return label_mask(answer_tokens), label_mask(~answer_tokens)


def _add(total: list[tuple[int, int]], counts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    if not total:
        return list(counts)
    return [(h + dh, r + dr) for (h, r), (dh, dr) in zip(total, counts, strict=True)]


@torch.inference_mode()
def head_agreement(trainer, cache: FeatureCache, spans: list[tuple[int, int]], bf16: bool) -> Agreement:
    """trainer: an ``EagleTrainer`` around the head (its ``head=``; its options' steps are the steps unrolled);
    cache: the target's outputs over the sequences one after another; spans: per sequence (its length, its prompt's
    length). Each sequence is unrolled alone (batch 1), so no row sees another's; bf16: under bf16 autocast, as
    training runs."""
    answer: list[tuple[int, int]] = []
    prompt: list[tuple[int, int]] = []
    offset = 0
    for length, plen in spans:
        a, offset = offset, offset + length
        seq = length - 1
        if seq < 1:
            continue
        x = cache.tokens[a : a + length].long()[None]  # [1, L+1]
        top = TopK(cache.top.ids[a : a + length][None], cache.top.logits[a : a + length][None])  # [1, L+1, k]
        feats = cache.feats[a : a + length][None]  # [1, L+1, h]
        hidden = cache.aux[a : a + seq] if trainer.capture else feats[0, :seq]  # [L, 3h] or [L, h]
        cfg = TrainConfig(steps=1, batch_size=1, seq_len=seq, device="cpu", bf16=bf16)
        for kind, mask in zip(("answer", "prompt"), row_masks(plen, length), strict=True):
            counts: list[tuple[int, int]] = []
            with autocast(cfg):
                trainer._unroll(x, top, feats, hidden, cfg, mask[None], counts)
            if kind == "answer":
                answer = _add(answer, counts)
            else:
                prompt = _add(prompt, counts)
    return Agreement(answer, prompt)


# ---------------------------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specserve eval-head",
        description="Teacher-forced agreement of a trained EAGLE / EAGLE-3 head with its target on held-out "
                    "requests, per unrolled step, over the answers' rows and the prompts' rows apart.")
    p.add_argument("--model-path", required=True, help="target model folder (or a demo name: smollm2, demo)")
    p.add_argument("--speculative-draft-model-path", required=True, help="the head's folder (or a demo name)")
    p.add_argument("--prompts", default="held-out", help="'held-out' (the target family's held-out requests) or a "
                   "prompt file (.txt: one a line; .jsonl: 'prompt' or 'text')")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96, help="greedy answer length per prompt")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="unrolled draft steps to report")
    p.add_argument("--num-threads", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    for name in ("num_prompts", "max_new_tokens", "steps"):
        if getattr(ns, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    from specserve.config import ConfigError
    from specserve.models.loader import ModelLoadError

    try:
        result, n = evaluate(ns)
    except (ValueError, OSError, ModelLoadError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(result, n))
    return 0


def evaluate(ns: argparse.Namespace) -> tuple[Agreement, int]:
    """Answer the prompts with a plain engine, compute the target's outputs over them, unroll the head."""
    from specserve.bench.eval_acceptance import load_prompts
    from specserve.demo_models import resolve_demo
    from specserve.engine import Engine
    from specserve.models.loader import load_model, read_config, resolve_model_path
    from specserve.speculative.heads.eagle3 import Eagle3Head
    from specserve.train.eagle import EagleOptions, EagleTrainer
    from specserve.train.loop import bf16_supported

    target_dir = resolve_model_path(resolve_demo(ns.model_path))
    head_dir = resolve_model_path(resolve_demo(ns.speculative_draft_model_path))
    prompts = load_prompts(ns.prompts, ns.num_prompts, ns.model_path)
    engine = Engine(model_path=target_dir, dtype="bfloat16", num_threads=ns.num_threads)
    try:
        tok = engine.tokenizer
        ids = [tok.encode(p, add_special_tokens=True) for p in prompts]  # as the engine tokenizes a text prompt
        outs = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": ns.max_new_tokens})
    finally:
        engine.shutdown()
    seqs = [p + list(o["output_ids"]) for p, o in zip(ids, outs, strict=True)]
    bf16 = bf16_supported("cpu")  # else no autocast: the float32 head then needs a float32 target's outputs
    target, _, _ = load_model(target_dir, dtype="bfloat16" if bf16 else "float32", device="cpu")
    head, _, _ = load_model(head_dir, dtype="float32", device="cpu", registry=head_architectures())
    algorithm = "EAGLE3" if isinstance(head, Eagle3Head) else "EAGLE"
    trainer = EagleTrainer(target, read_config(target_dir), EagleOptions(algorithm, ttt_steps=ns.steps), None, 0, [],
                           head=head)
    cache = build_feature_cache(target, seqs, trainer.capture, progress=False)
    spans = [(len(s), len(p)) for s, p in zip(seqs, ids, strict=True)]
    return head_agreement(trainer, cache, spans, bf16), len(seqs)


def head_architectures() -> dict:
    """Every head architecture the EAGLE and EAGLE-3 drafters load (their ``registry``), for ``load_model``."""
    from specserve.speculative.draft_models import Eagle3HeadDraft, EagleHeadDraft

    return {**EagleHeadDraft.registry, **Eagle3HeadDraft.registry}


def report(result: Agreement, n: int) -> str:
    steps = len(result.answer)
    lines = [f"teacher-forced agreement with the target, {n} requests (head argmax == target argmax)", "",
             "step          " + "".join(f"{k:>8}" for k in range(steps)),
             "answer rows   " + "".join(f"{r:>8.3f}" for r in Agreement.rates(result.answer)),
             "prompt rows   " + "".join(f"{r:>8.3f}" for r in Agreement.rates(result.prompt)),
             "", f"rows at step 0: {result.answer[0][1] if steps else 0} answer, "
                 f"{result.prompt[0][1] if steps else 0} prompt"]
    return "\n".join(lines)

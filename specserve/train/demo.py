"""``specserve build-demo``: the bundled demo model family, reproducible with one command.

Stages (each skipped when its output folder is complete, so an interrupted build resumes; ``--resume`` also
continues a half-trained stage from its last checkpoint):

1. ``tokenizer``  byte-level BPE (4096 ids) with a chat template, on the training part of the stdlib;
2. ``target``     ``demo``: a 12-layer Llama (hidden 256, GQA 4/2 heads, tied embeddings), pre-trained;
3. ``eagle``      ``demo-eagle``: an EAGLE-1/2 head for ``demo`` (feature + token losses);
4. ``eagle3``     ``demo-eagle3``: an EAGLE-3 head (training-time test, 1024-id draft vocabulary);
5. ``token-map``  ``demo/fr_spec_1024.pt``: the FR-Spec hot-vocabulary map of ``demo``;
6. ``draft``      ``demo-draft``: a 2-layer Llama distilled from ``demo`` (a STANDALONE draft);
7. ``mtp``        ``demo-mtp``: a small MiMo-style Qwen2 model (pre-trained) plus its trained MTP layer.

Corpus: the ``.py`` files of the running interpreter's standard library, without the modules in
``corpus.HELD_OUT`` (the evaluation prompts come from those). Everything is trained in bf16 autocast where the
hardware has bf16, and stored in bf16.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

from specserve.train.corpus import stdlib_files, tokenize_files
from specserve.train.lm import LmShape, lm_config, pretrain
from specserve.train.loop import TrainConfig, bf16_supported

STAGES = ("tokenizer", "target", "eagle", "eagle3", "token-map", "draft", "mtp")
VOCAB_SIZE = 4096
TARGET_SHAPE = LmShape(hidden_size=256, intermediate_size=768, num_hidden_layers=12, num_attention_heads=4,
                       num_key_value_heads=2)
TARGET_TRAIN = TrainConfig(steps=3600, batch_size=16, seq_len=256, lr=1e-3, warmup_steps=100,
                           weight_decay=0.05, checkpoint_every=250)
STAGE_DIRS = {"tokenizer": "demo", "target": "demo", "eagle": "demo-eagle", "eagle3": "demo-eagle3",
              "token-map": "demo", "draft": "demo-draft", "mtp": "demo-mtp"}


def _done(path: str) -> bool:
    return os.path.isfile(path)


def stage_tokenizer(out: str, progress: bool) -> None:
    from specserve.train.corpus import read_text
    from specserve.train.tokenizer import train_tokenizer

    texts = (t for t in (read_text(p) for p in stdlib_files()) if t)
    train_tokenizer(texts, VOCAB_SIZE, os.path.join(out, "demo"), progress=progress)


def corpus_tokens(out: str, progress: bool) -> torch.Tensor:
    """The training token stream, cached in OUT/.cache/tokens.pt."""
    from transformers import AutoTokenizer

    cache = os.path.join(out, ".cache", "tokens.pt")
    if os.path.isfile(cache):
        return torch.load(cache)
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "demo"))
    tokens = tokenize_files(stdlib_files(), tok, tok.eos_token_id, progress=progress)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    torch.save(tokens, cache)
    return tokens


def stage_target(out: str, cfg: TrainConfig, resume: bool) -> None:
    from transformers import AutoTokenizer

    folder = os.path.join(out, "demo")
    tok = AutoTokenizer.from_pretrained(folder)
    tokens = corpus_tokens(out, cfg.progress)
    print(f"target: {tokens.numel():,} training tokens", file=sys.stderr)
    pretrain(lm_config(TARGET_SHAPE, tok), tokens, cfg, folder, folder, resume=resume)


def build(out: str, stages: list[str], resume: bool, device: str, progress: bool, scale: float) -> None:
    bf16 = bf16_supported(device)
    common = {"device": device, "bf16": bf16, "progress": progress}
    os.makedirs(out, exist_ok=True)
    for stage in stages:
        print(f"== stage {stage}", file=sys.stderr)
        if stage == "tokenizer":
            if not _done(os.path.join(out, "demo", "tokenizer.json")):
                stage_tokenizer(out, progress)
        elif stage == "target":
            cfg = replace(TARGET_TRAIN, steps=max(1, int(TARGET_TRAIN.steps * scale)), **common)
            if resume or not _done(os.path.join(out, "demo", "model.safetensors")):
                stage_target(out, cfg, resume)
        else:
            raise SystemExit(f"error: stage {stage!r} is not implemented yet")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve build-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (receives demo, demo-eagle, demo-eagle3, ...)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--resume", action="store_true", help="continue half-trained stages from their checkpoints")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every stage's training steps (e.g. 0.01 for "
                   "a quick smoke build)")
    p.add_argument("--no-progress", action="store_true")
    ns = p.parse_args(argv)
    stages = [s.strip() for s in ns.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"error: --stages: unknown stage(s) {', '.join(bad)} (choose from {', '.join(STAGES)})",
              file=sys.stderr)
        return 2
    build(ns.out, stages, ns.resume, ns.device, not ns.no_progress, ns.scale)
    return 0

"""``specserve build-demo``: the code model family (tests, CI), reproducible with one command.

Stages (each skipped once its marker exists in the work folder, so an interrupted build picks up where it
stopped; ``--resume`` also continues a half-trained stage from its last checkpoint):

1. ``tokenizer``  byte-level BPE (4096 ids) with a chat template, on the training part of the stdlib;
2. ``target``     ``demo``: a 12-layer Llama (hidden 256, 4 query / 2 KV heads, tied embeddings), pre-trained;
3. ``eagle``      ``demo-eagle``: an EAGLE-1/2 head for ``demo`` (feature + token losses);
4. ``eagle3``     ``demo-eagle3``: an EAGLE-3 head (training-time test over 5 steps, 2048-id draft vocabulary);
5. ``token-map``  ``demo/fr_spec_1024.pt``: the FR-Spec hot-vocabulary map of ``demo`` (1024 most frequent ids);
6. ``draft``      ``demo-draft``: a 3-layer Llama (hidden 192) distilled from ``demo`` (a STANDALONE draft);
7. ``mtp``        ``demo-mtp``: a 2-layer MiMo-style Qwen2 model (hidden 192), pre-trained, then its MTP layer
                  trained with the trunk frozen.

Corpus: the ``.py`` files of the running interpreter's standard library, without the modules in
``corpus.HELD_OUT`` (the evaluation prompts come from those). Everything is trained in bf16 autocast where the
hardware has bf16, and stored in bf16.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import replace

import torch

from specserve.demo_models import TOKEN_MAP
from specserve.train import chat_demo
from specserve.train.corpus import stdlib_files, tokenize_files
from specserve.train.lm import LmShape, lm_config, pretrain
from specserve.train.loop import TrainConfig, bf16_supported

FAMILIES = ("code", "smollm2")
STAGES = ("tokenizer", "target", "eagle", "eagle3", "token-map", "draft", "mtp")
VOCAB_SIZE = 4096
TOKEN_MAP_SIZE = 1024
TARGET_SHAPE = LmShape(hidden_size=256, intermediate_size=768, num_hidden_layers=12, num_attention_heads=4,
                       num_key_value_heads=2)
DRAFT_SHAPE = LmShape(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=3,
                      num_key_value_heads=1)
MTP_SHAPE = LmShape(hidden_size=192, intermediate_size=512, num_hidden_layers=2, num_attention_heads=3,
                    num_key_value_heads=1)
TRAIN = {
    "target": TrainConfig(steps=2400, batch_size=16, seq_len=256, lr=1e-3, warmup_steps=100, weight_decay=0.05,
                          checkpoint_every=250),
    "eagle": TrainConfig(steps=900, batch_size=16, seq_len=256, lr=2e-3, warmup_steps=50, checkpoint_every=150),
    "eagle3": TrainConfig(steps=3000, batch_size=16, seq_len=256, lr=2e-3, warmup_steps=50, checkpoint_every=250),
    "draft": TrainConfig(steps=900, batch_size=16, seq_len=256, lr=2e-3, warmup_steps=50, weight_decay=0.05,
                         checkpoint_every=150),
    "mtp-trunk": TrainConfig(steps=900, batch_size=16, seq_len=256, lr=2e-3, warmup_steps=50, weight_decay=0.05,
                             checkpoint_every=150),
    "mtp": TrainConfig(steps=400, batch_size=16, seq_len=256, lr=2e-3, warmup_steps=30, checkpoint_every=100),
}
EAGLE3_DRAFT_VOCAB = 2048


MARKER_TEXT = "done\n"  # a stage's marker: what it was done for (``stamp``), or this where nothing else matters


class Build:
    """One build: output folder, work folder (trainer states, token cache, stage markers), shared settings."""

    stamp = MARKER_TEXT  # what a stage's marker records (``build``): nothing beyond its being done

    def __init__(self, out: str, work: str, device: str, progress: bool, scale: float, resume: bool,
                 max_corpus_files: int | None = None) -> None:
        self.out, self.work, self.resume, self.scale = out, work, resume, scale
        files = stdlib_files()
        if max_corpus_files:  # an even spread over the corpus, for quick smoke builds
            files = files[:: max(1, len(files) // max_corpus_files)][:max_corpus_files]
        self.files = files
        self.common = {"device": device, "bf16": bf16_supported(device), "progress": progress}
        os.makedirs(out, exist_ok=True)
        os.makedirs(work, exist_ok=True)

    def folder(self, name: str) -> str:
        return os.path.join(self.out, name)

    def cfg(self, key: str) -> TrainConfig:
        base = TRAIN[key]
        return replace(base, steps=max(2, int(base.steps * self.scale)),
                       warmup_steps=max(1, int(base.warmup_steps * min(1.0, self.scale))), **self.common)

    def work_dir(self, key: str) -> str:
        return os.path.join(self.work, key)

    def marker(self, stage: str) -> str:
        return os.path.join(self.work, f"{stage}.done")

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder("demo"))

    @functools.cached_property
    def token_stream(self) -> torch.Tensor:
        """The training token stream: tokenized once per build folder (cached in the work folder), read once per run."""
        cache = os.path.join(self.work, "tokens.pt")
        if os.path.isfile(cache):
            return torch.load(cache)
        tok = self.tokenizer()
        tokens = tokenize_files(self.files, tok, tok.eos_token_id, progress=self.common["progress"])
        torch.save(tokens, cache)
        return tokens


def stage_tokenizer(b: Build) -> None:
    from specserve.train.corpus import read_text
    from specserve.train.tokenizer import train_tokenizer

    texts = (t for t in (read_text(p) for p in b.files) if t)
    train_tokenizer(texts, VOCAB_SIZE, b.folder("demo"), progress=b.common["progress"])


def stage_target(b: Build) -> None:
    tokens = b.token_stream
    print(f"target: {tokens.numel():,} training tokens", file=sys.stderr)
    pretrain(lm_config(TARGET_SHAPE, b.tokenizer()), tokens, b.cfg("target"), b.folder("demo"), b.folder("demo"),
             resume=b.resume, work_dir=b.work_dir("target"))


def stage_eagle(b: Build, algorithm: str) -> None:
    from specserve.train.eagle import EagleOptions, train_eagle

    name = "demo-eagle3" if algorithm == "EAGLE3" else "demo-eagle"
    # EAGLE3 unrolls as deep as the default Llama tree drafts (5 steps); EAGLE keeps EAGLE-1's single step
    opts = EagleOptions(algorithm, ttt_steps=5 if algorithm == "EAGLE3" else 1, draft_vocab_size=EAGLE3_DRAFT_VOCAB)
    metrics = train_eagle(b.folder("demo"), b.token_stream, opts, b.cfg(algorithm.lower()), b.folder(name),
                          resume=b.resume, work_dir=b.work_dir(algorithm.lower()))
    print(f"{name}: {metrics}", file=sys.stderr)


def stage_token_map(b: Build) -> None:
    from specserve.speculative.token_map import build_token_map, save_token_map

    ids = build_token_map(b.folder("demo"), b.files, TOKEN_MAP_SIZE, progress=b.common["progress"])
    save_token_map(ids, os.path.join(b.folder("demo"), os.path.basename(TOKEN_MAP)))


def stage_draft(b: Build) -> None:
    from specserve.models.loader import load_model
    from specserve.train.lm import distill

    cfg = b.cfg("draft")
    teacher, _, _ = load_model(b.folder("demo"), dtype="float32", device=cfg.device)
    distill(teacher, lm_config(DRAFT_SHAPE, b.tokenizer()), b.token_stream, cfg, b.folder("demo-draft"),
            b.folder("demo"), resume=b.resume, work_dir=b.work_dir("draft"))


def stage_mtp(b: Build) -> None:
    """A small MiMo-style model: pre-train the trunk (MTP layer untouched), then train the MTP layer alone."""
    from specserve.train.lm import build_model, train_mtp

    config = lm_config(MTP_SHAPE, b.tokenizer(), architecture="MiMoForCausalLM", mtp_layers=1)
    trunk_cfg, mtp_cfg = b.cfg("mtp-trunk"), b.cfg("mtp")
    work = b.work_dir("mtp-trunk")
    pretrain(config, b.token_stream, trunk_cfg, b.folder("demo-mtp"), b.folder("demo"), resume=b.resume, work_dir=work)
    model = build_model(config, mtp_cfg.seed).to(mtp_cfg.device)
    state = torch.load(os.path.join(work, "trainer_state.pt"), map_location=mtp_cfg.device, weights_only=False)
    model.load_state_dict(state["model"])
    train_mtp(model, config, b.token_stream, mtp_cfg, b.folder("demo-mtp"), b.folder("demo"), resume=b.resume,
              work_dir=b.work_dir("mtp"))


STAGE_FUNCS = {
    "tokenizer": stage_tokenizer,
    "target": stage_target,
    "eagle": lambda b: stage_eagle(b, "EAGLE"),
    "eagle3": lambda b: stage_eagle(b, "EAGLE3"),
    "token-map": stage_token_map,
    "draft": stage_draft,
    "mtp": stage_mtp,
}


def stage_done(marker: str, stamp: str) -> bool:
    """Whether the marker file says its stage is done for this stamp (a bare "done", as older builds wrote, counts
    for any)."""
    if not os.path.isfile(marker):
        return False
    with open(marker) as f:
        text = f.read()
    return text in (stamp, MARKER_TEXT)


def build(b, stages: list[str], funcs: dict) -> None:
    """Run the stages in order, each skipped once its marker (b.marker(stage)) says it is done for the build's
    stamp (``b.stamp``: a smollm2 build's number of data shards, so asking for more shards runs the stages again,
    each data shard and feature cache on disk kept)."""
    for stage in stages:
        if stage_done(b.marker(stage), b.stamp):
            print(f"== stage {stage}: done already (delete {b.marker(stage)} to redo)", file=sys.stderr)
            continue
        print(f"== stage {stage}", file=sys.stderr)
        funcs[stage](b)
        with open(b.marker(stage), "w") as f:
            f.write(b.stamp)


def default_work_dir(out: str, family: str = "code") -> str:
    name = os.path.abspath(out).strip(os.sep).replace(os.sep, "_")
    return os.path.join(os.path.expanduser("~"), ".cache", "specserve", "build-demo",
                        name if family == "code" else f"{family}_{name}")


def main(argv: list[str] | None = None) -> int:
    from specserve.demo_models import DEMO_ROOT

    p = argparse.ArgumentParser(prog="specserve build-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEMO_ROOT, help="output folder (receives demo, demo-eagle, demo-eagle3, ...; "
                   "default: the package's bundled folder, replacing the shipped weights)")
    p.add_argument("--work-dir", default=None, help="trainer states, token cache and stage markers "
                   "(default: ~/.cache/specserve/build-demo/<out>)")
    p.add_argument("--family", default="code", choices=FAMILIES, help="code: the small code model family (target "
                   "trained from scratch); smollm2: the heads of the pretrained SmolLM2-135M-Instruct target")
    p.add_argument("--stages", default=None, help=f"comma-separated subset of the family's stages (code: "
                   f"{','.join(STAGES)}; smollm2: {','.join(chat_demo.STAGES)}; default: all)")
    p.add_argument("--resume", action="store_true", help="continue half-trained stages from their checkpoints")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every stage's training steps (e.g. 0.01 for "
                   "a quick smoke build)")
    p.add_argument("--max-corpus-files", type=int, default=None, help="train on an even spread of at most N corpus "
                   "files (quick smoke builds; the bundled family uses all)")
    p.add_argument("--data-shards", type=int, default=None, help="smollm2: self-generated data shards to write and "
                   f"train on (default {chat_demo.GEN_SHARDS}; a smoke build: 1)")
    p.add_argument("--data-from", default=None, metavar="DIR", help="smollm2: take the data shards that DIR holds "
                   "(train-<k>.jsonl and held-<k>.jsonl, plain or .gz; the repository's data/smollm2) instead of "
                   "generating them")
    p.add_argument("--no-progress", action="store_true")
    ns = p.parse_args(argv)
    family_stages = STAGES if ns.family == "code" else chat_demo.STAGES
    stages = [s.strip() for s in (ns.stages or ",".join(family_stages)).split(",") if s.strip()]
    bad = [s for s in stages if s not in family_stages]
    if bad:
        print(f"error: --stages: unknown stage(s) {', '.join(bad)} for --family {ns.family} (choose from "
              f"{', '.join(family_stages)})", file=sys.stderr)
        return 2
    if ns.scale <= 0:
        print("error: --scale must be > 0", file=sys.stderr)
        return 2
    if ns.data_shards is not None and (ns.data_shards < 1 or ns.family != "smollm2"):
        print("error: --data-shards takes a count >= 1, with --family smollm2", file=sys.stderr)
        return 2
    if ns.data_from is not None and (ns.family != "smollm2" or not os.path.isdir(ns.data_from)):
        print(f"error: --data-from takes a folder, with --family smollm2 (got {ns.data_from!r})", file=sys.stderr)
        return 2
    work = ns.work_dir or default_work_dir(ns.out, ns.family)
    if ns.family == "code":
        b = Build(ns.out, work, ns.device, not ns.no_progress, ns.scale, ns.resume, ns.max_corpus_files)
        build(b, stages, STAGE_FUNCS)
    else:
        b = chat_demo.ChatBuild(ns.out, work, ns.device, not ns.no_progress, ns.scale, ns.resume, ns.data_shards,
                                ns.data_from)
        build(b, stages, chat_demo.STAGE_FUNCS)
    return 0

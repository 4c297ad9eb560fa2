"""Command lines of the trainers: ``specserve train-eagle``, ``train-draft``, ``train-mtp`` (and ``build-demo``).

Data (``--data``): plain-text files (any extension) and ``.jsonl`` chat / ShareGPT / ``text`` records (rendered
with the target's chat template); the word ``stdlib`` stands for the demo corpus (the running interpreter's
standard library minus the held-out modules).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from specserve.train.loop import TrainConfig, bf16_supported


def add_train_args(p: argparse.ArgumentParser, steps: int, lr: float) -> None:
    p.add_argument("--data", nargs="+", required=True, help="training files (.txt/.py/...: plain text; .jsonl: "
                   "chat records), or 'stdlib' for the demo corpus")
    p.add_argument("--out", required=True, help="output folder (HF format, loadable by the server)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (state + export)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/.trainer/trainer_state.pt")
    p.add_argument("--stop-after", type=int, default=None, help="end this run after N steps (checkpointed; "
                   "continue later with --resume and the same flags)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the written weights")
    p.add_argument("--no-bf16", action="store_true", help="train in float32 even where bf16 is native")
    p.add_argument("--no-progress", action="store_true")


def train_config(ns: argparse.Namespace) -> TrainConfig:
    for name in ("steps", "batch_size", "seq_len", "checkpoint_every"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.lr <= 0:
        raise ValueError("--lr must be > 0")
    warmup = ns.warmup_steps if ns.warmup_steps is not None else max(1, ns.steps // 20)
    return TrainConfig(steps=ns.steps, batch_size=ns.batch_size, seq_len=ns.seq_len, lr=ns.lr, warmup_steps=warmup,
                       seed=ns.seed, checkpoint_every=ns.checkpoint_every, device=ns.device, stop_after=ns.stop_after,
                       bf16=not ns.no_bf16 and bf16_supported(ns.device), progress=not ns.no_progress)


def data_tokens(data: list[str], tokenizer_dir: str, progress: bool) -> torch.Tensor:
    """The token stream of --data, tokenized with the target's tokenizer (EOS after each document)."""
    from transformers import AutoTokenizer

    from specserve.train.corpus import stdlib_files, tokenize_files

    files: list[str] = []
    for item in data:
        if item == "stdlib":
            files.extend(stdlib_files())
        elif not os.path.isfile(item):
            raise ValueError(f"--data: no such file: {item}")
        else:
            files.append(item)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    return tokenize_files(files, tok, eos, progress=progress)


def _run(fn, argv, build_parser) -> int:
    from specserve.config import ConfigError
    from specserve.models.loader import ModelLoadError, resolve_model_path

    p = build_parser()
    ns = p.parse_args(argv)
    try:
        ns.target = resolve_model_path(_demo(ns.target))
        cfg = train_config(ns)
        metrics = fn(ns, cfg)
    except (ValueError, OSError, ModelLoadError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {ns.out} ({', '.join(f'{k}={v:.4g}' for k, v in metrics.items())})", file=sys.stderr)
    return 0


def _demo(path: str) -> str:
    from specserve.demo_models import resolve_demo

    return resolve_demo(path)


def eagle_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve train-eagle", description="Train an EAGLE-1/2 or EAGLE-3 draft head "
                                "for a target model (specserve.train.eagle).")
    p.add_argument("--target", required=True, help="target model folder (or a demo name)")
    p.add_argument("--algorithm", default="EAGLE3", type=str.upper, choices=["EAGLE", "EAGLE3"])
    p.add_argument("--ttt-steps", type=int, default=0, help="unrolled draft steps (0: EAGLE 1, EAGLE3 4)")
    p.add_argument("--draft-vocab-size", type=int, default=0, help="EAGLE3 draft vocabulary (0: min(V, 32768))")
    add_train_args(p, steps=2000, lr=2e-3)
    return p


def cmd_train_eagle(argv: list[str]) -> int:
    def fn(ns, cfg):
        from specserve.train.eagle import EagleOptions, train_eagle

        if ns.ttt_steps < 0 or ns.draft_vocab_size < 0:
            raise ValueError("--ttt-steps and --draft-vocab-size must be >= 0")
        tokens = data_tokens(ns.data, ns.target, cfg.progress)
        opts = EagleOptions(ns.algorithm, ns.ttt_steps, ns.draft_vocab_size)
        return train_eagle(ns.target, tokens, opts, cfg, ns.out, ns.resume, _dtype(ns.dtype))

    return _run(fn, argv, eagle_parser)


def draft_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve train-draft", description="Distil a small causal LM of the target's "
                                "tokenizer from the target: a STANDALONE draft model.")
    p.add_argument("--target", required=True, help="teacher (target) model folder (or a demo name)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 3 x hidden")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=None, help="default: hidden / 64")
    add_train_args(p, steps=2000, lr=2e-3)
    return p


def cmd_train_draft(argv: list[str]) -> int:
    def fn(ns, cfg):
        from transformers import AutoTokenizer

        from specserve.models.loader import load_model
        from specserve.train.lm import LmShape, distill, lm_config

        heads = ns.num_heads or max(1, ns.hidden_size // 64)
        if ns.hidden_size % heads:
            raise ValueError("--hidden-size must be a multiple of --num-heads")
        shape = LmShape(hidden_size=ns.hidden_size, intermediate_size=ns.intermediate_size or 3 * ns.hidden_size,
                        num_hidden_layers=ns.num_layers, num_attention_heads=heads, num_key_value_heads=heads)
        teacher, spec, target_dir = load_model(ns.target, dtype="float32", device=cfg.device)
        shape.max_position_embeddings = spec.max_position_embeddings
        tokens = data_tokens(ns.data, target_dir, cfg.progress)
        config = lm_config(shape, AutoTokenizer.from_pretrained(target_dir))
        return distill(teacher, config, tokens, cfg, ns.out, target_dir, ns.resume, _dtype(ns.dtype))

    return _run(fn, argv, draft_parser)


def mtp_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve train-mtp", description="Train the MTP layer(s) of a MiMo-style "
                                "target (MiMoForCausalLM, num_nextn_predict_layers >= 1) with its trunk frozen; "
                                "writes the whole model with the trained layers.")
    p.add_argument("--target", required=True, help="MiMo-style model folder (or a demo name)")
    add_train_args(p, steps=1000, lr=2e-3)
    return p


def cmd_train_mtp(argv: list[str]) -> int:
    def fn(ns, cfg):
        from specserve.models.loader import load_model, read_config
        from specserve.train.lm import train_mtp

        model, _spec, target_dir = load_model(ns.target, dtype="float32", device=cfg.device)
        if not len(getattr(model, "mtp_layers", ())):
            raise ValueError(f"--target: {ns.target} is not a MiMo-style model with MTP layers "
                             "(config.json needs num_nextn_predict_layers >= 1)")
        tokens = data_tokens(ns.data, target_dir, cfg.progress)
        return train_mtp(model, read_config(target_dir), tokens, cfg, ns.out, target_dir, ns.resume,
                         _dtype(ns.dtype))

    return _run(fn, argv, mtp_parser)


def cmd_build_demo(argv: list[str]) -> int:
    from specserve.train.demo import main

    return main(argv)


def _dtype(name: str) -> torch.dtype:
    from specserve.train.export import dtype_from_name

    return dtype_from_name(name)


COMMANDS = {"train-eagle": cmd_train_eagle, "train-draft": cmd_train_draft, "train-mtp": cmd_train_mtp,
            "build-demo": cmd_build_demo}

"""Causal-LM training with specserve's own model code: pre-training a target (Llama or MiMo-style Qwen2), distilling
a smaller STANDALONE draft from a target, and training the MTP layer of a MiMo-style target.

Every trainer reads tokens from a flat stream (``corpus.tokenize_files``), draws its batch for step s as a pure
function of (seed, s), runs the shared loop (``loop.train``) and exports an HF folder the server loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.training import train_batch
from specserve.models.registry import resolve_architecture
from specserve.train.corpus import sample_windows
from specserve.train.export import checkpoint_tensors, save_folder
from specserve.train.loop import TrainConfig, autocast, train


@dataclass
class LmShape:
    """The size of a decoder to train (HF config names)."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True


def lm_config(shape: LmShape, tokenizer, architecture: str = "LlamaForCausalLM", mtp_layers: int = 0) -> dict:
    """A config.json dict (written through the transformers config class, so HF tools read it too)."""
    import transformers

    cls = transformers.Qwen2Config if architecture in ("Qwen2ForCausalLM", "MiMoForCausalLM") else \
        transformers.LlamaConfig
    cfg = cls(vocab_size=len(tokenizer), rms_norm_eps=1e-6, rope_theta=10000.0,
              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id, **vars(shape)).to_dict()
    cfg["architectures"] = [architecture]
    if architecture == "MiMoForCausalLM":
        cfg.update(model_type="mimo", num_nextn_predict_layers=mtp_layers)
    for key in ("transformers_version", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    return cfg


def default_work_dir(out_dir: str) -> str:
    """Where a trainer keeps its resumable state unless told otherwise: OUT/.trainer."""
    return os.path.join(out_dir, ".trainer")


def build_model(config: dict, seed: int) -> nn.Module:
    """A freshly initialised specserve model for config (normal(0, 0.02) weights, unit norms)."""
    cls = resolve_architecture(config)
    torch.manual_seed(seed)
    model = cls(cls.spec_from_config(config))
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def export_lm(model: nn.Module, config: dict, out_dir: str, dtype: torch.dtype, tokenizer_dir: str) -> None:
    skip = ("lm_head.",) if config.get("tie_word_embeddings") else ()
    save_folder(out_dir, config, checkpoint_tensors(model, skip=skip), dtype, tokenizer_dir)


def lm_logits(model: nn.Module, ids: torch.Tensor, capture: tuple[int, ...] = ()):
    """ids [B, L] -> model output over every position (logits [B*L, V] float32, hidden [B*L, h], aux)."""
    return model(train_batch(ids, capture_layers=capture))


def pretrain(config: dict, tokens: torch.Tensor, cfg: TrainConfig, out_dir: str, tokenizer_dir: str,
             resume: bool = False, dtype: torch.dtype = torch.bfloat16, work_dir: str | None = None) -> dict:
    """Train a causal LM from scratch on tokens [N] (next-token cross-entropy) and export it to out_dir."""
    model = build_model(config, cfg.seed).to(cfg.device)
    tokens = tokens.to(cfg.device)

    def loss_fn(step: int):
        x = sample_windows(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, step)  # [B, L+1]
        with autocast(cfg):
            logits = lm_logits(model, x[:, :-1]).logits
        return F.cross_entropy(logits.float(), x[:, 1:].reshape(-1)), {}

    def export(_step: int) -> None:
        export_lm(model, config, out_dir, dtype, tokenizer_dir)

    return train(cfg, model, loss_fn, work_dir or default_work_dir(out_dir), resume, export, desc="Pre-training")


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None = None):
    """Mean over rows of CE(softmax(target_logits), softmax(logits)): [R, V] each, mask [R] bool."""
    loss = -(target_logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)  # [R]
    if mask is None:
        return loss.mean()
    return (loss * mask).sum() / mask.sum().clamp_min(1)


def distill(teacher: nn.Module | None, config: dict, tokens: torch.Tensor | None, cfg: TrainConfig, out_dir: str,
            tokenizer_dir: str, resume: bool = False, dtype: torch.dtype = torch.bfloat16,
            hard_weight: float = 0.1, work_dir: str | None = None, cache=None,
            student: nn.Module | None = None) -> dict:
    """Train a (smaller) causal LM to match the teacher's next-token distributions (a STANDALONE draft).

    loss = CE(teacher probs, student) + hard_weight * CE(data token, student). With a feature cache
    (``train.features``) the teacher's distributions are its top k there (tokens and teacher unused). student: an
    initialised model (default: a fresh one for config)."""
    from specserve.train.features import TopK, topk_cross_entropy

    student = (student if student is not None else build_model(config, cfg.seed)).to(cfg.device)
    if teacher is not None:
        teacher.requires_grad_(False)
    tokens = tokens.to(cfg.device) if cache is None else None

    def teacher_label(step: int):
        """-> windows x [B, L+1], the teacher's label per input row (dense logits [B*L, V] or TopK [B*L, k])."""
        if cache is None:
            x = sample_windows(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, step)
            with autocast(cfg), torch.no_grad():
                return x, lm_logits(teacher, x[:, :-1]).logits
        x, top, _, _, _ = cache.window(cfg.batch_size, cfg.seq_len, cfg.seed, step)
        return x.to(cfg.device), TopK(*(t[:, :-1].reshape(-1, t.shape[-1]).to(cfg.device) for t in (top.ids,
                                                                                                     top.logits)))

    def loss_fn(step: int):
        x, label = teacher_label(step)
        with autocast(cfg):
            s_logits = lm_logits(student, x[:, :-1]).logits
        if isinstance(label, TopK):
            soft = topk_cross_entropy(s_logits, label, torch.ones(len(s_logits), dtype=torch.bool,
                                                                  device=s_logits.device))
            best = label.ids[:, 0]
        else:
            soft, best = soft_cross_entropy(s_logits, label), label.argmax(-1)
        hard = F.cross_entropy(s_logits.float(), x[:, 1:].reshape(-1))
        agree = (s_logits.argmax(-1) == best).float().mean()
        return soft + hard_weight * hard, {"top1_agree": float(agree)}

    def export(_step: int) -> None:
        export_lm(student, config, out_dir, dtype, tokenizer_dir)

    return train(cfg, student, loss_fn, work_dir or default_work_dir(out_dir), resume, export,
                 desc="Distilling draft")


def train_mtp(model: nn.Module, config: dict, tokens: torch.Tensor, cfg: TrainConfig, out_dir: str,
              tokenizer_dir: str, resume: bool = False, dtype: torch.dtype = torch.bfloat16,
              work_dir: str | None = None) -> dict:
    """Train the MTP layers of a MiMo-style model (``model.mtp_layers``) with the trunk frozen.

    MTP layer 0 at position i reads the trunk's post-norm hidden at i and the token at i + 1 and learns the trunk's
    distribution at i + 1 (the token at i + 2) through the shared LM head; layer j > 0 chains on layer j - 1."""
    model.requires_grad_(False)
    model.mtp_layers.requires_grad_(True)
    tokens = tokens.to(cfg.device)

    def loss_fn(step: int):
        x = sample_windows(tokens, cfg.batch_size, cfg.seq_len + len(model.mtp_layers), cfg.seed, step)
        n = len(model.mtp_layers)
        with autocast(cfg):
            with torch.no_grad():
                out = lm_logits(model, x[:, :-1])
            bsz, width = x.shape[0], x.shape[1] - 1
            t_logits = out.logits.view(bsz, width, -1)
            hidden = out.hidden.view(bsz, width, -1)[:, : cfg.seq_len]  # rows 0..L-1
            total, metrics = 0.0, {}
            for j, layer in enumerate(model.mtp_layers):
                ids = x[:, 1 + j : 1 + j + cfg.seq_len]  # the token at i + 1 + j
                fb = train_batch(ids)
                hidden = layer(fb, model.embed(fb.input_ids), hidden.reshape(-1, hidden.shape[-1]))
                logits = model.compute_logits(hidden)
                labels = t_logits[:, 1 + j : 1 + j + cfg.seq_len].reshape(-1, t_logits.shape[-1])
                total = total + soft_cross_entropy(logits, labels)
                agree = (logits.argmax(-1) == labels.argmax(-1)).float().mean()
                metrics[f"agree{j}"] = float(agree)
                hidden = hidden.view(bsz, cfg.seq_len, -1)
        return total / n, metrics

    def export(_step: int) -> None:
        export_lm(model, config, out_dir, dtype, tokenizer_dir)

    return train(cfg, model, loss_fn, work_dir or default_work_dir(out_dir), resume, export, desc="Training MTP")

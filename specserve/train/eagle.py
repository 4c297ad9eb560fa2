"""``specserve train-eagle``: train an EAGLE-1/2 or EAGLE-3 draft head for a target, with specserve's model code.

Per batch the frozen target runs once over a window x_0..x_L (bf16 autocast), giving its post-norm hidden f_i,
its captured residual streams (EAGLE-3) and its logits z_i. The head is then unrolled for ``ttt_steps`` steps
(the EAGLE-3 "training-time test"); in step k the row of anchor i sits at position i + k, reads the token
x_{i+1+k} and the hidden of step k - 1 (step 0: the target's features at i), attends to step 0's keys of anchors
<= i and to its own chain (``attention.training.StepKV``), and learns the target's next-token distribution
z_{i+1+k}:

    EAGLE    loss_k = SmoothL1(h_k, f_{i+1+k}) + 0.1 * CE(softmax(z), target LM head(h_k))   feature + token losses
    EAGLE3   loss_k = CE(softmax(z restricted to the draft vocabulary), head LM head(norm(h_k)))
    loss = sum_k 0.8^k loss_k / sum_k 0.8^k     over valid rows (i + 1 + k <= L)

The draft vocabulary of an EAGLE-3 head is the ``draft_vocab_size`` most frequent target ids of the training
data (EOS always in); it is written as ``d2t`` (draft id -> target id offset) and ``t2d`` (bool over the target
vocabulary), the layout of the published EAGLE-3 checkpoints. A draft vocabulary as large as the target's trains
through the target's LM head (frozen) and is exported the same way: ``lm_head`` = the target's rows, ``d2t`` all
zero, ``t2d`` all true (serving then skips the id map).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.training import StepKV, train_batch
from specserve.speculative.draft_models import eagle3_capture_layers
from specserve.speculative.heads.eagle import EagleHead
from specserve.speculative.heads.eagle3 import Eagle3Head
from specserve.train.corpus import sample_windows
from specserve.train.export import checkpoint_tensors, save_folder
from specserve.train.features import FeatureStream, TopK, topk_cross_entropy
from specserve.train.lm import default_work_dir, soft_cross_entropy
from specserve.train.loop import TrainConfig, autocast, train

STEP_DECAY = 0.8
FEATURE_WEIGHT, TOKEN_WEIGHT = 1.0, 0.1  # EAGLE-1/2's loss weights


@dataclass
class EagleOptions:
    algorithm: str = "EAGLE3"  # EAGLE (EAGLE-1/2 head) or EAGLE3
    ttt_steps: int = 0  # unrolled draft steps; 0 = the algorithm's default (EAGLE 1, EAGLE3 4)
    draft_vocab_size: int = 0  # EAGLE3: 0 = min(target vocabulary, 32768)

    def steps(self) -> int:
        return self.ttt_steps or (4 if self.algorithm == "EAGLE3" else 1)


def head_config(target_cfg: dict, opts: EagleOptions, num_layers: int, draft_vocab: int | None) -> dict:
    """config.json of the head: the target's shape with one layer, in the published EAGLE / EAGLE-3 layouts."""
    cfg = {k: v for k, v in target_cfg.items() if k not in ("num_nextn_predict_layers", "auto_map")}
    cfg.update(num_hidden_layers=1, tie_word_embeddings=False, model_type="llama")
    if opts.algorithm == "EAGLE":
        cfg["architectures"] = ["LlamaForCausalLMEagle"]
        return cfg
    capture = eagle3_capture_layers(num_layers, None)
    cfg.update(architectures=["LlamaForCausalLMEagle3"], target_hidden_size=target_cfg["hidden_size"],
               eagle_config={"eagle_aux_hidden_state_layer_ids": [c - 1 for c in capture],
                             "use_aux_hidden_state": True})
    if draft_vocab:
        cfg["draft_vocab_size"] = draft_vocab
    return cfg


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent ids of the token stream [N] (ids in `always` forced in), ascending [size]."""
    from specserve.speculative.token_map import select_hot_ids

    counts = torch.bincount(tokens.long().cpu(), minlength=vocab_size)[:vocab_size]  # the ids live on the CPU
    return select_hot_ids(counts, size, always).sort().values


def d2t_t2d(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft ids (ascending target ids) [Vd] -> d2t [Vd] int64 (target id - draft id), t2d [V] bool."""
    d2t = draft_ids.long() - torch.arange(draft_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids.long()] = True
    return d2t, t2d


def _head_draft_ids(head: nn.Module, vocab_size: int) -> torch.Tensor | None:
    """A trained EAGLE-3 head's draft vocabulary (ascending target ids [Vd]) from its d2t; None: the target's."""
    if head.lm_head is None or head.d2t.numel() >= vocab_size:
        return None
    return (torch.arange(head.d2t.numel(), device=head.d2t.device) + head.d2t).cpu()


def init_head(head: nn.Module, target: nn.Module, draft_ids: torch.Tensor | None, seed: int) -> None:
    """normal(0, 0.02) matrices, unit norms; an EAGLE-3 LM head starts as the target's rows of its vocabulary."""
    torch.manual_seed(seed)
    for name, p in head.named_parameters():
        with torch.no_grad():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                p.zero_()
    if isinstance(head, Eagle3Head) and head.lm_head is not None:
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[draft_ids.long()])


class EagleTrainer:
    """One object per run: the frozen target, the head, the draft vocabulary and the per-step loss."""

    def __init__(self, target: nn.Module, target_cfg: dict, opts: EagleOptions, tokens: torch.Tensor | None,
                 seed: int, eos_ids: list[int], cache: FeatureStream | None = None, head: nn.Module | None = None):
        """cache: the target's outputs over `tokens`, computed once (``train.features``); the trainer then reads
        them instead of running the target at each step. head: a head trained already, kept as it is (evaluation,
        ``bench.eval_head``): its draft vocabulary is read from its ``d2t``, `tokens` may be None."""
        self.target, self.opts, self.tokens, self.cache = target, opts, tokens, cache
        spec = target.spec
        self.capture = eagle3_capture_layers(spec.num_layers, head.aux_layer_ids() if head is not None else None) \
            if opts.algorithm == "EAGLE3" else ()
        self.draft_ids = self.draft_index = None
        if opts.algorithm == "EAGLE3":
            if head is not None:
                self.draft_ids = _head_draft_ids(head, spec.vocab_size)
            else:
                size = min(opts.draft_vocab_size or 32768, spec.vocab_size)
                if size < spec.vocab_size:
                    self.draft_ids = draft_vocabulary(tokens, spec.vocab_size, size, eos_ids)
            if self.draft_ids is not None:
                # target id -> draft id, -1 outside the draft vocabulary [V]
                self.draft_index = torch.full((spec.vocab_size,), -1, dtype=torch.long)
                self.draft_index[self.draft_ids.long()] = torch.arange(self.draft_ids.numel())
        self.config = head_config(target_cfg, opts, spec.num_layers,
                                  None if self.draft_ids is None else self.draft_ids.numel())
        target.requires_grad_(False)
        if head is not None:
            self.head = head
            return
        cls = Eagle3Head if opts.algorithm == "EAGLE3" else EagleHead
        self.head = cls(cls.spec_from_config(self.config)).to(next(target.parameters()).device)
        if isinstance(self.head, Eagle3Head) and self.draft_ids is not None:
            self.head.d2t = d2t_t2d(self.draft_ids, spec.vocab_size)[0].to(self.head.d2t.device)
        init_head(self.head, target, self.draft_ids, seed)

    # ------------------------------------------------------------------ one step
    def loss(self, cfg: TrainConfig, step: int) -> tuple[torch.Tensor, dict]:
        if self.cache is not None:
            return self._cached_loss(cfg, step)
        x = sample_windows(self.tokens, cfg.batch_size, cfg.seq_len, cfg.seed, step).to(self.tokens.device)
        bsz, seq = x.shape[0], cfg.seq_len  # x [B, L+1]
        with autocast(cfg):
            with torch.no_grad():
                out = self.target(train_batch(x, capture_layers=self.capture))
            z = out.logits.view(bsz, seq + 1, -1)  # [B, L+1, V]
            feats = out.hidden.view(bsz, seq + 1, -1)  # post-norm f
            hidden = (torch.cat(out.aux_hidden, -1).view(bsz, seq + 1, -1) if self.capture else feats)[:, :seq]
            return self._unroll(x, z, feats, hidden.reshape(bsz * seq, -1), cfg)

    def _cached_loss(self, cfg: TrainConfig, step: int) -> tuple[torch.Tensor, dict]:
        x, top, feats, aux, mask = self.cache.window(cfg.batch_size, cfg.seq_len, cfg.seed, step)
        bsz, seq = x.shape[0], cfg.seq_len
        hidden = aux if self.capture else feats[:, :seq]  # [B, L, 3h] or [B, L, h]
        dev = cfg.device
        with autocast(cfg):
            return self._unroll(x.to(dev), TopK(top.ids.to(dev), top.logits.to(dev)), feats.to(dev),
                                hidden.reshape(bsz * seq, -1).to(dev), cfg,
                                None if mask is None else mask.to(dev))

    def _unroll(self, x, z, feats, hidden, cfg: TrainConfig, mask=None,
                counts: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, dict]:
        """z: the target's next-token logits [B, L+1, V], or their top k (TopK, from a feature cache); mask [B, L+1]
        bool: the rows whose label is one to learn (FeatureStream.mask; None: all). counts: receives (rows whose
        argmax is the target's, rows) per unrolled step."""
        bsz, seq = x.shape[0], cfg.seq_len
        step_kv, total, weights, metrics = StepKV(), 0.0, 0.0, {}
        pad = torch.zeros(bsz, seq, dtype=x.dtype, device=x.device)
        rows = torch.arange(seq, device=x.device)
        for k in range(self.opts.steps()):
            ids = torch.cat([x[:, 1 + k :], pad], dim=1)[:, :seq]  # token x_{i+1+k} at row i
            fb = train_batch(ids, position_offset=k, step_kv=step_kv)
            hidden = self.head(fb, self.target.embed(fb.input_ids), hidden)  # [B*L, h]
            valid = (rows <= seq - 1 - k).repeat(bsz)  # [B*L]: the label z_{i+1+k} exists
            if mask is not None:  # and that label is one to learn
                valid = valid & torch.cat([mask[:, 1 + k :], pad.bool()], dim=1)[:, :seq].reshape(-1)
            labels = z.shifted(k, seq) if isinstance(z, TopK) else \
                torch.cat([z[:, 1 + k :], z[:, :k]], dim=1)[:, :seq].reshape(bsz * seq, -1)
            loss_k, hits = self._step_loss(hidden, labels, feats, k, valid)
            total, weights = total + STEP_DECAY**k * loss_k, weights + STEP_DECAY**k
            rows_k = int(valid.sum())
            metrics[f"acc{k}"] = hits / max(rows_k, 1)
            if counts is not None:
                counts.append((hits, rows_k))
        return total / weights, metrics

    def _step_loss(self, hidden, labels, feats, k: int, valid) -> tuple[torch.Tensor, int]:
        """-> (the step's loss, valid rows whose argmax is the target's best id)"""
        if isinstance(self.head, Eagle3Head):
            logits = self.head.lm_head(self.head.norm(hidden)) if self.head.lm_head is not None else \
                self.target.compute_logits(self.head.norm(hidden))
            loss, best = self._token_loss(logits, labels, valid, draft_space=True)
        else:
            logits = self.target.compute_logits(hidden)
            bsz, seq1, h = feats.shape
            want = torch.cat([feats[:, 1 + k :], feats[:, : k]], dim=1)[:, : seq1 - 1].reshape(-1, h)
            feat_loss = F.smooth_l1_loss(hidden.float(), want.float(), reduction="none").mean(-1)
            feat_loss = (feat_loss * valid).sum() / valid.sum().clamp_min(1)
            token_loss, best = self._token_loss(logits, labels, valid, draft_space=False)
            loss = FEATURE_WEIGHT * feat_loss + TOKEN_WEIGHT * token_loss
        hit = (logits.argmax(-1) == best) & valid
        return loss, int(hit.sum())

    def _token_loss(self, logits, labels, valid, draft_space: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """CE against the target's distribution, over the draft vocabulary when draft_space (EAGLE-3) ->
        (loss, the target's best id per row [R], in the logits' vocabulary; -1 when outside it)."""
        index = self.draft_index if draft_space else None
        if isinstance(labels, TopK):
            labels = labels.mapped(None if index is None else index.to(logits.device))
            return topk_cross_entropy(logits, labels, valid), labels.ids[:, 0]
        if draft_space and self.draft_ids is not None:
            labels = labels.index_select(-1, self.draft_ids.to(labels.device))
        return soft_cross_entropy(logits, labels, valid), labels.argmax(-1)

    # ------------------------------------------------------------------ export
    def export(self, out_dir: str, dtype: torch.dtype, tokenizer_dir: str | None) -> None:
        tensors, config = checkpoint_tensors(self.head), self.config
        if isinstance(self.head, Eagle3Head):
            vocab = self.target.spec.vocab_size
            draft_ids = self.draft_ids
            if draft_ids is None:  # the whole vocabulary: the target's LM head, which the head trained through
                draft_ids = torch.arange(vocab)
                tensors["lm_head.weight"] = self.target.lm_head.weight.detach()
                config = {**config, "draft_vocab_size": vocab}
            d2t, t2d = d2t_t2d(draft_ids.cpu(), vocab)
            tensors.update(d2t=d2t, t2d=t2d)
        save_folder(out_dir, config, tensors, dtype, tokenizer_dir)


def train_eagle(target_path: str, tokens: torch.Tensor | None, opts: EagleOptions, cfg: TrainConfig, out_dir: str,
                resume: bool = False, dtype: torch.dtype = torch.bfloat16, work_dir: str | None = None,
                cache: FeatureStream | None = None) -> dict:
    """Train a head for the target folder on the token stream [N] (or on a feature cache's stream and target
    outputs); write it to out_dir (HF folder, loadable by ``--speculative-draft-model-path``). -> the last step's
    metrics (loss, acc0.. per unrolled step)."""
    from transformers import AutoTokenizer

    from specserve.models.loader import load_model, read_config
    from specserve.speculative.token_map import target_vocab_and_eos

    target, _spec, target_dir = load_model(target_path, dtype="float32", device=cfg.device)
    tok = AutoTokenizer.from_pretrained(target_dir)
    _, eos_ids = target_vocab_and_eos(target_dir, tok)
    tokens = cache.tokens if cache is not None else tokens
    trainer = EagleTrainer(target, read_config(target_dir), opts, tokens.to(cfg.device), cfg.seed, eos_ids, cache)
    return train(cfg, trainer.head, lambda step: trainer.loss(cfg, step), work_dir or default_work_dir(out_dir), resume,
                 lambda _s: trainer.export(out_dir, dtype, None), desc=f"Training {opts.algorithm} head")

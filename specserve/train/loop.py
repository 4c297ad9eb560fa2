"""The training loop every specserve trainer shares: AdamW, warm-up + cosine LR, bf16 autocast, gradient
clipping, tqdm progress, periodic checkpoints and ``--resume``.

A trainer supplies the trainable module and ``loss_fn(step) -> (loss, {metric: float})`` (which draws its own
batch for that step, deterministically from the seed); the loop owns optimisation and the trainer state file.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

STATE_FILE = "trainer_state.pt"


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200  # steps between trainer-state saves (and export callbacks)
    device: str = "cpu"
    bf16: bool = True  # autocast matmuls to bf16 (master weights stay float32)
    progress: bool = True
    stop_after: int | None = None  # end this run after that many steps (checkpointed; continue with resume)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1, frac))))


def autocast(cfg: TrainConfig):
    if not cfg.bf16:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16)


def bf16_supported(device: str) -> bool:
    """bf16 autocast pays on CUDA and on CPUs with native bf16 (AVX512-BF16 / AMX); elsewhere it is emulated."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


def train(cfg: TrainConfig, model: nn.Module, loss_fn: Callable[[int], tuple[torch.Tensor, dict]], work_dir: str,
          resume: bool = False, on_checkpoint: Callable[[int], None] | None = None, desc: str = "Training") -> dict:
    """Optimise model's trainable parameters for cfg.steps steps; -> the last step's metrics.

    work_dir receives ``trainer_state.pt`` every cfg.checkpoint_every steps and at the end; on_checkpoint(step)
    runs at the same moments (trainers export their HF-format folder there). resume=True continues from the saved
    state (same config), bit-for-bit as if never stopped.
    """
    from tqdm import tqdm

    if torch.device(cfg.device).type == "cpu":
        from specserve.platform.cpu.malloc import tune_malloc_for_training

        tune_malloc_for_training()
    torch.manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    os.makedirs(work_dir, exist_ok=True)
    state_path = os.path.join(work_dir, STATE_FILE)
    start = 0
    if resume and os.path.isfile(state_path):
        state = torch.load(state_path, map_location=cfg.device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    metrics: dict = {}
    stop = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    bar = tqdm(range(start, stop), desc=desc, initial=start, total=cfg.steps, disable=not cfg.progress,
               dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        model.train()
        loss, metrics = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        metrics = {"loss": float(loss.detach()), **metrics}
        bar.set_postfix({k: f"{v:.3g}" for k, v in metrics.items()})
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == stop:
            torch.save({"step": done, "model": model.state_dict(), "optimizer": opt.state_dict(),
                        "config": asdict(cfg)}, state_path)
            if on_checkpoint is not None:
                on_checkpoint(done)
    model.eval()
    return metrics

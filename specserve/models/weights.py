"""Filling a specserve module from HF checkpoint tensors (shared by target models and draft heads).

Parameter names follow the checkpoints except the fused ``qkv_proj`` and ``gate_up_proj``, which are filled
piece by piece from the separate ``q/k/v_proj`` and ``gate/up_proj`` tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specserve.models.direct_call import DirectCall
from specserve.models.layers import FUSED_PIECES, fused_shard_range
from specserve.models.tensor_parallel import shard_rules, take_shard


class CheckpointLoadable(DirectCall):
    """Mixin for modules loaded by ``specserve.models.loader.load_model``."""

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors that are expected but not used (recomputed buffers, tied copies)."""
        return "rotary_emb.inv_freq" in name

    def optional_weights(self) -> set[str]:
        """Parameters a checkpoint may omit (they keep their initial value)."""
        return set()

    def tie_weights(self) -> None:
        """Re-establish shared parameters after ``to_empty`` (which unties them)."""

    def init_optional_weights(self) -> None:
        """Give optional parameters a defined value before loading (``to_empty`` leaves garbage)."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name in self.optional_weights():
                params[name].zero_()

    def expected_weights(self) -> set[tuple[str, int]]:
        """(parameter name, shard) pairs a checkpoint must provide (shard -1 = whole tensor)."""
        out = set()
        optional = self.optional_weights()
        for name, _ in self.named_parameters():
            if name in optional:
                continue
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                out.update((name, s) for s in range(3))
            elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
                out.update((name, s) for s in range(2))
            else:
                out.add((name, -1))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set, list[str]]:
        """Copy checkpoint tensors in; returns (loaded (name, shard) pairs, unexpected names)."""
        params = dict(self.named_parameters())
        rules = shard_rules(self)  # tensor parallelism: this rank's slices (none: every tensor whole)
        loaded: set[tuple[str, int]] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if self.skip_checkpoint_tensor(name):
                continue
            target = self._load_fused(params, name, tensor, rules)
            if target is None and name in params:
                copy_checked(params[name], take_shard(tensor, rules.get((name, -1)), params[name]), name)
                target = (name, -1)
            if target is None:
                unexpected.append(name)
            else:
                loaded.add(target)
        return loaded, unexpected

    def _load_fused(self, params: dict, name: str, tensor, rules: dict) -> tuple[str, int] | None:
        for piece, fused, shard in FUSED_PIECES:
            if piece in name:
                fused_name = name.replace(piece, fused)
                if fused_name not in params:
                    return None
                owner = self.get_submodule(fused_name.rsplit(".", 2)[0])
                lo, hi = fused_shard_range(owner, fused, shard)
                dst = params[fused_name].data[lo:hi]
                copy_checked(dst, take_shard(tensor, rules.get((fused_name, shard)), dst), name)
                return fused_name, shard
        return None


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)

"""Writing trained modules as HF-format folders (config.json + model.safetensors), in the checkpoint layouts the
loaders read: fused ``qkv_proj`` / ``gate_up_proj`` are split back into ``q/k/v_proj`` / ``gate/up_proj``."""

from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn

from specserve.models.layers import FUSED_PIECES, fused_shard_range

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def checkpoint_tensors(module: nn.Module, prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """module's parameters and persistent buffers under checkpoint names: fused projections split into their
    pieces, names starting with any of `skip` left out, `prefix` prepended."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict().items():
        if name.startswith(skip):
            continue
        pieces = [(piece, fused, shard) for piece, fused, shard in FUSED_PIECES if fused in name]
        if not pieces:
            out[prefix + name] = tensor
            continue
        owner = module.get_submodule(name.rsplit(".", 2)[0])
        for piece, fused, shard in pieces:
            lo, hi = fused_shard_range(owner, fused, shard)
            out[prefix + name.replace(fused, piece)] = tensor[lo:hi]
    return out


def save_folder(out_dir: str, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                tokenizer_dir: str | None = None) -> None:
    """Write config.json and model.safetensors (floating tensors cast to dtype), copy the tokenizer files."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    cast = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
            for k, v in tensors.items()}
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(cast, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if tokenizer_dir and os.path.abspath(tokenizer_dir) != os.path.abspath(out_dir):
        copy_tokenizer(tokenizer_dir, out_dir)


def copy_tokenizer(src: str, dst: str) -> None:
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def dtype_from_name(name: str) -> torch.dtype:
    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(table)})")
    return table[name]

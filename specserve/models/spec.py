"""ModelSpec: the architecture facts specserve needs, read from an HF ``config.json`` dict.

Reading the raw dict (not a transformers config class) keeps loading independent of the installed
transformers version: old checkpoints spell RoPE as ``rope_theta`` + ``rope_scaling``, new ones as
``rope_parameters``; both are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and o for Llama) projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    hidden_act: str
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], qkv_bias: bool | None = None, qk_norm: bool = False,
                    hidden_act: str | None = None) -> ModelSpec:
        """qkv_bias: None = read ``attention_bias`` (Llama), True = always (Qwen2).
        hidden_act: None = read ``hidden_act`` (silu only); a name = the model class read and checked it itself."""
        arch = (cfg.get("architectures") or ["?"])[0]
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias
        theta, scaling = _rope(cfg)
        act = cfg.get("hidden_act", "silu") if hidden_act is None else hidden_act
        if hidden_act is None and act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias if qkv_bias is None else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            hidden_act=act,
            eos_token_ids=_as_list(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=cfg,
        )


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return float(theta), (None if rope_type == "default" else dict(params, rope_type=rope_type))
    scaling = cfg.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rope_type == "default" else dict(scaling, rope_type=rope_type)
    return float(cfg.get("rope_theta", 10000.0)), scaling

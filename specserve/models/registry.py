"""architectures[0] of an HF config -> specserve model class."""

from __future__ import annotations

from torch import nn

from specserve.models.gemma import GemmaForCausalLM
from specserve.models.llama import LlamaForCausalLM
from specserve.models.mimo import MiMoForCausalLM
from specserve.models.qwen2 import Qwen2ForCausalLM
from specserve.models.qwen3 import Qwen3ForCausalLM
from specserve.models.spec import UnsupportedModelError

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "GemmaForCausalLM": GemmaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MiMoForCausalLM": MiMoForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def register_model(architecture: str, cls: type[nn.Module]) -> None:
    MODEL_REGISTRY[architecture] = cls


def resolve_architecture(cfg: dict, registry: dict[str, type[nn.Module]] | None = None) -> type[nn.Module]:
    registry = MODEL_REGISTRY if registry is None else registry
    archs = cfg.get("architectures") or []
    if not archs:
        raise UnsupportedModelError("config.json has no 'architectures' entry; cannot pick a model class")
    cls = registry.get(archs[0])
    if cls is None:
        supported = ", ".join(sorted(registry))
        raise UnsupportedModelError(f"architecture {archs[0]!r} is not supported; supported: {supported}")
    return cls

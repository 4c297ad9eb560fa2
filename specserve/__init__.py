"""specserve: an LLM serving engine built around lossless speculative decoding."""

from specserve.config import ServerArgs
from specserve.sampling.params import SamplingParams
from specserve.version import __version__

__all__ = ["Engine", "SamplingParams", "ServerArgs", "__version__"]


def __getattr__(name: str):
    if name == "Engine":  # imported lazily: it pulls in torch and transformers
        from specserve.engine import Engine

        return Engine
    raise AttributeError(name)

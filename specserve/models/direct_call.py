"""Modules whose call goes straight to ``forward``.

``nn.Module.__call__`` dispatches forward hooks (and their global registries) on every call, a few microseconds
each. specserve registers no hooks, and a small model's decode step makes hundreds of module calls, so on CPU that
dispatch was about 8% of a decode forward of the demo model (5.7 -> 5.3 ms, bf16) and of the tiny benchmark model.
Every module of the inference path derives from ``DirectCall`` (``Linear`` and ``Embedding`` are torch's with
the direct call); hooks registered on them are therefore not run.
"""

from __future__ import annotations

import torch
from torch import nn


class DirectCall(nn.Module):
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Linear(DirectCall, nn.Linear):
    pass


class Embedding(DirectCall, nn.Embedding):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of the table, straight from ``torch.embedding``: ``F.embedding``'s checks and its padding index
        (which only masks gradients) took a one-token lookup from 3.5 to 5.5 us (bf16 [4096, 256] table, timed alone
        on the reference Xeon). With ``max_norm`` (which renormalizes rows) torch's own forward."""
        if self.max_norm is not None:
            return super().forward(input_ids)
        return torch.embedding(self.weight, input_ids)

    def reset_parameters(self) -> None:
        """torch's random init, except on the meta device (the loader's model, whose weights come from the
        checkpoint), where it would only import torch._dynamo: about 1 s of a server's start-up."""
        if self.weight.device.type != "meta":
            super().reset_parameters()

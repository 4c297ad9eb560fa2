"""Platform tuning: what a serving process changes about itself and its models for the device it runs on.

``platform_policy(args, device)`` makes the ``PlatformPolicy`` that carries these decisions, once at start-up
(``ModelRunner`` keeps it as ``runner.platform``): ``CpuPolicy`` on CPU, the plain ``PlatformPolicy`` elsewhere.
``cpu/`` holds the CPU side: the policy, the thread count (``cpus.py``, ``governor.py``), OpenMP worker pools
(``omp.py``), glibc's allocator (``malloc.py``) and oneDNN weight packing (``packing.py``).

A leaf package: it imports torch and ``models/direct_call.py`` / ``models/one_row.py`` only, so models/,
attention/, speculative/ and scheduler/ may all import it.
"""

from __future__ import annotations

import torch

from specserve.platform.cpu.policy import CpuPolicy
from specserve.platform.policy import PlatformPolicy


def platform_policy(args, device: torch.device) -> PlatformPolicy:
    """The tuning policy for a process serving with ``args`` (ServerArgs) on ``device``."""
    if device.type == "cpu":
        return CpuPolicy(args, device)
    return PlatformPolicy(args, device)


__all__ = ["CpuPolicy", "PlatformPolicy", "platform_policy"]

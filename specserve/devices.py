"""What ``--device`` names, for decisions taken before any model loads (argument parsing, a bundled head's default
tree). A leaf module: it imports torch only, so every package may use it."""

from __future__ import annotations


def runs_on_cpu(device: str) -> bool:
    """--device names the CPU, or auto finds no CUDA device."""
    if device == "cpu":
        return True
    if device != "auto":
        return False
    import torch

    return not torch.cuda.is_available()

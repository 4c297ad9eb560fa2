"""CpuPolicy: where the CPU tweaks apply (the allocator, threads, oneDNN packing).

The mechanisms, and the measurements behind them, live beside this file (``malloc.py``, ``omp.py``, ``packing.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.platform.cpu.malloc import tune_malloc
from specserve.platform.cpu.packing import pack_linears_for_cpu
from specserve.platform.policy import PlatformPolicy


class CpuPolicy(PlatformPolicy):
    @property
    def packs_weights(self) -> bool:
        """oneDNN-packed linears unless ``--disable-cpu-weight-packing``."""
        return not self.args.disable_cpu_weight_packing

    # ------------------------------------------------------------------ the process
    def tune_allocator(self) -> bool:
        """glibc malloc keeps freed activation buffers (``malloc.py``)."""
        return tune_malloc()

    def configure_threads(self) -> None:
        if self.args.num_threads:
            torch.set_num_threads(self.args.num_threads)

    # ------------------------------------------------------------------ weights
    def pack_weights(self, module: nn.Module) -> int:
        """bf16/fp16 linears -> oneDNN-packed ``PackedLinear`` (``packing.py``)."""
        return pack_linears_for_cpu(module) if self.packs_weights else 0

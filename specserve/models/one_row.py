"""One-row linear calls on CPU: PyTorch's own matrix-vector kernel, reached with oneDNN switched off.

For one half-precision row, oneDNN's kernels (packed or not) stream a weight at about half the speed of PyTorch's
gemv on some CPUs (``platform/cpu/packing.py`` has the figures; ``platform/cpu/one_row_probe.py`` checks each
model at load and keeps the plain weights only where gemv wins). ``PackedLinear`` sends its one-row calls there
(``cpu_gemv``); a compiled one-token forward runs its whole graph under ``onednn_off`` (``models/compile.py``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

#: Calls of at most this many rows take ``cpu_gemv`` where a PackedLinear keeps its plain weight: at 1 row it can
#: stream the weights twice as fast as the packed kernel, at 2 rows they tie (``platform/cpu/packing.py``).
GEMV_MAX_ROWS = 1


@contextmanager
def onednn_off():
    """oneDNN switched off while the block runs, so that ``F.linear`` on a half-precision weight takes PyTorch's own
    kernel: for one row, its matrix-vector product. The packed kernel is called directly and does not look at the
    switch. The switch is process-wide; specserve runs its forwards on one thread at a time."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def one_row_forward(input_ids: torch.Tensor) -> bool:
    """A forward whose every linear call has at most GEMV_MAX_ROWS rows (its token count), on CPU: a compiled one runs
    under ``onednn_off`` as a whole (``models.compile``), its graph calling ``F.linear`` on the plain weights directly
    (a call through a custom op costs about as much as the fusion saves)."""
    return input_ids.device.type == "cpu" and input_ids.numel() <= GEMV_MAX_ROWS

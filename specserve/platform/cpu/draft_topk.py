"""A draft head's ranking of its next tokens in one operator call (``draft_topk`` in ``ops.cpp``).

Each draft level of an EAGLE-3 tree ranks the head's next tokens: its final norm, its LM head over the draft
vocabulary, float32, an optional scale (``--speculative-draft-score-temperature``), a softmax, the top-k and the
draft -> target id map. As single operators that is six calls from Python, each a few microseconds of dispatch before
a kernel that takes about as long, for a handful of rows (docs/benchmarks.md, "Draft levels in fewer calls"). The
operator runs the norm and the LM head on the kernels the modules use (same bf16 logits), then the softmax and the
top-k in one pass over each row: the probabilities may differ from torch's softmax in the last bits (another exp,
another order of the sum), which only the tree's ranking reads; equal values rank the smaller id first.

A head takes it (``HeadTopk.for_head``) where its norm is an RMSNorm and its LM head a linear on this build's few-row
kernel (as ``fused_layer``'s layers), for the calls whose rows that kernel takes; ``SPECSERVE_CPU_FUSED_LAYER=off``
keeps the single operators here too.
"""

from __future__ import annotations

import torch

from specserve.models.layers import RMSNorm
from specserve.platform.cpu import elementwise
from specserve.platform.cpu.fused_layer import _kernel_copy, available, kernel_linear
from specserve.platform.cpu.ops import cpu_op, registered


def draft_topk_reference(x, norm, eps, linear, scale, k, to_target=None, amx_from=0, noise=None, inv_temps=None,
                         rows_per_group=1, allowed=None):
    """The operator's steps as single operators: x [R, h] bf16 -> (probabilities [R, k] float32, ids [R, k] int64)."""
    logits = kernel_linear(elementwise.rms_norm(x, norm, eps), *linear, amx_from).float()  # [R, V]
    if noise is not None:  # a race: each group's rows scored with its temperature and its noise
        G, V = noise.shape
        logits = (logits.view(G, rows_per_group, V) * inv_temps.view(G, 1, 1) - noise.view(G, 1, V)).view(-1, V)
    elif scale != 1.0:
        logits = logits * scale
    if allowed is not None:  # the bits of each column's token
        tokens = torch.arange(logits.shape[1]) if to_target is None else to_target  # [V]
        words = allowed[:, (tokens // 32).clamp(max=allowed.shape[1] - 1)]  # [R, V]
        bits = (words >> (tokens % 32).to(torch.int32)) & 1
        logits = logits.masked_fill((bits == 0) | (tokens >= 32 * allowed.shape[1]), float("-inf"))
    p, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return p.nan_to_num(0.0), (ids if to_target is None else to_target[ids])


def _fake(x, norm, eps, linear, scale, k, to_target=None, amx_from=0, noise=None, inv_temps=None, rows_per_group=1,
          allowed=None):
    return x.new_empty(x.shape[0], k, dtype=torch.float32), x.new_empty(x.shape[0], k, dtype=torch.int64)


# x [R, h] bf16, norm [h]; linear: (packed, int8 scales or None, bias or None) of the LM head; scale: the logits'
# factor before the softmax; to_target [V] int64 or None; noise [G, V] float32 and inv_temps [G]: row r of group
# r // rows_per_group scored logit * inv_temps[g] - noise[g] instead; allowed [R, W] int32: a grammar's bitmask rows
# over the target vocabulary (the tokens they do not allow never ranked) -> (probabilities [R, k] float32, ids [R, k])
draft_topk = cpu_op("draft_topk(Tensor x, Tensor norm, float eps, Tensor?[] linear, float scale, int k, "
                    "Tensor? to_target=None, int amx_from=0, Tensor? noise=None, Tensor? inv_temps=None, "
                    "int rows_per_group=1, Tensor? allowed=None) -> (Tensor, Tensor)", draft_topk_reference, _fake)


def native() -> bool:
    """``ops.cpp`` registered the operator's C++ implementation (the fused layers' condition, ``available``)."""
    return available() and registered("draft_topk")


class HeadTopk:
    """A head's ranking through the operator: its norm's weight and its LM head's kernel copy, read once."""

    def __init__(self, norm: RMSNorm, lm_head: torch.nn.Module) -> None:
        self.norm, self.eps = norm.weight, norm.eps
        self.copy = getattr(lm_head, "small", None) or getattr(lm_head, "few_rows", None)
        self.linear = list(_kernel_copy(lm_head))
        self.amx_from = getattr(self.copy, "amx_from", 0)
        self.vocab = lm_head.out_features  # V: the logits' columns

    @classmethod
    def for_head(cls, norm, lm_head) -> HeadTopk | None:
        """The head's ranking through the operator, or None where it cannot take it (see the module's docstring)."""
        if type(norm) is not RMSNorm or lm_head is None or _kernel_copy(lm_head) is None or not native():
            return None
        return cls(norm, lm_head)

    def fits(self, x: torch.Tensor) -> bool:
        """x [R, h] is a call the operator takes: bf16, and a row count the LM head's kernel takes."""
        return (x.dtype == torch.bfloat16 and x.dim() == 2 and not torch.compiler.is_compiling()
                and (self.copy is None or self.copy.takes(x)))

    def __call__(self, x: torch.Tensor, k: int, scale: float, to_target: torch.Tensor | None,
                 race: tuple[torch.Tensor, torch.Tensor, int] | None = None, allowed: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [R, h] -> (probabilities [R, k], ids [R, k]) of softmax(logits * scale), or with race = (noise [G, V],
        inv_temps [G], rows per group) of softmax(logits * inv_temps - noise) per group of rows; allowed [R, W] int32:
        a grammar's bitmask rows, the tokens they do not allow never ranked (probabilities 0 on a row with nothing
        left). None where the call does not fit the operator (``fits``)."""
        if not self.fits(x):
            return None
        noise, inv_temps, per = (None, None, 1) if race is None else race
        return draft_topk(x, self.norm, self.eps, self.linear, scale if race is None else 1.0, k, to_target,
                          self.amx_from, noise, inv_temps, per, allowed)

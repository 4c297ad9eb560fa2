"""Per-position acceptance statistics (vLLM's ``num_accepted_tokens_per_pos``), pure Python.

For one verify step of one request whose draft reached depth D (the deepest drafted node along any branch of its
tree or chain) and where the target accepted A drafted tokens (A <= D, the accepted path's length below the root):
position k (1-based draft depth) counts as accepted iff A >= k. Accumulated over steps, ``counts[k-1]`` is the
number of verify steps that accepted at least k drafted tokens, and the acceptance rate at position k is
``counts[k-1] / verify_steps`` (every verify step counts in the denominator, also one with a root-only tree).
The rates never increase with k, and ``sum(counts)`` is the total number of accepted drafted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def position_increments(accepted: int, depth: int) -> list[int]:
    """One step's per-position increments: ``[1] * accepted + [0] * (depth - accepted)`` (length = depth)."""
    if not 0 <= accepted <= depth:
        raise ValueError(f"accepted drafts {accepted} must be within 0..draft depth {depth}")
    return [1] * accepted + [0] * (depth - accepted)


def add_step(counts: list[int], accepted: int, depth: int) -> None:
    """Fold one verify step into ``counts`` in place, growing it to ``depth`` positions if needed."""
    inc = position_increments(accepted, depth)
    if len(counts) < len(inc):
        counts.extend([0] * (len(inc) - len(counts)))
    for k, v in enumerate(inc):
        counts[k] += v


def sum_counts(lists: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise sum of per-position count lists of different lengths (missing positions count 0)."""
    out = [0] * max((len(c) for c in lists), default=0)
    for c in lists:
        for k, v in enumerate(c):
            out[k] += v
    return out


def position_rates(counts: Sequence[int], verify_steps: int) -> list[float]:
    """Acceptance rate per position: ``counts[k] / verify_steps`` (all zeros before the first step)."""
    return [c / verify_steps if verify_steps else 0.0 for c in counts]


def accept_length(metas: list[dict]) -> float:
    """Tokens per verify step over requests' meta_info (SGLang's completion_tokens / verify steps), leaving out
    the tokens of plain steps batch-aware speculation ran instead (``spec_plain_tokens``); 0.0 without verify."""
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    tokens = sum(m["completion_tokens"] - m.get("spec_plain_tokens", 0) for m in metas)
    return tokens / verify if verify else 0.0

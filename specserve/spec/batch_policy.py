"""Batch-aware speculation: which draft tree (or none) a decode step of B running requests uses.

Speculation trades extra target work (B x N verified tokens, B x K drafted tokens per level) for fewer steps. At
batch 1 a step is bound by reading the weights, so verifying 8 tokens costs about what 1 does; as B grows the
verify forward gets compute-bound and the extra tokens stop being free. Two mechanisms, both per step:

1. **The tree shrinks with the batch** (``shape_for_batch``, a pure function): the full tree (S, K, N) is used
   while B x N fits ``--speculative-batch-token-budget``; beyond it the tree becomes a chain (topk 1) of
   ``budget // B`` nodes, and below 2 nodes per request (or above ``--speculative-disable-batch-size``)
   speculation is off for that step.
2. **Speculation is turned off where it does not pay** (``BatchPolicy``, unless
   ``--disable-speculative-auto-off``): the policy measures the throughput (tokens per second of step time) of
   speculative and plain steps per batch-size bucket (exponential moving averages) and runs the faster mode,
   trying the other one every ``explore_every`` steps of the bucket so the estimate follows changing acceptance
   (e.g. temperature-1 requests, a poor draft, a different workload).

Switching is free of output effects: a plain step produces the token plain decoding would; the drafter's state
is kept per request and catches up on the tokens it missed before the next speculative step
(``SpecDecoder``'s backlog), so speculation resumes when the batch shrinks again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA_WEIGHT = 0.2  # weight of the newest step time in the running averages
EXPLORE_EVERY = 32  # steps of a bucket between two tries of the mode currently losing


@dataclass(frozen=True)
class TreeShape:
    """A draft tree's size: depth S (draft levels), branching K, N verified nodes per request (root included)."""

    steps: int
    topk: int
    num_draft_tokens: int


def shape_for_batch(batch: int, full: TreeShape, token_budget: int, disable_batch_size: int | None) -> TreeShape | None:
    """The tree for a step of `batch` requests; None = no speculation (a plain decode step).

    token_budget <= 0 means no shrinking. A chain of n nodes has n - 1 draft levels, at most the full depth.
    """
    if disable_batch_size is not None and batch > disable_batch_size:
        return None
    if token_budget <= 0 or batch * full.num_draft_tokens <= token_budget:
        return full
    nodes = min(token_budget // batch, full.steps + 1)
    if nodes < 2:
        return None
    return TreeShape(nodes - 1, 1, nodes)


def bucket_of(batch: int) -> int:
    """Batch sizes 1..8 are their own bucket; larger ones share a power-of-two bucket (9..16 -> 16, ...)."""
    if batch <= 8:
        return batch
    return 1 << (batch - 1).bit_length()


@dataclass
class _Rates:
    """Running throughput estimates (tokens / second of step time) of one bucket, plus its step counter."""

    spec: float | None = None
    plain: float | None = None
    steps: int = 0

    def update(self, speculative: bool, tokens_per_s: float) -> None:
        old = self.spec if speculative else self.plain
        new = tokens_per_s if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * tokens_per_s
        if speculative:
            self.spec = new
        else:
            self.plain = new


@dataclass
class BatchPolicy:
    full: TreeShape
    token_budget: int = 64
    disable_batch_size: int | None = None
    auto_off: bool = True
    explore_every: int = EXPLORE_EVERY
    rates: dict[int, _Rates] = field(default_factory=dict)

    def choose(self, batch: int) -> TreeShape | None:
        """The tree for the next step of `batch` requests, or None for a plain step."""
        shape = shape_for_batch(batch, self.full, self.token_budget, self.disable_batch_size)
        if shape is None or not self.auto_off:
            return shape
        r = self.rates.setdefault(bucket_of(batch), _Rates())
        r.steps += 1
        if r.spec is None:
            return shape
        if r.plain is None:
            return None
        spec_wins = r.spec >= r.plain
        if r.steps % self.explore_every == 0:  # refresh the loser's estimate now and then
            spec_wins = not spec_wins
        return shape if spec_wins else None

    def record(self, batch: int, speculative: bool, seconds: float, tokens: int) -> None:
        """A step of `batch` requests took `seconds` and produced `tokens` tokens (all requests together)."""
        if self.auto_off and seconds > 0:
            self.rates.setdefault(bucket_of(batch), _Rates()).update(speculative, tokens / seconds)

    def summary(self) -> dict[str, dict]:
        """Per bucket: the current estimates (tokens/s) and which mode wins (for the server info)."""
        out = {}
        for b, r in sorted(self.rates.items()):
            winner = None if r.spec is None or r.plain is None else ("spec" if r.spec >= r.plain else "plain")
            out[str(b)] = {"spec_tok_s": r.spec, "plain_tok_s": r.plain, "steps": r.steps, "winner": winner}
        return out

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
   speculative and plain steps per batch-size bucket (decayed sums of tokens and of step seconds) and runs the
   faster mode, trying the other one (TRY_STEPS steps, measured afresh) after ``explore_every`` steps of the
   bucket so the estimate follows changing acceptance
   (e.g. temperature-1 requests, a poor draft, a different workload); each try that confirms the winner doubles
   the interval (up to MAX_EXPLORE_EVERY), so a mode that keeps losing costs less and less. A try whose mode falls
   clearly behind (by more than CLEAR_LOSS) ends at that measured step and quadruples the interval (a mode's first
   estimate in a bucket of up to PLAIN_FIRST_ABOVE requests is measured over a whole try; buckets of more measure
   plain steps first, since speculation usually loses there): a step's time
   varies far less than that between steps, so more steps of a mode that slow would only repeat the loss (the
   demo's sampled batches of 16: speculative steps at about 0.65x plain ones' rate). A mode's rate is
   its tokens per step over its seconds per step; speculation's tokens per step come from a longer window
   (ACCEPT_DECAY) that a try does not restart, since acceptance varies from step to step far more than step time.
   Estimates are kept per batch-size bucket AND per kind of batch (``batch_kind``: all greedy, all sampled, or
   mixed, each with or without a grammar-constrained request), since sampled requests accept differently from
   greedy ones and a grammar's masks cost a speculative step more than a plain one: a workload's sampled batches
   never decide for its greedy batches of the same size, nor its structured outputs for its free text, nor the
   reverse.
   Two guards keep cold steps out of the estimates: the first WARMUP_STEPS steps of every try are run but their time is
   not measured (a speculative one's accepted tokens are; first calls pay allocations, caches and lazy compilation, and
   after a switch the other mode's weights and buffers have left the CPU caches: measured right after speculative steps,
   the demo's plain steps at batch 16 took 7-10% longer than in a plain engine, which made a tie look like a win for
   whichever mode was running), and a step during which torch.compile built a graph is not measured either, and a try
   gets one more step for it (``--enable-torch-compile`` builds graphs for new shapes well after the first steps,
   seconds each).
   A try does not start for a batch about to end (no request with MIN_TRY_TOKENS new tokens left, by
   ``max_new_tokens``) whose drafter is behind (requests with plain-decoded tokens not replayed to it): its first
   speculative step would replay them all, for a few tokens, and the batch could not use what the try measures.
   A bucket not measured yet runs plain steps until a batch can start its try (a batch that shrinks as its requests
   end, after plain steps at its full size, reaches sizes met for the first time with a few tokens left).
   Speculative steps must beat plain ones by more than SPEC_MARGIN to run: speculation has costs its steps do not
   show (the drafter's catch-up on every prompt, and requests that finish at different steps, so their successors
   arrive one by one and prefill in more, smaller forwards), so a tie between the two rates is a loss for it.

A third rule needs no measuring (``fit_to_remaining``): no tree is deeper than the batch's requests can use. A node
at depth d becomes the (d+1)-th new token of its request, so with at most R new tokens left to any request of the
batch (``max_new_tokens`` minus what it has) the tree keeps at most R - 1 draft levels, and with R = 1 the step is a
plain one: it makes the same single token without drafting. (Per request, ``tree.cap_depth`` drops the nodes a
request with fewer tokens left cannot emit.)

Switching is free of output effects: a plain step produces the token plain decoding would; the drafter's state
is kept per request and catches up on the tokens it missed before the next speculative step
(``SpecDecoder``'s backlog), so speculation resumes when the batch shrinks again. That catch-up is a cost of
speculating: it is timed with the speculative step it precedes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.speculative.tree import max_tree_nodes

DECAY = 0.9  # weight of the older steps in a mode's running sums (an effective window of about 10 steps)
#: weight of the older steps in speculation's tokens per step (a window of about 50 steps, kept across tries): how many
#: tokens a step accepts varies from step to step far more than what a step costs, so a try's few steps measure its
#: time well and its acceptance poorly
ACCEPT_DECAY = 0.98
TRY_STEPS = 4  # consecutive steps a try of a mode runs; that mode's estimate restarts from them
EXPLORE_EVERY = 32  # steps of a bucket between two tries of the mode currently losing (at first)
MAX_EXPLORE_EVERY = 1024  # the interval doubles each time a try confirms the winner, up to this
WARMUP_STEPS = 2  # the first steps of every try run unmeasured (cold caches, lazy compilation)
SPEC_MARGIN = 0.03  # speculation wins only when faster than plain decoding by more than this fraction
MIN_TRY_TOKENS = 16  # new tokens left, below which a batch whose drafter is behind starts no try
CLEAR_LOSS = 0.25  # a try's mode this far below the other's rate has lost: its try ends at once
CLEAR_BACKOFF = 4  # and the interval to its next try grows by this factor (2 for a narrower loss)
#: buckets of more requests than this measure plain steps first, and their first try of speculation may end early
#: too: a step's accepted tokens are summed over that many requests, so one step already measures acceptance fairly
PLAIN_FIRST_ABOVE = 8


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


def fit_to_remaining(shape: TreeShape, most_new: int) -> TreeShape | None:
    """shape for a step in which no request can take more than `most_new` new tokens: at most most_new - 1 draft
    levels (a node at depth d would be the (d+1)-th new token), the node count cut to what those levels hold;
    None (a plain step) when most_new <= 1."""
    levels = most_new - 1
    if levels < 1:
        return None
    if shape.steps <= levels:
        return shape
    return TreeShape(levels, shape.topk, min(shape.num_draft_tokens, max_tree_nodes(levels, shape.topk)))


GREEDY, SAMPLED, MIXED = "greedy", "sampled", "mixed"
GRAMMAR = "+grammar"  # a kind's batches with a grammar-constrained request


def batch_kind(greedy: list[bool], constrained: list[bool] | None = None) -> str:
    """The kind of a batch from its requests' greedy flags: GREEDY, SAMPLED or MIXED; with GRAMMAR appended where
    some request is constrained by a grammar (its masks add to a speculative step's cost, and it accepts otherwise)."""
    kind = GREEDY if all(greedy) else SAMPLED if not any(greedy) else MIXED
    return kind + GRAMMAR if constrained is not None and any(constrained) else kind


def bucket_of(batch: int) -> int:
    """Batch sizes 1..8 are their own bucket; larger ones share a power-of-two bucket (9..16 -> 16, ...)."""
    if batch <= 8:
        return batch
    return 1 << (batch - 1).bit_length()


@dataclass
class _Mode:
    """Decayed sums of one mode's steps in one bucket: tokens, seconds and steps (DECAY), and, for speculation, its
    tokens and steps over a longer window (ACCEPT_DECAY) that a try does not restart. rate = tokens per second: tokens
    per step (speculation's over the longer window) over seconds per step."""

    speculative: bool = False
    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0
    long_tokens: float = 0.0
    long_steps: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds
        self.steps = DECAY * self.steps + 1
        self.add_acceptance(tokens)

    def add_acceptance(self, tokens: int) -> None:
        """A step's tokens in the longer window; alone for a step whose time is not measured (a try's warm-up), which
        still counts in speculation's tokens per step."""
        self.long_tokens = ACCEPT_DECAY * self.long_tokens + tokens
        self.long_steps = ACCEPT_DECAY * self.long_steps + 1

    def restart(self) -> None:
        """A try's first measured step comes next: step times afresh; speculation's acceptance is kept."""
        self.tokens = self.seconds = self.steps = 0.0

    @property
    def rate(self) -> float | None:
        if self.seconds <= 0:
            return None
        if not self.speculative:
            return self.tokens / self.seconds
        return (self.long_tokens / self.long_steps) / (self.seconds / self.steps)


@dataclass
class _Bucket:
    """One batch-size bucket: both modes' estimates, the step counter and the exploration state."""

    interval: int  # steps between two tries of the losing mode
    next_try: int  # step number of the next try
    size: int = 1  # the bucket (``bucket_of``): the most requests its batches hold
    spec: _Mode = field(default_factory=lambda: _Mode(speculative=True))
    plain: _Mode = field(default_factory=_Mode)
    steps: int = 0
    trying: bool | None = None  # the mode (True = speculative) a try is measuring, else None
    try_choices: int = 0  # steps of the current try still to hand out
    try_records: int = 0  # steps of the current try still to be measured
    try_skip: int = 0  # warm-up steps of the current try still to be run unmeasured
    try_refresh: bool = False  # the current try's mode had an estimate before it (not its first measurement)

    def start_try(self, speculative: bool, warmup: int = 0) -> None:
        """The next TRY_STEPS steps run `speculative`; its estimate restarts from them (fresh conditions) at the
        first of them that is measured. The try runs `warmup` more steps first, which are not measured."""
        self.try_skip = warmup
        self.try_refresh = self.mode(speculative).rate is not None
        self.trying, self.try_choices, self.try_records = speculative, TRY_STEPS + self.try_skip, TRY_STEPS

    def mode(self, speculative: bool) -> _Mode:
        """The estimate of speculative (True) or plain (False) steps."""
        return self.spec if speculative else self.plain

    def winner(self) -> bool | None:
        """True = speculative steps are faster than plain ones by more than SPEC_MARGIN, False = they are not (plain
        runs), None = not both measured yet."""
        if self.spec.rate is None or self.plain.rate is None:
            return None
        return self.spec.rate > self.plain.rate * (1.0 + SPEC_MARGIN)

    def clearly_behind(self, speculative: bool) -> bool:
        """Speculative (True) or plain (False) steps run below the other mode's rate by more than CLEAR_LOSS (both
        measured)."""
        own, other = self.mode(speculative).rate, self.mode(not speculative).rate
        return own is not None and other is not None and own < other * (1.0 - CLEAR_LOSS)


@dataclass
class BatchPolicy:
    full: TreeShape
    token_budget: int = 64
    disable_batch_size: int | None = None
    auto_off: bool = True
    explore_every: int = EXPLORE_EVERY
    warmup_steps: int = WARMUP_STEPS
    rates: dict[tuple[int, str], _Bucket] = field(default_factory=dict)

    def _bucket(self, batch: int, kind: str) -> _Bucket:
        b = (bucket_of(batch), kind)
        if b not in self.rates:
            self.rates[b] = _Bucket(self.explore_every, self.explore_every, b[0])
        return self.rates[b]

    def choose(self, batch: int, kind: str = GREEDY, most_new: int | None = None,
               drafter_behind: bool = False) -> TreeShape | None:
        """The tree for the next step of `batch` requests of this kind (``batch_kind``), or None for a plain
        step. most_new: the most new tokens any of them may still make (None: unbounded); a step that cannot use a
        draft is plain without being counted as a choice of the bucket (``fit_to_remaining``). drafter_behind: some
        of them have plain-decoded tokens the drafter has not caught up on."""
        shape = shape_for_batch(batch, self.full, self.token_budget, self.disable_batch_size)
        if shape is not None and most_new is not None:
            shape = fit_to_remaining(shape, most_new)
        if shape is None or not self.auto_off:
            return shape
        r = self._bucket(batch, kind)
        r.steps += 1
        ends_soon = most_new is not None and most_new < MIN_TRY_TOKENS
        if r.trying is None and not (ends_soon and drafter_behind):
            self._maybe_start_try(r)
        if r.trying is not None and r.try_choices > 0:
            r.try_choices -= 1
            return shape if r.trying else None
        return shape if r.winner() else None  # unmeasured (no try could start yet): plain

    def _maybe_start_try(self, r: _Bucket) -> None:
        """Start the try a bucket needs now, if any: speculation first (plain steps first in buckets above
        PLAIN_FIRST_ABOVE, where speculation usually loses), then the other mode, then the losing mode's refresh
        every ``interval`` steps."""
        if r.spec.rate is None and r.plain.rate is None:
            r.start_try(r.size <= PLAIN_FIRST_ABOVE, self.warmup_steps)
        elif r.spec.rate is None:
            r.start_try(True, self.warmup_steps)
        elif r.plain.rate is None:
            r.start_try(False, self.warmup_steps)
        elif r.steps >= r.next_try:
            r.start_try(not r.winner(), self.warmup_steps)

    def record(self, batch: int, speculative: bool, seconds: float, tokens: int, compiled: bool = False,
               kind: str = GREEDY) -> None:
        """A step of `batch` requests of this kind took `seconds` and produced `tokens` tokens (all requests together).
        compiled: torch.compile built a graph during the step, so its time is not the mode's speed: not measured,
        and a try of that mode gets one more step in its place."""
        if not self.auto_off or seconds <= 0:
            return
        r = self._bucket(batch, kind)
        if compiled:
            if r.trying == speculative:
                r.try_choices += 1
            return
        if r.trying == speculative and r.try_skip > 0:  # a warm-up step: run, its time not measured
            r.try_skip -= 1
            if speculative:  # what it accepted is as telling as any step's (a try may end after one more step)
                r.spec.add_acceptance(tokens)
            return
        if r.trying != speculative and r.mode(speculative).rate is None:
            return  # an estimate starts from a try (after its warm-up), never from steps outside one
        if r.trying == speculative and r.try_records == TRY_STEPS:  # a try's first measured step: a fresh estimate
            r.mode(speculative).restart()
        r.mode(speculative).add(tokens, seconds)
        if r.trying is None or speculative != r.trying:
            return
        r.try_records -= 1
        # an estimate that lost by far: the try's other steps would only repeat the loss (a mode's first estimate in a
        # bucket of a few requests is measured over a whole try: one step's acceptance says little there)
        clear = (r.try_refresh or r.size > PLAIN_FIRST_ABOVE) and r.clearly_behind(speculative)
        if r.try_records > 0 and not clear:
            return
        win = r.winner()
        if win is not None:  # a try that confirms the current winner makes the next one come later
            backoff = CLEAR_BACKOFF if clear else 2
            r.interval = min(r.interval * backoff, MAX_EXPLORE_EVERY) if win != r.trying else self.explore_every
            r.next_try = r.steps + r.interval
        r.trying, r.try_choices, r.try_records = None, 0, 0

    def summary(self) -> dict[str, dict]:
        """Per bucket and kind ("<bucket> <kind>", e.g. "4 sampled"): the current estimates (tokens/s) and which mode
        wins (for the server info)."""
        out = {}
        for (b, kind), r in sorted(self.rates.items()):
            win = r.winner()
            out[f"{b} {kind}"] = {"spec_tok_s": r.spec.rate, "plain_tok_s": r.plain.rate, "steps": r.steps,
                           "winner": None if win is None else ("spec" if win else "plain")}
        return out

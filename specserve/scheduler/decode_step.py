"""The decode step: what the scheduler runs over its running requests when it has no prefill to run.

Two implementations of one interface:
- ``PlainDecode`` (here): one forward, one token per request;
- ``SpecDecoder`` (``spec_decode.py``): draft, verify a tree per request in one forward, accept (and, with the
  overlap scheduler, its output processing one step behind).
Both get a ``DecodeContext``: the model runner, the KV manager and the output processor. They allocate and free
KV only through the KV manager and emit tokens only through the output processor, so the scheduler never
reaches into them and they never reach into the scheduler. ``make_decode_step`` picks one from the arguments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.attention import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from specserve.cache.kv_manager import KVManager
    from specserve.config import ServerArgs
    from specserve.models.llama import ModelOutput
    from specserve.request import Req, ReqOutput
    from specserve.scheduler.model_runner import ModelRunner
    from specserve.scheduler.output import OutputProcessor
    from specserve.speculative.base import PrefillChunk


@dataclass
class DecodeContext:
    """The components a decode step works with."""

    args: ServerArgs
    runner: ModelRunner
    kv: KVManager
    outputs: OutputProcessor


class DecodeStep(ABC):
    #: residual-stream layers prefill forwards must capture for this decoder (EAGLE-3's drafter reads them)
    capture_layers: tuple[int, ...] = ()
    #: whether the step's tokens may ride along in a prefill forward (``--enable-mixed-chunk``, ``mixed_inputs``)
    mixes_with_prefill: bool = False

    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def run(self, reqs: list[Req]) -> list[ReqOutput]:
        """One decode step for the running requests (the scheduler made room for ``slots_per_request`` each):
        tokens appended, finished requests released -> the outputs due."""

    def slots_per_request(self) -> int:
        """KV slots one request may take during a step."""
        return 1

    def slots_needed(self, reqs: list[Req]) -> int:
        """KV slots the step over ``reqs`` may take."""
        return len(reqs) * self.slots_per_request()

    def mixed_inputs(self, reqs: list[Req]):
        """The decode rows of a prefill forward (only when ``mixes_with_prefill``): (ids [B], positions [B],
        out_cache_loc [B], AttnMetadata)."""
        raise NotImplementedError(f"{type(self).__name__} does not run inside a prefill forward")

    def reserve_per_request(self) -> int:
        """Slots admission keeps free per running request beyond its expected new tokens."""
        return 0

    def after_prefill(self, chunks: list[PrefillChunk], out: ModelOutput) -> None:  # noqa: B027 - optional hook
        """A prefill forward ran over these chunks (their first tokens are sampled)."""

    def release(self, req: Req) -> None:  # noqa: B027 - optional hook
        """req leaves the batch (finished, aborted, retracted): drop any per-request decoding state."""

    def has_pending(self) -> bool:
        """Whether outputs of an earlier step are still held back (the overlap scheduler)."""
        return False

    def drain(self) -> list[ReqOutput]:
        """Process held-back outputs now, before anything else touches the running requests."""
        return []

    def accept_counts(self) -> tuple[int, int]:
        """(tokens from verify steps, request verify steps) since start: the accept length's two sides."""
        return 0, 0

    def reset_counters(self) -> None:  # noqa: B027 - optional hook
        """Forget what was counted and measured so far, and what the requests taught a drafter (after the
        scheduler's warm-up requests)."""

    def info(self) -> dict:
        """What this decoder reports in the server info."""
        return {}


class PlainDecode(DecodeStep):
    mixes_with_prefill = True

    def run(self, reqs: list[Req]) -> list[ReqOutput]:
        return self.forward(reqs)[0]

    def slots_needed(self, reqs: list[Req]) -> int:
        return sum(self.rows(reqs))

    def rows(self, reqs: list[Req]) -> list[int]:
        """Rows each request runs in the next forward: its tokens without KV (one, or more after tokens its grammar
        forced: ``OutputProcessor.append_forced``), the forced ones only while the forward keeps the model's fastest
        kernels (``ModelRunner.decode_rows``; every request has at least its one row, earlier requests first)."""
        pending = [r.unforwarded for r in reqs]
        limit = self.ctx.runner.decode_rows
        if limit is None or sum(pending) <= max(limit, len(reqs)):
            return pending
        room, take = max(limit - len(reqs), 0), []
        for p in pending:
            extra = min(p - 1, room)
            room -= extra
            take.append(1 + extra)
        return take

    def forward(self, reqs: list[Req], capture_layers: tuple[int, ...] = (), take: list[int] | None = None
                ) -> tuple[list[ReqOutput], ModelOutput]:
        """One plain decode forward (one token per request): sample, append, release finished ones.
        -> (outputs, the forward's ModelOutput: hidden [B, h] and the captured layers, for a drafter's backlog).
        A request whose grammar forced tokens after its last sampled one runs them in this forward too, a row each
        (``rows``, or ``take`` where the caller has them), and samples from its last row; one that has some left for
        the next forward samples nothing."""
        ctx = self.ctx
        take = self.rows(reqs) if take is None else take
        done = [r.kv_len + t == r.seq_len for r, t in zip(reqs, take, strict=True)]
        logits_rows = None
        if len(take) < sum(take) or not all(done):
            ends = torch.tensor(take).cumsum(0) - 1  # [B] each request's last row
            logits_rows = ends[torch.tensor(done)].to(ctx.kv.device)
        mode = ForwardMode.DECODE if logits_rows is None else ForwardMode.EXTEND  # graphs take one row a request
        fb = ForwardBatch(mode, *self.mixed_inputs(reqs, take), ctx.runner.kv_pool, logits_indices=logits_rows,
                          capture_layers=capture_layers)
        out = ctx.runner.forward(fb)  # logits [B', V]: the requests that sample
        for r, t in zip(reqs, take, strict=True):
            r.kv_len += t
        sampled = [r for r, d in zip(reqs, done, strict=True) if d]
        return (ctx.outputs.sample_and_append(sampled, out.logits) if sampled else []), out

    def mixed_inputs(self, reqs: list[Req], q_lens: list[int] | None = None):
        """A slot per request for its next token, written into the table -> (ids [B], positions [B],
        out_cache_loc [B], AttnMetadata): the decode rows of a plain or mixed forward. q_lens: rows per request
        (default one each; ``rows``): its next q_lens[b] tokens, which attend as q_lens[b] one-token decodes of
        growing length over its row of the table, so the forward keeps the decode kernels (T rows, T >= B)."""
        kv = self.ctx.kv
        pairs = list(zip(reqs, [1] * len(reqs) if q_lens is None else q_lens, strict=True))
        kv_lens = [r.kv_len + i + 1 for r, q in pairs for i in range(q)]  # each row's token is its last key
        slots = kv.alloc(len(kv_lens))
        host = ([r.req_pool_idx for r, q in pairs for _ in range(q)] + [n - 1 for n in kv_lens]
                + [r.token_at(r.kv_len + i) for r, q in pairs for i in range(q)])
        if slots is None:
            raise RuntimeError("no KV slots for the decode step (the scheduler should have made room)")
        rows, positions, ids = torch.tensor(host, dtype=torch.int64, device=kv.device).view(3, -1).unbind(0)  # [T]
        kv.write(rows, positions, slots)
        return ids, positions, slots, self.ctx.runner.attn_backend.decode(kv.table, rows, positions, kv_lens)


def make_decode_step(ctx: DecodeContext) -> DecodeStep:
    """The decode step the arguments ask for: speculative with --speculative-algorithm, else plain."""
    if ctx.args.speculative_algorithm is None:
        return PlainDecode(ctx)
    from specserve.scheduler.spec_decode import SpecDecoder
    from specserve.speculative.registry import create_proposer

    proposer = create_proposer(ctx.args, ctx.runner, ctx.kv)
    for module in proposer.draft_modules():
        ctx.runner.speed_up_forward(module)
    return SpecDecoder(ctx, proposer)

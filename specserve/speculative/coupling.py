"""Drafting coupled to sampled verification: a sampled request's draft candidates are ranked with the very noise
its verification will race the target with (``specserve.sampling.race``).

Verification emits, at each output position t, the target's race winner argmax_x p_t(x) / E_t(x). A drafter that
proposes argmax_x q_t(x) / E_t(x) with the same E_t proposes that token whenever its q_t is close enough to p_t
that both races have the same winner (Gumbel coupling): the chance of a match rises from about sum_x p(x) q(x)
(independent draws) towards 1 - TV(p, q). So the candidates of a sampled request at draft level j (children of a
node of depth j, i.e. tokens of output position len(output) + j) are ranked by softmax(log q + log 1/E), with q the
draft's distribution put through the request's own sampling filters (temperature, then top-k, top-p and min-p, as
``probs_from_logits`` treats the target): a token the request's filters cut from q is never drafted for it.
Outputs never depend on any of this (verification alone decides them); only which tokens are drafted does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.sampling.race import exponentials, grid_keys, race_scores
from specserve.sampling.sampler import filter_top_k_top_p_min_p, request_seeds


@dataclass
class RaceRows:
    """The racing rows of one draft call's [R, Vd] logits, laid out request-major with rows_per_req rows per racing
    request: rows index [S' * rows_per_req], the log of each racing request's noise log_expo [S', Vd] over the call's
    columns, and their filters: 1/T [S', 1, 1], top_k, top_p, min_p [S' * rows_per_req] (``on``: which filters any
    row uses)."""

    index: torch.Tensor
    log_expo: torch.Tensor
    rows_per_req: int
    inv_temps: torch.Tensor
    top_ks: torch.Tensor | None  # None where no row uses a filter
    top_ps: torch.Tensor | None
    min_ps: torch.Tensor | None
    on: tuple[bool, bool, bool]

    def unfiltered_all(self, rows: int) -> bool:
        """Every one of a call's `rows` rows races, and none through a filter: what a one-call ranking takes as a race
        (its noise and temperatures alone)."""
        return self.index.numel() == rows and not any(self.on)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [R, Vd] -> [R, Vd] where the racing rows hold log q - log E up to a constant per row (q their
        filtered distribution, -inf where a filter cut the token), the other rows unchanged; a softmax of either
        ranks them (and ignores the constant: without a filter, the log-softmax that would make it 0 is left out)."""
        every_row = self.index.numel() == logits.shape[0]  # then index is 0 .. R-1: no gather, no scatter
        racing = logits if every_row else logits.index_select(0, self.index)  # [S' * k, Vd]
        S, V = self.log_expo.shape
        scaled = racing.reshape(S, self.rows_per_req, V) * self.inv_temps  # [S', k, Vd]
        if any(self.on):
            q = filter_top_k_top_p_min_p(torch.softmax(scaled.view(-1, V), dim=-1), self.top_ks, self.top_ps,
                                         self.min_ps, self.on)
            scaled = torch.log(q).view(S, self.rows_per_req, V)
        scored = race_scores(scaled, self.log_expo.unsqueeze(1)).view(-1, V)  # each request's noise, broadcast
        return scored if every_row else logits.index_copy(0, self.index, scored)


@dataclass
class RaceBatch:
    """The sampled requests of a drafted batch: their indices in it, seeds, next output positions, and filters.
    The noise of every drafted level is computed once, on first use (``at_level``)."""

    rows: list[int]
    seeds: list[int]
    positions: list[int]
    inv_temps: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    levels: int
    _log_expo: torch.Tensor | None = field(default=None, repr=False)  # [S, levels, Vd]
    _layouts: dict = field(default_factory=dict, repr=False)  # (rows per request, Vd) -> (index, filters...)

    @classmethod
    def of(cls, reqs, levels: int) -> RaceBatch | None:
        """Racing rows for drafting ``levels`` levels (root's children = level 0); None when no request samples."""
        rows = [b for b, r in enumerate(reqs) if not r.params.is_greedy]
        if not rows:
            return None
        params = [reqs[b].params for b in rows]
        return cls(rows, request_seeds([reqs[b].generator for b in rows]),
                   [len(reqs[b].output_ids) for b in rows], [1.0 / p.temperature for p in params],
                   [p.top_k if p.top_k > 0 else 1 << 62 for p in params], [p.top_p for p in params],
                   [p.min_p for p in params], levels)

    def log_noise(self, ids: torch.Tensor) -> torch.Tensor:
        """[S, levels, Vd]: log E at output positions position + level of each racing request, for the target token
        ids ids [Vd] of the draft's columns (one hash call and one log for the whole proposal)."""
        if self._log_expo is None or self._log_expo.shape[-1] != ids.numel():
            keys = grid_keys(self.seeds, self.positions, self.levels, ids.device)  # [S, levels, 2]
            expo = exponentials(keys.view(-1, 2), ids).view(len(self.rows), self.levels, ids.numel())
            self._log_expo = torch.log(expo)
        return self._log_expo

    def at_level(self, level: int, rows_per_req: int, vocab_ids: torch.Tensor) -> RaceRows:
        """The racing rows of a draft call laid out request-major with rows_per_req rows per request, drafting the
        tokens of output position (next position) + level over the draft columns' target ids vocab_ids [Vd]."""
        log_expo = self.log_noise(vocab_ids)[:, level]  # [S, Vd], a view
        return RaceRows(log_expo=log_expo, rows_per_req=rows_per_req, **self._layout(rows_per_req, vocab_ids))

    def _layout(self, rows_per_req: int, vocab_ids: torch.Tensor) -> dict:
        """The rows' index, 1/T, top_k, top_p, min_p and filter switches for this layout (built once per proposal)."""
        key = (rows_per_req, vocab_ids.numel())
        if key not in self._layouts:
            dev, V = vocab_ids.device, vocab_ids.numel()

            def per_row(values, dtype) -> torch.Tensor:
                return torch.tensor(values, dtype=dtype, device=dev).repeat_interleave(rows_per_req)

            index = torch.tensor([b * rows_per_req + k for b in self.rows for k in range(rows_per_req)],
                                 dtype=torch.int64, device=dev)
            on = (any(k < V for k in self.top_ks), any(p < 1.0 for p in self.top_ps),
                  any(m > 0.0 for m in self.min_ps))
            inv_temps = torch.tensor(self.inv_temps, dtype=torch.float32, device=dev).view(-1, 1, 1)  # [S, 1, 1]
            filters = (per_row([min(k, V) for k in self.top_ks], torch.int64), per_row(self.top_ps, torch.float32),
                       per_row(self.min_ps, torch.float32)) if any(on) else (None, None, None)
            self._layouts[key] = dict(index=index, inv_temps=inv_temps, top_ks=filters[0], top_ps=filters[1],
                                      min_ps=filters[2], on=on)
        return self._layouts[key]

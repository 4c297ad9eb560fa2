"""Batched logit processing and sampling.

Pipeline for one decode step over B rows (V = vocabulary size):
    raw logits [B, V]
      -> apply_penalties_and_bias  (repetition, frequency, presence, logit_bias, min-tokens ban)
      -> probs_from_logits         (temperature, top_k, top_p, min_p; greedy rows one-hot)
      -> race_sample               (sampled rows: the exponential race of (seed, output position))
All tensors live on the logits' device; no Python loop runs over the vocabulary.

Seeded randomness is keyed by position: a sampled request's token at output position t (0 = its first generated
token) is the winner of an exponential race whose noise is a pure function of (its seed, t, token id)
(``specserve.sampling.race``). So its tokens depend neither on its batch mates nor on how its tokens were grouped
into steps: lossless speculative verification races each tree node with the noise of its position and emits exactly
the tokens plain decoding would, and drafters rank their candidates with the same noise. Every sampled request has
a seed (the frontend draws one for a request that gives none).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specserve.sampling.params import SamplingParams
from specserve.sampling.race import race_sample


def _logits_untouched(p: SamplingParams, num_output: int) -> bool:
    """Nothing changes the row's logits after num_output tokens: no penalty, bias or min-token ban."""
    return (not p.logit_bias and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 and num_output >= p.min_new_tokens)


def is_plain_greedy(p: SamplingParams, num_output: int) -> bool:
    """True when the row is greedy and nothing changes its logits (no penalty, bias or min-token ban):
    its next token is then just the argmax, with no SamplingBatchInfo needed."""
    return p.is_greedy and _logits_untouched(p, num_output)


def is_plain_sampled(p: SamplingParams, num_output: int, vocab_size: int) -> bool:
    """True when the row samples from its tempered softmax alone: not greedy, no penalty, bias or min-token ban, no
    top_k / top_p / min_p filter. Its distribution is then softmax(logits / temperature), as ``probs_from_logits``
    computes it, with no SamplingBatchInfo needed."""
    return (not p.is_greedy and _logits_untouched(p, num_output) and p.top_p >= 1.0 and p.min_p <= 0.0
            and _effective_top_k(p, vocab_size) == vocab_size)


def greedy_ids(logits: Tensor) -> Tensor:
    """logits [..., V] -> the index of each row's largest value [...] int64, the first one on ties, a NaN counting as
    the largest (argmax's result). float32 on CPU: numpy's argmax, one pass on the calling thread, 2-10x faster than
    torch's reductions, which split a few rows between threads ([16, 4096]: 13 against 80 us); otherwise
    ``max(dim).indices``, which on CPU runs 2.5-4x faster than ``argmax`` (docs/benchmarks.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] > 0:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1), dtype=np.int64))
    return logits.max(dim=-1).indices


def request_seeds(generators: list[torch.Generator | None]) -> list[int]:
    """The seed of each row's randomness: its generator's ``initial_seed()`` (the generator is only read, never
    advanced), or a fresh one from the global RNG for a row without a generator."""
    return [g.initial_seed() if g is not None else int(torch.randint(0, 2**62, ()).item()) for g in generators]


def sample_inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """weights [B, V] >= 0 (probabilities, or unnormalised), u [B] in (0, 1] -> [B] int64: the first index, in
    token-id order, whose cumulative weight reaches u * total (accumulated in float64). Since u > 0, the chosen
    index always has a positive weight; with u uniform it is drawn with probability weight / total."""
    cdf = weights.to(torch.float64).cumsum(dim=1)  # [B, V]
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1)  # [B, 1]; <= cdf[:, -1], so the index is in range
    return torch.searchsorted(cdf, target).squeeze(1).clamp(max=weights.shape[1] - 1)


def _effective_top_k(p: SamplingParams, vocab_size: int) -> int:
    return vocab_size if p.top_k <= 0 or p.top_k >= vocab_size else p.top_k


@dataclass
class SamplingBatchInfo:
    """Everything the sampler needs for the B rows sampled in one step, as tensors on one device."""

    temperatures: Tensor  # [B, 1] float32; greedy rows hold 1.0 (they are argmaxed)
    top_ps: Tensor  # [B] float32
    top_ks: Tensor  # [B] int64; V when off
    min_ps: Tensor  # [B] float32
    is_greedy: Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool  # (addition) lets probs_from_logits skip the one-hot merge without a device sync
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    generators: list[torch.Generator | None]  # per row; None for greedy rows (or: use the global RNG)
    positions: list[int]  # per row: output tokens so far = the output position of the token sampled now
    vocab_size: int
    # Penalties: None when no row uses them, so the common path costs nothing.
    rep_penalties: Tensor | None = None  # [B, 1] float32
    freq_penalties: Tensor | None = None  # [B, 1] float32
    pres_penalties: Tensor | None = None  # [B, 1] float32
    output_counts: Tensor | None = None  # [B, V] float32: count of each token in the row's output so far
    seen_mask: Tensor | None = None  # [B, V] bool: token in prompt or output (repetition penalty)
    logit_bias: Tensor | None = None  # [B, V] float32 dense
    min_tokens_mask: Tensor | None = None  # [B, V] bool: True = banned (stop/eos before min_new_tokens)
    grammar_ban: Tensor | None = None  # [B, V] bool: True = the row's grammar forbids the token (set by the caller)

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        stop_ids: list[set[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatchInfo:
        """stop_ids[i]: eos ids (unless ignore_eos) + stop_token_ids of row i; they are banned while
        len(output_ids[i]) < params[i].min_new_tokens. Generators must live on `device`."""
        B, V = len(params), vocab_size
        for name, seq in (("generators", generators), ("prompt_ids", prompt_ids),
                          ("output_ids", output_ids), ("stop_ids", stop_ids)):
            if len(seq) != B:
                raise ValueError(f"{name} has {len(seq)} rows, params has {B}")
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        top_ks = [_effective_top_k(p, V) for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]

        def f32(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        info = cls(
            temperatures=f32(temps).view(B, 1),
            top_ps=f32([p.top_p for p in params]),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=f32([p.min_p for p in params]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_top_k=any(k < V for k, g in zip(top_ks, greedy, strict=True) if not g),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            generators=[None if g else gen for gen, g in zip(generators, greedy, strict=True)],
            positions=[len(out) for out in output_ids],
            vocab_size=V,
        )
        if any(p.repetition_penalty != 1.0 for p in params):
            info.rep_penalties = f32([p.repetition_penalty for p in params]).view(B, 1)
            seen = [list(pr) + list(out) for pr, out in zip(prompt_ids, output_ids, strict=True)]
            info.seen_mask = _dense_counts(seen, V, device) > 0
        use_freq = any(p.frequency_penalty != 0.0 for p in params)
        use_pres = any(p.presence_penalty != 0.0 for p in params)
        if use_freq:
            info.freq_penalties = f32([p.frequency_penalty for p in params]).view(B, 1)
        if use_pres:
            info.pres_penalties = f32([p.presence_penalty for p in params]).view(B, 1)
        if use_freq or use_pres:
            info.output_counts = _dense_counts(output_ids, V, device)
        if any(p.logit_bias for p in params):
            info.logit_bias = _dense_logit_bias(params, V, device)
        banned = [
            sorted(ids) if len(out) < p.min_new_tokens else []
            for p, out, ids in zip(params, output_ids, stop_ids, strict=True)
        ]
        if any(banned):
            info.min_tokens_mask = _dense_counts(banned, V, device) > 0
        return info


def _dense_counts(rows: list[list[int]], vocab_size: int, device: torch.device | str) -> Tensor:
    """Token-id lists -> [B, V] float32 occurrence counts, built with one scatter on `device`."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)  # [B, V]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device)  # [B]
    cols = torch.tensor([t for r in rows for t in r], dtype=torch.int64, device=device)  # [N]
    if cols.numel() == 0:
        return counts
    row_idx = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)  # [N]
    counts.index_put_((row_idx, cols), torch.ones_like(cols, dtype=torch.float32), accumulate=True)
    return counts


def _dense_logit_bias(params: list[SamplingParams], vocab_size: int, device: torch.device | str) -> Tensor:
    """Sparse per-row {token id: bias} -> dense [B, V] float32 (string keys from JSON accepted)."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for key, value in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(int(key))
            vals.append(float(value))
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)  # [B, V]
    index = (torch.tensor(rows, dtype=torch.int64, device=device),
             torch.tensor(cols, dtype=torch.int64, device=device))
    bias.index_put_(index, torch.tensor(vals, dtype=torch.float32, device=device))
    return bias


def apply_penalties_and_bias(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Raw logits [B, V] -> processed float32 logits [B, V] (a new tensor; the input is untouched).

    In order:
      1. repetition_penalty r over tokens seen in prompt or output (HF rule): x > 0 -> x / r, else x * r
      2. frequency_penalty f over output tokens: x -= count * f
      3. presence_penalty p over output tokens: x -= p if count > 0
      4. logit_bias: x += bias
      5. min_new_tokens not reached: stop/eos tokens -> -inf
      6. tokens the row's grammar forbids -> -inf (where a grammar allows nothing but stop tokens before
         min_new_tokens, the grammar wins: its output is complete)
    """
    out = logits.to(torch.float32, copy=True)  # [B, V]
    if info.rep_penalties is not None and info.seen_mask is not None:
        r = info.rep_penalties  # [B, 1]
        penalized = torch.where(out > 0, out / r, out * r)  # [B, V]
        out = torch.where(info.seen_mask, penalized, out)
    if info.output_counts is not None:
        if info.freq_penalties is not None:
            out = out - info.output_counts * info.freq_penalties  # [B, V] - [B, V] * [B, 1]
        if info.pres_penalties is not None:
            out = out - (info.output_counts > 0).to(torch.float32) * info.pres_penalties
    if info.logit_bias is not None:
        out = out + info.logit_bias
    ban = info.min_tokens_mask
    if info.grammar_ban is not None:
        ban = info.grammar_ban if ban is None else _grammar_first(ban | info.grammar_ban, info.grammar_ban)
    if ban is not None:
        out = out.masked_fill(ban, float("-inf"))
    return out


def _grammar_first(both: Tensor, grammar: Tensor) -> Tensor:
    """[B, V] bans: rows where the two together ban every token keep the grammar's alone."""
    return torch.where(both.all(dim=1, keepdim=True), grammar, both)


def probs_from_logits(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Processed logits [B, V] -> sampling distribution [B, V] float32 (rows sum to 1).

    Pure function of (logits, info); also the target/draft distribution for lossless speculative verification.
    Non-greedy rows: softmax(logits / T), then applied one after the other, each on the renormalised result of
    the previous (HF/vLLM semantics):
      top_k: keep the k most probable tokens;
      top_p: keep the smallest most-probable set whose mass reaches top_p (a token is kept iff the mass
             strictly before it in descending order is < top_p);
      min_p: keep tokens with prob >= min_p * max prob.
    Masked tokens get probability exactly 0, the rest are renormalised. Greedy rows: one-hot of the argmax.
    """
    B, V = logits.shape
    probs = torch.softmax(logits.to(torch.float32) / info.temperatures, dim=-1)  # [B, V]
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = _apply_top_k_top_p_min_p(probs, info)
    if info.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, greedy_ids(logits).view(B, 1), 1.0)  # [B, V]
        probs = torch.where(info.is_greedy.view(B, 1), one_hot, probs)
    return probs


#: top_k / top_p / min_p keep a prefix of each row's tokens in descending order. A row whose kept prefix surely lies
#: within its FILTER_CANDIDATES most probable tokens is filtered over those (one topk call); other rows sort their
#: whole vocabulary. On CPU sorting [16, 32000] takes ~21 ms, topk 1024 of it ~3 ms (docs/benchmarks.md).
FILTER_CANDIDATES = 1024
#: A top_p row goes the topk way only when its candidates' mass exceeds top_p by this much, so that float rounding
#: cannot put the nucleus's end just past them.
NUCLEUS_MARGIN = 1e-4


def _apply_top_k_top_p_min_p(probs: Tensor, info: SamplingBatchInfo) -> Tensor:
    return filter_top_k_top_p_min_p(probs, info.top_ks, info.top_ps, info.min_ps,
                                    (info.need_top_k, info.need_top_p, info.need_min_p))


def filter_top_k_top_p_min_p(probs: Tensor, top_ks: Tensor, top_ps: Tensor, min_ps: Tensor,
                             on: tuple[bool, bool, bool] = (True, True, True)) -> Tensor:
    """probs [B, V]; per row top_k [B] int64 (V or more: off), top_p [B], min_p [B] -> filtered and renormalised
    probs [B, V] (``probs_from_logits``'s filters; ``on``: which of the three any row uses). Which way a row is
    filtered (its top candidates or a full sort) depends on that row alone, so a row's result does not depend on
    its batch mates. Rows with no filter keep their probabilities."""
    B, V = probs.shape
    unfiltered = (top_ks >= V) & (top_ps >= 1.0) & (min_ps <= 0.0)  # [B]
    by_head = torch.zeros_like(unfiltered)
    if V > FILTER_CANDIDATES:
        head_p, head_ids = probs.topk(FILTER_CANDIDATES, dim=-1)  # [B, C] each, descending
        by_head = _kept_within(probs, head_p, top_ks, top_ps, min_ps) & ~unfiltered  # [B]
        if bool(by_head.all()):  # the common case: every row on its candidates, no row indexing
            return _filter_sorted(probs, head_p, head_ids, top_ks, top_ps, min_ps, *on)
    out = probs.clone()
    if len(head_rows := by_head.nonzero().view(-1)):
        out[head_rows] = _filter_sorted(probs[head_rows], head_p[head_rows], head_ids[head_rows],
                                        top_ks[head_rows], top_ps[head_rows], min_ps[head_rows], *on)
    if len(sort_rows := (~by_head & ~unfiltered).nonzero().view(-1)):
        rows_p = probs[sort_rows]  # [R, V]
        out[sort_rows] = _filter_sorted(rows_p, *rows_p.sort(dim=-1, descending=True),
                                        top_ks[sort_rows], top_ps[sort_rows], min_ps[sort_rows], *on)
    return out


def _kept_within(probs: Tensor, head_p: Tensor, top_ks: Tensor, top_ps: Tensor, min_ps: Tensor) -> Tensor:
    """probs [B, V]; head_p [B, C] their C largest, descending -> [B] bool: every token the row's filters keep is
    among those C. True when top_k <= C; or, top_k being off, when the C hold the whole nucleus (their share of the
    row's mass reaches top_p + NUCLEUS_MARGIN) or every token of at least min_p x the maximum."""
    C, V = head_p.shape[1], probs.shape[1]
    top_k_off = top_ks >= V
    nucleus = (top_ps < 1.0) & (head_p.sum(dim=-1) >= (top_ps + NUCLEUS_MARGIN) * probs.sum(dim=-1))
    min_p_set = (min_ps > 0.0) & ((probs >= head_p[:, :1] * min_ps.view(-1, 1)).sum(dim=-1) <= C)
    return (top_ks <= C) | (top_k_off & (nucleus | min_p_set))


def _filter_sorted(probs: Tensor, sorted_p: Tensor, order: Tensor, top_ks: Tensor, top_ps: Tensor,
                   min_ps: Tensor, top_k_on: bool, top_p_on: bool, min_p_on: bool) -> Tensor:
    """probs [R, V]; sorted_p / order [R, C] the rows' C most probable tokens, descending (C = V: all of them),
    among which are all the tokens the filters keep -> filtered, renormalised probs [R, V]. A filter no row of
    the batch uses (``*_on`` False) is skipped."""
    R, C = sorted_p.shape
    V = probs.shape[1]
    if top_k_on:
        rank = torch.arange(C, device=probs.device).view(1, C)  # [1, C]
        sorted_p = sorted_p.masked_fill(rank >= top_ks.view(R, 1), 0.0)
    if top_p_on:
        # renormalised over the top_k survivors: all within the C when top_k <= C, else (top_k off) the whole row
        total = sorted_p.sum(dim=-1, keepdim=True)  # [R, 1]
        if C < V:
            total = torch.where(top_ks.view(R, 1) <= C, total, probs.sum(dim=-1, keepdim=True))
        renorm = sorted_p / total  # [R, C]
        mass_before = renorm.cumsum(dim=-1) - renorm  # [R, C] exclusive cumsum
        top_p = top_ps.view(R, 1)
        # Rows with top_p == 1 are left alone (rounding could otherwise trim their tail).
        sorted_p = sorted_p.masked_fill((mass_before >= top_p) & (top_p < 1.0), 0.0)
    if min_p_on:
        threshold = sorted_p[:, :1] * min_ps.view(R, 1)  # [R, 1]; column 0 is the max, never masked
        sorted_p = sorted_p.masked_fill(sorted_p < threshold, 0.0)
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)  # back to vocabulary order


def sample(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Raw logits [B, V] -> next token ids [B] int64.

    Greedy rows: argmax of the processed logits. Sampled rows: the exponential race over probs_from_logits keyed
    by (the row's seed, its output position) (``specserve.sampling.race``; it depends on nothing else in the
    batch); a row without a generator races with a seed drawn from the global RNG.
    """
    processed = apply_penalties_and_bias(logits, info)  # [B, V]
    next_ids = greedy_ids(processed)  # [B]
    if info.all_greedy:
        return next_ids
    probs = probs_from_logits(processed, info)  # [B, V]
    rows = [i for i, g in enumerate(info.is_greedy.tolist()) if not g]
    if rows:
        seeds = request_seeds([info.generators[i] for i in rows])
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [S]
        next_ids[index] = race_sample(probs[index], seeds, [info.positions[i] for i in rows])
    return next_ids


def compute_logprobs(
    logits: Tensor, token_ids: Tensor, top_n: list[int], probe_ids: list[list[int] | None] | None = None,
    temperatures: list[float] | None = None,
) -> tuple[Tensor, list[list[tuple[float, int]]], list[list[tuple[float, int]] | None]]:
    """Log-probabilities under log_softmax of the RAW logits [B, V], i.e. the model's own distribution, before
    penalties, bias, temperature and top-k/p filtering (as SGLang and OpenAI report them; processed
    distributions would give -inf for filtered tokens and depend on the sampling knobs).

    temperatures: per row, divide the logits by it first (``temp_scaled_logprobs``; 1.0 or 0 = raw).
    Returns the chosen tokens' logprobs [B] float32 (token_ids: [B]); per row i, the top_n[i] (logprob, token_id)
    pairs, highest first (at most V); and per row, the (logprob, token_id) of each id in probe_ids[i]
    (``token_ids_logprob``, in the order asked) or None.
    """
    logits = logits.to(torch.float32)
    if temperatures is not None and any(t not in (0.0, 1.0) for t in temperatures):
        scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)  # [B]
        logits = logits / scale.view(-1, 1)
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    chosen = logprobs.gather(1, token_ids.view(-1, 1).to(torch.int64)).view(-1)  # [B]
    probes = _probe_logprobs(logprobs, probe_ids)
    max_n = min(max(top_n, default=0), logprobs.shape[-1])
    if max_n <= 0:
        return chosen, [[] for _ in top_n], probes
    values, indices = logprobs.topk(max_n, dim=-1)  # [B, max_n], sorted descending
    values_l, indices_l = values.tolist(), indices.tolist()  # one transfer each
    tops = [list(zip(values_l[i][:n], indices_l[i][:n], strict=True)) for i, n in enumerate(top_n)]
    return chosen, tops, probes


def request_logprobs(params, logits: Tensor, token_ids: Tensor):
    """One request's rows: logits [R, V], token_ids [R] -> (logprobs, tops, probes) as lists, one entry per row,
    with the request's top_logprobs_num, token_ids_logprob and temp_scaled_logprobs (params: SamplingParams)."""
    n = logits.shape[0]
    temps = [params.temperature] * n if params.temp_scaled_logprobs else None
    chosen, tops, probes = compute_logprobs(logits, token_ids, [params.top_logprobs_num] * n,
                                            [params.token_ids_logprob] * n, temps)
    return chosen.tolist(), tops, probes


def _probe_logprobs(logprobs: Tensor, probe_ids: list[list[int] | None] | None) -> list[list[tuple[float, int]] | None]:
    """logprobs [B, V] -> per row, [(logprob, id)] of the row's probe ids, or None where the row has none."""
    B = logprobs.shape[0]
    if not probe_ids or not any(probe_ids):
        return [None] * B
    out: list[list[tuple[float, int]] | None] = []
    for i in range(B):
        ids = probe_ids[i]
        if not ids:
            out.append(None)
            continue
        vals = logprobs[i, torch.tensor(ids, device=logprobs.device)].tolist()
        out.append(list(zip(vals, ids, strict=True)))
    return out

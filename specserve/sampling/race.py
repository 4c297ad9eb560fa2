"""Seeded sampling as an exponential race, keyed by (seed, output position, token id). Pure functions.

A sampled request draws the token of its output position t (0 = its first generated token) as

    x_t = argmax_x  p_t(x) / E(seed, t, x)        E(seed, t, x) ~ Exp(1), independent over x

where p_t is its processed distribution there (temperature, top-k/p, min-p, penalties, bias, grammar). This is the
Gumbel-max trick written with exponentials (argmax log p + G with G = -log E): x_t has probability exactly p_t(x).
E is a counter-based hash of (seed, t, x), so:
  - a request's token at position t depends on its seed, t and p_t only: not on its batch mates, not on whether
    the step was plain or speculative, nor on the draft tree's shape (reproducible seeds);
  - speculative verification is an argmax per tree node (``verify.race_node_ids``, then the greedy walk), and
    emits exactly plain decoding's tokens for the seed (lossless by construction);
  - the drafter can rank its candidates with the SAME noise (``race_scores``): it proposes argmax q(x) / E(x),
    which equals the target's token whenever q is close to p (Gumbel coupling), so acceptance at temperature > 0
    approaches that of greedy decoding as the draft approaches the target.

E is computed for any set of token ids on its own (a hash per id), so a caller may compute it over a draft
vocabulary's target ids or over a row's few candidate tokens, and gets the values the full vocabulary would have.
Hash: two 32-bit keys per (seed, position) from SplitMix64 (Python ints), then murmur3's 32-bit finaliser twice per
token id on int32 lanes; a uniform w with 23 random bits in (0, 1), E = -log(1 - w). On CPU the elementwise chain
runs as specserve's C++ operator where it loads (AVX512, a polynomial logarithm within a few float32 ulps of
PyTorch's), else as one kernel compiled on the first sampled call where torch.compile works (2 threads of the
reference Xeon: 3.8 against 12 ns per value eagerly over 16 x 49152 values), else eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's stream increment
_PHI32 = 0x9E3779B9 - (1 << 32)  # 2^32 / golden ratio, as a signed int32
_FMIX1 = 0x85EBCA6B - (1 << 32)  # murmur3 fmix32 multipliers, as signed int32
_FMIX2 = 0xC2B2AE35 - (1 << 32)


def _mix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea & Flood, 2014): a bijection of 64-bit ints that scrambles bits."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def position_key(seed: int, position: int) -> tuple[int, int]:
    """The two signed 32-bit keys of output position ``position`` of a request seeded with ``seed``: value
    position + 1 of a SplitMix64 stream started at mix(seed), split in halves (a pure function of both)."""
    h = _mix64((_mix64(seed & _U64) + (position + 1) * _GOLDEN_GAMMA) & _U64)
    return _signed32(h), _signed32(h >> 32)


def race_keys(seeds: Sequence[int], positions: Sequence[int], device: torch.device | str) -> Tensor:
    """[R, 2] int32 keys: row r is ``position_key(seeds[r], positions[r])``."""
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds for {len(positions)} positions")
    keys = [position_key(s, t) for s, t in zip(seeds, positions, strict=True)]
    return torch.tensor(keys, dtype=torch.int32, device=device).view(len(keys), 2)


def grid_keys(seeds: Sequence[int], starts: Sequence[int], width: int, device: torch.device | str) -> Tensor:
    """[R, width, 2] int32 keys: row r, column d keys output position starts[r] + d of a request seeded seeds[r]
    (the positions a draft tree's levels, or its nodes' depths, reach from a request's next token)."""
    flat = race_keys([s for s in seeds for _ in range(width)], [t + d for t in starts for d in range(width)], device)
    return flat.view(len(seeds), width, 2)


def _srl(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int32 lanes (``>>`` is arithmetic on signed ints)."""
    return (z >> k) & ((1 << (32 - k)) - 1)


def _fmix32(z: Tensor) -> Tensor:
    z = (z ^ _srl(z, 16)) * _FMIX1
    z = (z ^ _srl(z, 13)) * _FMIX2
    return z ^ _srl(z, 16)


def _exponentials(k1: Tensor, k2: Tensor, ids: Tensor) -> Tensor:
    """k1, k2 [R, 1] int32, ids [R, M] or [1, M] int32 -> E [R, M] float32, Exp(1) values."""
    z = _fmix32(_fmix32(ids * _PHI32 + k1) ^ k2)
    w = (_srl(z, 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # 23 random bits, in (0, 1), exact in float32
    return -torch.log1p(-w)  # E = -log(1 - w): small E (the likely winners) keep full relative precision


_kernel = None


def use_kernel(fn) -> None:
    """Have ``exponentials`` compute CPU noise with fn (same signature and values as ``_exponentials``); the CPU
    platform installs its C++ operator here (``platform/cpu/elementwise.py``: nothing to compile at the first
    sampled request)."""
    global _kernel
    _kernel = fn


def _compiled():
    """The installed kernel (``use_kernel``), else the compiled elementwise kernel, else the eager function where
    compiling fails (no C++ compiler)."""
    global _kernel
    if _kernel is None:
        try:
            fn = torch.compile(_exponentials, dynamic=True)
            probe = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1, dtype=torch.int32),
                     torch.arange(4, dtype=torch.int32).view(1, 4))
            if not torch.allclose(fn(*probe), _exponentials(*probe)):
                raise RuntimeError("compiled values differ from eager ones")
            _kernel = fn
        except Exception as exc:  # noqa: BLE001 - any compile failure falls back to the same values, eagerly
            logger.info("exponential race noise runs eagerly (torch.compile unavailable: %s)", exc)
            _kernel = _exponentials
    return _kernel


def exponentials(keys: Tensor, ids: Tensor) -> Tensor:
    """keys [R, 2] int32 (``race_keys``), ids [M] or [R, M] integer token ids -> E [R, M] float32: E(key_r, id),
    the same value whatever other ids are asked for with it."""
    ids = ids.to(device=keys.device, dtype=torch.int32)
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    k1, k2 = keys[:, :1].contiguous(), keys[:, 1:].contiguous()
    fn = _compiled() if keys.device.type == "cpu" else _exponentials
    return fn(k1, k2, ids)


def race_argmax(probs: Tensor, expo: Tensor) -> Tensor:
    """probs [..., V] (or unnormalised weights >= 0), expo [..., V] Exp(1) values -> [...] int64: the winner of
    the race, argmax probs / expo (a token of probability 0 never wins unless every token has 0)."""
    return (probs.to(torch.float32) / expo).max(dim=-1).indices


def race_sample(probs: Tensor, seeds: Sequence[int], positions: Sequence[int]) -> Tensor:
    """probs [R, V] -> [R] int64: row r's token at output position positions[r] of a request seeded seeds[r]."""
    keys = race_keys(seeds, positions, probs.device)  # [R, 2]
    return race_argmax(probs, exponentials(keys, torch.arange(probs.shape[-1], device=probs.device)))


def race_scores(logprobs: Tensor, log_expo: Tensor) -> Tensor:
    """A draft's log-probabilities [R, Vd] and the log of the target's noise log_expo [R, Vd] at the same positions,
    for the TARGET token ids of the draft's columns (``exponentials``, then log) -> log q - log E [R, Vd]: the
    Gumbel-perturbed scores whose argmax is the draft's own race winner with the target's noise (the coupled
    proposal); softmax of them ranks candidates."""
    return logprobs - log_expo

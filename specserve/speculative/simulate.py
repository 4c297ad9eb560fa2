"""Simulated accept length (SGLang's ``SGLANG_SIMULATE_ACC_LEN``): measure the engine's speculative throughput
ceiling on random-weight models, whose drafts would otherwise almost never be accepted.

Environment (read once, when the speculative decoder starts; the SPECSERVE_ name wins over the SGLANG_ twin):
  ``SPECSERVE_SIMULATE_ACC_LEN`` / ``SGLANG_SIMULATE_ACC_LEN``: the mean number of tokens per verify step, bonus
  token included (a float >= 1); unset or empty = off (normal verification).
  ``SPECSERVE_SIMULATE_ACC_METHOD`` / ``SGLANG_SIMULATE_ACC_METHOD``: how the per-step lengths are drawn:
    - ``match-expected`` (default, as in current SGLang): with m = the mean clamped to [1, L] (L = deepest draft
      + 1), floor(m) with probability 1 - frac(m), else floor(m) + 1, so the mean is exactly m and only the two
      neighbouring integers occur;
    - ``multinomial`` (SGLang's older rule, kept under its name): round(clamp(Normal(m, 1), 1, L)); the mean
      drifts from m near the bounds.
  One length is drawn per request per step (SGLang draws one for the whole batch), from a generator seeded
  with ``--random-seed``.

When on, every verify step ignores the target's judgement (``specserve.speculative.verify.simulate_accept``): the
outputs are NOT the target's (lossy); a WARNING says so at start-up.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping

import torch

from specserve.flags import ConfigError

logger = logging.getLogger(__name__)

ACC_LEN_ENV = ("SPECSERVE_SIMULATE_ACC_LEN", "SGLANG_SIMULATE_ACC_LEN")
ACC_METHOD_ENV = ("SPECSERVE_SIMULATE_ACC_METHOD", "SGLANG_SIMULATE_ACC_METHOD")
METHODS = ("match-expected", "multinomial")


def _first_set(names: tuple[str, ...], environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable name, stripped value) of the first non-empty variable among names, else None."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def simulate_env_value(environ: Mapping[str, str] | None = None) -> str | None:
    """The accept-length variable's value as set (SPECSERVE_ first, then its SGLANG_ twin), None when off: what a
    benchmark records beside its figures."""
    found = _first_set(ACC_LEN_ENV, os.environ if environ is None else environ)
    return None if found is None else found[1]


def read_simulate_env(environ: Mapping[str, str] | None = None) -> tuple[float, str] | None:
    """-> (mean accept length, method) when the simulation is on, None when off; ConfigError naming the
    variable for a bad value."""
    environ = os.environ if environ is None else environ
    found = _first_set(ACC_LEN_ENV, environ)
    if found is None:
        return None
    name, raw = found
    try:
        mean = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number >= 1 (tokens per verify step), got {raw!r}") from None
    if not math.isfinite(mean) or mean < 1.0:
        raise ConfigError(f"{name} must be a number >= 1 (tokens per verify step), got {raw!r}")
    method_found = _first_set(ACC_METHOD_ENV, environ)
    method = "match-expected" if method_found is None else method_found[1].lower()
    if method not in METHODS:
        raise ConfigError(f"{method_found[0]} must be one of {', '.join(METHODS)}, got {method_found[1]!r}")
    return mean, method


@contextlib.contextmanager
def simulated_acc_len(mean: float | None) -> Iterator[None]:
    """SPECSERVE_SIMULATE_ACC_LEN set to `mean` inside the block (left as it is for None), restored after: for a
    benchmark that builds engines with simulated acceptance (a decoder reads the variable when it starts)."""
    name = ACC_LEN_ENV[0]
    before = os.environ.get(name)
    if mean is not None:
        os.environ[name] = str(mean)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def sample_accept_lengths(mean: float, n: int, max_len: int, generator: torch.Generator,
                          method: str = "match-expected") -> torch.Tensor:
    """n accept lengths (bonus token included) in [1, max_len] with the given mean -> [n] int64 on the
    generator's device. See the module docstring for the two distributions."""
    m = min(max(mean, 1.0), float(max_len))
    dev = generator.device
    if method == "match-expected":
        lower = math.floor(m)
        u = torch.rand(n, generator=generator, device=dev, dtype=torch.float64)  # [n]
        return lower + (u < m - lower).to(torch.int64)  # frac 0 (or m = max_len) never rounds up
    if method == "multinomial":
        x = torch.randn(n, generator=generator, device=dev, dtype=torch.float64) + m  # [n]
        return x.clamp(1.0, float(max_len)).round().to(torch.int64)
    raise ValueError(f"unknown simulated accept method {method!r}; expected one of {', '.join(METHODS)}")


class AcceptSimulator:
    """Draws the per-request accept lengths of each verify step (CPU generator, seeded)."""

    def __init__(self, mean: float, method: str = "match-expected", seed: int = 0) -> None:
        self.mean, self.method = mean, method
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_env(cls, seed: int = 0, environ: Mapping[str, str] | None = None) -> AcceptSimulator | None:
        environ = os.environ if environ is None else environ
        cfg = read_simulate_env(environ)
        if cfg is None:
            return None
        logger.warning(
            "%s=%g (%s): speculative verification is SIMULATED; outputs are not the target model's (lossy, "
            "for benchmarking only)", _first_set(ACC_LEN_ENV, environ)[0], cfg[0], cfg[1])
        return cls(cfg[0], cfg[1], seed)

    def sample(self, n: int, max_len: int) -> torch.Tensor:
        """-> [n] int64 (CPU) accept lengths, bonus token included, in [1, max_len]."""
        return sample_accept_lengths(self.mean, n, max_len, self.generator, self.method)

"""Sampling layer: request parameters, batched logit processing and sampling, incremental detokenization."""

from specserve.sampling.params import SamplingParams
from specserve.sampling.sampler import SamplingBatchInfo, sample

__all__ = ["SamplingBatchInfo", "SamplingParams", "sample"]

"""Shared fixtures: tiny random HF model folders built once per test session (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.test.tiny import build_tokenizer, make_model_dir

torch.set_num_threads(2)

# One kernel for one-row bf16 linears in every engine the tests start (servers included), instead of each engine's
# timing probe: two engines compared token for token in bf16 then round alike. The probe has its own tests
# (tests/model/test_cpu_packing.py), which set the variable themselves.
os.environ.setdefault("SPECSERVE_ONE_ROW_KERNEL", "gemv")
# Likewise one float32 / bf16 crossover for float32 drafts' linears (the default's), instead of each engine's probe
# (tests/speculative/test_draft_dtype.py sets the variable itself).
os.environ.setdefault("SPECSERVE_DRAFT_FP32_MAX_ROWS", "8")
# Likewise no timing probe for specserve's few-row bf16 kernel: off, except in its own tests
# (tests/model/test_small_gemm.py), which turn it on.
os.environ.setdefault("SPECSERVE_SMALL_GEMM", "off")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tokenizer"))
    build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory, tokenizer_dir):
    """model_factory(arch, **config_overrides) -> folder, cached per argument set."""
    cache: dict = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            d = str(tmp_path_factory.mktemp(f"{arch}-model"))
            cache[key] = make_model_dir(d, arch, tokenizer_dir=tokenizer_dir, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> str:
    return model_factory("llama")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's state as a new process has it: no graphs, counters or dynamic-shape decisions left by the tests
    before these."""
    torch._dynamo.reset()

"""Shared fixtures: tiny random HF model folders built once per test session (no downloads)."""

from __future__ import annotations

import pytest
import torch

from specserve.test.tiny import build_tokenizer, make_model_dir

torch.set_num_threads(2)


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

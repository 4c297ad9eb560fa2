"""Speculative decoding on a CUDA device: each algorithm's greedy output equals plain decoding's on the same device
(CUDA graphs on, the engine's default there), seeded sampled output equals plain decoding's tokens, and
``--enable-torch-compile`` (inductor's GPU kernels) keeps outputs. Float32, tiny random models; every test needs a
GPU and none runs in CPU-only CI (the CPU versions of the same checks live beside this file)."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.test.tiny import make_eagle3_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs
from tests.speculative.test_ngram_lossless import NGRAM, REPETITIVE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA_KW = dict(device="cuda", max_total_tokens=8192)


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _generate(path: str, prompts, params, **kw) -> tuple[list[dict], dict]:
    with Engine(model_path=path, **CUDA_KW, **kw) as e:
        outs = e.generate(prompts, params)
        info = e.get_server_info()
        assert_no_kv_leak(e)
    return outs, info


@pytest.fixture(scope="module")
def deep_target(model_factory):
    return model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)


@pytest.fixture(scope="module")
def deep_head(deep_target, tmp_path_factory):
    return make_eagle3_head_dir(str(tmp_path_factory.mktemp("e3") / "head"), deep_target, kind="self")


def _cases(target, self_head, deep_target, head3):
    return {
        "EAGLE": (target, PROMPTS, spec_kwargs("EAGLE", self_head, 3, 2, 5)),
        "EAGLE3": (deep_target, PROMPTS, spec_kwargs("EAGLE3", head3, 3, 2, 4)),
        "STANDALONE": (deep_target, PROMPTS, spec_kwargs("STANDALONE", deep_target, 3, 1, 4)),
        "NGRAM": (target, REPETITIVE, NGRAM),
    }


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
def test_greedy_speculation_on_gpu_equals_plain(algorithm, target, self_head, deep_target, deep_head):
    path, prompts, kw = _cases(target, self_head, deep_target, deep_head)[algorithm]
    want, _ = _generate(path, prompts, greedy(32))
    outs, info = _generate(path, prompts, greedy(32), disable_speculative_auto_off=True, **kw)
    assert _ids(outs) == _ids(want), algorithm
    assert_drafting_happened(outs, min_accept_length=1.2)
    assert info["cuda_graph"] == "cuda" and info["cuda_graph_replays"] > 0, info


def test_seeded_sampling_on_gpu_equals_plain(target, self_head):
    """A seeded request's sample at each position comes from (seed, position): speculation changes no token."""
    sp = [{"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 32, "ignore_eos": True, "seed": 11 + i}
          for i in range(4)]
    want, _ = _generate(target, PROMPTS[:4], sp)
    outs, _ = _generate(target, PROMPTS[:4], sp, disable_speculative_auto_off=True,
                        **spec_kwargs("EAGLE", self_head, 3, 2, 5))
    assert _ids(outs) == _ids(want)
    assert_drafting_happened(outs, min_accept_length=1.2)


def test_torch_compile_on_gpu_keeps_outputs(target, self_head):
    want, _ = _generate(target, PROMPTS[:4], greedy(24))
    for kw in ({}, spec_kwargs("EAGLE", self_head, 3, 2, 5)):
        outs, info = _generate(target, PROMPTS[:4], greedy(24), enable_torch_compile=True,
                               disable_speculative_auto_off=True, **kw)
        assert _ids(outs) == _ids(want), kw
        assert info["torch_compile_graphs"] > 0, info

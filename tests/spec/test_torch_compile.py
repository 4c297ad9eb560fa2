"""--enable-torch-compile: compiled decode, verify and draft forwards give the eager greedy output token for token
(with drafting and acceptance happening), batches above --torch-compile-max-bs run eager, compile time is
reported."""

from __future__ import annotations

import pytest

from specserve import Engine
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.spec.helpers import assert_drafting_happened, spec_kwargs


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


def test_compiled_plain_decode_equals_eager(target, plain):
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True, torch_compile_max_bs=4) as e:
        single = [e.generate(p, greedy(24))["output_ids"] for p in PROMPTS[:3]]  # batch 1: compiled
        batch = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]  # batch 8 > max bs 4: eager steps
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert single == plain[:3] and batch == plain
    assert info["torch_compile_graphs"] > 0 and info["torch_compile_seconds"] > 0
    assert info["torch_compile_calls"] > 0


def test_compiled_eagle_tree_equals_plain(target, self_head, plain):
    kw = spec_kwargs("EAGLE", self_head, 3, 2, 5)
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True, **kw) as e:
        outs = e.generate(PROMPTS, greedy(24))
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in outs] == plain
    assert_drafting_happened(outs, min_accept_length=1.5)
    assert info["torch_compile_graphs"] >= 2  # the target's verify and the head's draft steps at least

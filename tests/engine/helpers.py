"""Helpers for engine tests."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from specserve import Engine

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def push(self, item):",
    "The quick brown fox",
    "for i in range(10):\n    print(i)\n# now sum the squares of",
    "x = 1",
    "while True:\n    line = input()\n    if not line:\n        break\n    total +=",
    "# a long comment that goes on and on about heaps, bisection, fractions and statistics",
]


def greedy(max_new_tokens: int = 16, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt_ids):].tolist()


BF16_TIE = 0.07  # nats: two bf16 logits one rounding step apart (a step is 0.0625 between 8 and 16)


def assert_greedy_equal_up_to_ties(got: list[list[int]], want: list[dict]) -> None:
    """16-bit runs that round differently (a compiled kernel against an eager one): each request's greedy ids in
    `got` equal `want`'s (outputs generated with ``top_logprobs_num`` >= 2) up to the first position where they
    part, and there `want`'s two best tokens are within BF16_TIE of each other and `got` took the other one. (After
    a tie the two continuations are different texts: nothing further compares.)"""
    for ids, ref in zip(got, want, strict=True):
        part = next((i for i, (a, b) in enumerate(zip(ids, ref["output_ids"], strict=False)) if a != b), None)
        if part is None:
            assert len(ids) == len(ref["output_ids"])
            continue
        (lp1, t1, _), (lp2, t2, _) = ref["meta_info"]["output_top_logprobs"][part][:2]
        assert lp1 - lp2 <= BF16_TIE, f"position {part}: {ids[part]} where the reference had a clear best ({t1})"
        assert ids[part] in (t1, t2)


def assert_no_kv_leak(engine: Engine) -> None:
    """Every slot is either free or held by the prefix cache, nothing is locked, all rows are free."""

    def check(s):
        assert not s.running and not s.waiting and s.chunked is None
        assert s.kv.tree.protected_size() == 0
        s.kv.tree._check_invariants()
        free = s.kv.allocator.free_slots_sorted()
        cached = s.kv.tree.all_values()
        everything = torch.sort(torch.cat([free, cached])).values
        want = torch.arange(1, s.runner.max_total_tokens + 1, device=everything.device)
        assert torch.equal(everything, want), "slot leak or double free"
        assert s.kv.req_pool.available_size() == s.kv.req_pool.max_reqs
        return True

    assert engine.loop.call(check)
    assert engine.flush_cache()
    assert engine.get_server_info()["free_slots"] == engine.server_args.max_total_tokens


def force_one_row_kernel(monkeypatch, kernel: str) -> None:
    """Engines built during the test take kernel ('gemv' or 'packed') for one-row half-precision linears on CPU,
    without the probe (``platform/cpu/one_row_probe.py``)."""
    from specserve.platform.cpu.one_row_probe import ENV

    monkeypatch.setenv(ENV, kernel)


def record_rows(monkeypatch, module, name: str, dim: int = 0) -> list[int]:
    """Wrap ``module.name`` (a kernel entry point whose first argument is its input) so that each call appends that
    input's size along ``dim`` to the returned list, then runs as before."""
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda x, *a: calls.append(x.shape[dim]) or real(x, *a))
    return calls


def onednn_packs_bf16() -> bool:
    """oneDNN packs bf16 weights on this CPU (it needs AVX512; on an AVX2-only CPU the engine keeps plain linears,
    with float32 copies for calls of several rows)."""
    from specserve.platform.cpu.packing import _pack

    return _pack(nn.Linear(64, 64).to(torch.bfloat16)) is not None


needs_onednn_bf16 = pytest.mark.skipif(not onednn_packs_bf16(), reason="oneDNN cannot pack bf16 weights on this CPU")

"""specserve's few-query attention kernel (platform/cpu/tree_attention.py): its results against float32 attention,
row independence, padding rows, the shapes it takes, compiled graphs, and engines (plain and speculative) on it."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.platform.cpu import fused_layer, small_gemm, tree_attention
from tests.engine.helpers import PROMPTS, assert_greedy_equal_up_to_ties, greedy, record_rows
from tests.speculative.helpers import REPEATING_PROMPTS, assert_ngram_equals_plain

needs_kernel = pytest.mark.skipif(tree_attention.kernel() is None,
                                  reason="no AVX512-BF16 or AVX2, or no C++ compiler here")


def reference(qb, k_buf, v_buf, slots, mask, scale):
    """float32 attention with SDPA's GQA grouping (query head h reads KV head h // G): [B * Q, H * D]."""
    bsz, n_q, n_heads, head_dim = qb.shape
    k, v = k_buf[slots].float(), v_buf[slots].float()  # [B, K, Hkv, D]
    group = n_heads // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qb.float(), k) * scale
    if mask is not None:
        s = s.masked_fill(~mask.expand(bsz, 1, n_q, -1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(bsz * n_q, n_heads * head_dim)


def pool(slots: int, n_kv: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, n_kv, dim, generator=gen).bfloat16(),
            torch.randn(slots, n_kv, dim, generator=gen).bfloat16())


@pytest.mark.parametrize("kernel", [tree_attention, small_gemm])
def test_mode_names_the_variable(monkeypatch, kernel):
    """Both kernels' switches: an unknown value is an error naming the variable; off turns the kernel off."""
    monkeypatch.setenv(kernel.ENV, "fastest")
    with pytest.raises(ValueError, match=kernel.ENV):
        kernel.mode()
    monkeypatch.setenv(kernel.ENV, "off")
    assert kernel.mode() == "off" and not kernel.available()
    monkeypatch.delenv(kernel.ENV)
    assert kernel.mode() == kernel.MODES[0]  # the default


def test_takes_only_what_it_is_built_for():
    k_buf = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 4, 64, dtype=torch.bfloat16)
    assert tree_attention.takes(q, k_buf, k_buf.clone())
    assert not tree_attention.takes(q.float(), k_buf.float(), k_buf.float())  # bf16 only
    assert not tree_attention.takes(torch.zeros(1, 17, 4, 64, dtype=torch.bfloat16), k_buf, k_buf)  # a prefill chunk
    k48 = torch.zeros(8, 2, 48, dtype=torch.bfloat16)
    assert not tree_attention.takes(torch.zeros(1, 4, 4, 48, dtype=torch.bfloat16), k48, k48)  # head dim
    assert not tree_attention.takes(torch.zeros(1, 4, 3, 64, dtype=torch.bfloat16), k_buf, k_buf)  # 3 heads over 2
    strided = torch.zeros(8, 4, 64, dtype=torch.bfloat16)[:, ::2]
    assert not tree_attention.takes(q, strided, k_buf) and not tree_attention.takes(q, k_buf, strided)  # pools
    assert not tree_attention.takes(q, k_buf, torch.zeros(8, 2, 32, dtype=torch.bfloat16))  # values of another width


@needs_kernel
@pytest.mark.parametrize("bsz,n_q,n_heads,n_kv,dim,keys", [
    (1, 1, 4, 2, 64, 37),  # decode
    (1, 12, 4, 2, 64, 200),  # a verify tree
    (3, 5, 9, 3, 64, 70),  # SmolLM2's grouping, a batch
    (2, 16, 8, 8, 128, 33),  # no grouping, the widest head the kernel takes but one
    (1, 3, 4, 1, 32, 17),  # one KV head, under a block of 16 keys and over
])
def test_matches_float32_attention(bsz, n_q, n_heads, n_kv, dim, keys):
    k_buf, v_buf = pool(512, n_kv, dim)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randint(0, 512, (bsz, keys), generator=gen)
    # q as the attention layer has it: a strided view of a fused projection's output
    q = torch.randn(bsz * n_q, (n_heads + 2 * n_kv) * dim, generator=gen).bfloat16()[:, : n_heads * dim]
    qb = q.view(bsz, n_q, n_heads, dim)
    mask = torch.rand(bsz, 1, n_q, keys, generator=gen) < 0.7
    mask[..., 0] = True
    for m in (mask, None):
        got = tree_attention.tree_attention(qb, k_buf, v_buf, slots, m, dim**-0.5)
        want = reference(qb, k_buf, v_buf, slots, m, dim**-0.5)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        assert (got.float() - want).abs().mean() < 2e-3  # bf16 output rounding, not a wrong key


@needs_kernel
def test_a_row_sees_only_its_keys_bit_for_bit():
    """A tree node's row equals a one-row call over just the keys it may see (what a one-row decode of the same token
    computes), bit for bit, whatever the other rows and their masks; a row that sees nothing comes out zero."""
    k_buf, v_buf = pool(1024, 3, 64, seed=2)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randint(0, 1024, (1, 150), generator=gen)
    qb = torch.randn(1, 9, 9, 64, generator=gen).bfloat16()
    mask = torch.rand(1, 1, 9, 150, generator=gen) < 0.6
    mask[0, 0, 8] = False  # a padding row
    out = tree_attention.tree_attention(qb, k_buf, v_buf, slots, mask, 0.125)
    for i in range(8):
        seen = mask[0, 0, i].nonzero().view(-1)
        alone = tree_attention.tree_attention(qb[:, i : i + 1], k_buf, v_buf, slots[:, seen], None, 0.125)
        assert torch.equal(alone, out[i : i + 1])
    assert torch.equal(out[8], torch.zeros_like(out[8]))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_tree_rows_sharing_a_prefix_bit_for_bit(threads):
    """Verify trees in a batch: every row sees its request's prefix (whose keys the kernel reads once for all the rows
    it puts in one work item, however many threads split them) plus its own ancestors; each row still equals a one-row
    call over just its keys, and padding rows (a shorter tree) come out zero."""
    k_buf, v_buf = pool(1024, 2, 64, seed=6)
    gen = torch.Generator().manual_seed(7)
    prefix, n_q = (150, 90), 12
    slots = torch.randint(0, 1024, (2, max(prefix) + n_q), generator=gen)
    qb = torch.randn(2, n_q, 4, 64, generator=gen).bfloat16()
    mask = torch.zeros(2, 1, n_q, max(prefix) + n_q, dtype=torch.bool)
    rows = (n_q, 7)  # the second request's tree has 7 nodes: 5 padding rows
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 6, 6, 4, 8]
    for b in range(2):
        for i in range(rows[b]):
            mask[b, 0, i, : prefix[b]] = True
            node = i
            while node >= 0:  # the node and its ancestors
                mask[b, 0, i, prefix[b] + node] = True
                node = parents[node]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel splits work items over this many threads
    try:
        out = tree_attention.tree_attention(qb, k_buf, v_buf, slots, mask, 0.125).view(2, n_q, -1)
    finally:
        torch.set_num_threads(before)
    for b in range(2):
        for i in range(n_q):
            seen = mask[b, 0, i].nonzero().view(-1)
            if i >= rows[b]:
                assert torch.equal(out[b, i], torch.zeros_like(out[b, i]))
                continue
            alone = tree_attention.tree_attention(qb[b : b + 1, i : i + 1], k_buf, v_buf, slots[b : b + 1, seen], None,
                                                  0.125)
            assert torch.equal(alone[0], out[b, i])


@needs_kernel
def test_broadcast_mask_rows_and_compiled_op():
    """A decode batch's mask [B, 1, 1, K] (padded keys of shorter requests) broadcasts over the rows; the custom op in
    a compiled graph gives the eager call's result."""
    k_buf, v_buf = pool(256, 2, 64, seed=4)
    gen = torch.Generator().manual_seed(5)
    slots = torch.randint(0, 256, (2, 40), generator=gen)
    qb = torch.randn(2, 1, 4, 64, generator=gen).bfloat16()
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[1, ..., 30:] = False
    eager = tree_attention.tree_attention(qb, k_buf, v_buf, slots, mask, 0.125)
    torch.testing.assert_close(eager.float(), reference(qb, k_buf, v_buf, slots, mask, 0.125), atol=2e-2, rtol=2e-2)

    @torch.compile(backend="inductor", fullgraph=True)
    def f(qb, k_buf, v_buf, slots, mask):
        return tree_attention.tree_attention_op(qb * 1, k_buf, v_buf, slots, mask, 0.125) + 0

    assert torch.equal(f(qb, k_buf, v_buf, slots, mask), eager)


@needs_kernel
def test_engines_on_the_kernel(model_factory, monkeypatch):
    """A bf16 model whose heads the kernel takes (head dim 32): the server info reports it, decode rows and NGRAM's
    verify trees run it, plain greedy output agrees with SDPA's up to bf16 ties (SDPA rounds its probabilities to
    bf16, the kernel keeps them float32), and with the few-row linear kernel on as well (one path for every row
    count), every row of a verify tree computes what a one-row decode computes, so NGRAM's bf16 greedy output equals
    plain decoding's token for token. (Layers run their modules here, the attention module's calls recorded; on AVX2
    a fused layer calls the kernel from C++, with the modules' bits: test_fused_layer.py.)"""
    path = model_factory("llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    monkeypatch.setenv(fused_layer.ENV, "off")
    calls = record_rows(monkeypatch, tree_attention, "tree_attention", dim=1)  # queries per request
    prompts = REPEATING_PROMPTS + PROMPTS[:2]
    plain = {}
    for mode in ("on", "off"):
        monkeypatch.setenv(tree_attention.ENV, mode)
        with Engine(model_path=path, max_total_tokens=2048) as e:
            assert e.get_server_info().get("cpu_tree_attention", False) is (mode == "on")
            plain[mode] = e.generate(prompts, greedy(24), return_logprob=True, top_logprobs_num=2)
    assert_greedy_equal_up_to_ties([o["output_ids"] for o in plain["on"]], plain["off"])
    assert 1 in calls
    monkeypatch.setenv(tree_attention.ENV, "on")
    monkeypatch.setenv(small_gemm.ENV, "on")
    monkeypatch.setenv(small_gemm.AMX_ENV, "all")  # where AMX runs: decode rows and tree rows on the same path
    calls.clear()
    assert_ngram_equals_plain(prompts, model_path=path, max_total_tokens=2048)
    assert max(calls) > 1  # verify trees went through the kernel

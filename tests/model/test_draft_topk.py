"""The draft_topk operator (a draft head's norm, LM head, softmax and top-k in one call) against its steps."""

from __future__ import annotations

import pytest
import torch

from specserve.grammar.masks import allowed_tokens
from specserve.models.layers import RMSNorm
from specserve.platform.cpu import draft_topk as dt
from specserve.platform.cpu import elementwise, native
from specserve.platform.cpu.draft_topk import HeadTopk, draft_topk, draft_topk_reference
from specserve.platform.cpu.fused_layer import kernel_linear
from specserve.platform.cpu.int8_gemm import pack as pack_int8
from specserve.platform.cpu.small_gemm import pack

BF16 = torch.bfloat16
needs_op = pytest.mark.skipif(not (native.native_ops() and dt.native()),
                              reason="ops.cpp does not build here (a CPU with AVX2 or AVX512-BF16, and a compiler)")


def lm_head(gen: torch.Generator, vocab: int, hidden: int, int8: bool, bias: bool) -> list:
    """(packed, scales or None, bias or None) of a random LM head on the build's kernel."""
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    b = torch.randn(vocab, generator=gen) if bias else None
    if int8:
        return [pack_int8(torch.randint(-127, 128, (vocab, hidden), generator=gen, dtype=torch.int8)),
                torch.rand(vocab, generator=gen) / 100, b]
    return [pack(w.to(BF16)), None, b]  # the AVX2 kernel's layout is the few-row kernel's


def expected_ranking(x, norm, linear, scale: float, k: int, to_target, race=None, ban=None):
    """softmax(logits * scale) (or per group of rows logits * inv_temp - noise; banned tokens -inf) over the single
    operators' logits, its k best by (largest score, smallest id) -> (probabilities [R, k], 0 on a row with nothing
    allowed; ids [R, k])."""
    logits = kernel_linear(elementwise.rms_norm(x, norm, 1e-6), *linear).float() * scale  # [R, V]
    if race is not None:
        noise, inv_temps, per = race
        logits = logits / scale * inv_temps.repeat_interleave(per)[:, None] - noise.repeat_interleave(per, dim=0)
    if ban is not None:
        logits = logits.masked_fill(ban, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    ids = torch.arange(logits.shape[1])
    best = torch.stack([torch.tensor(sorted(range(logits.shape[1]), key=lambda j: (-row[j].item(), j))[:k])
                        for row in logits])  # [R, k]
    return probs.gather(1, best), (ids[best] if to_target is None else to_target[best])


@needs_op
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rows,k,scale", [(1, 1, 1.0), (3, 3, 1.0), (12, 8, 0.5), (20, 3, 2.0)])
def test_the_operator_ranks_as_its_steps(int8, rows, k, scale):
    """Rows of random hidden states through a random LM head (bf16 or int8, a bias on the bf16 one), with and
    without a draft -> target id map, racing in groups of rows (each group's temperature and noise), under a grammar's
    bitmask rows allowing about half the tokens (a row none): the operator's ids are the k largest of the single
    operators' logits * scale (or * 1/T - noise; bf16 logits tie often: the smaller id first), its probabilities their
    softmax's (0 on the row with nothing allowed), as the reference's."""
    gen = torch.Generator().manual_seed(rows * 10 + k + int8)
    hidden, vocab = 128, 960
    linear = lm_head(gen, vocab, hidden, int8, bias=not int8)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(BF16)
    norm = (torch.rand(hidden, generator=gen) + 0.5).to(BF16)
    to_target = torch.randperm(4 * vocab, generator=gen)[:vocab]
    groups = [g for g in (1, 2, 4) if rows % g == 0]
    per = rows // groups[-1]
    race = (torch.rand(groups[-1], vocab, generator=gen).log().neg().log(), torch.rand(groups[-1], generator=gen) + 0.5,
            per)  # noise: log E of exponentials E
    allowed = torch.randint(-(2**31), 2**31, (rows, 4 * vocab // 32), generator=gen, dtype=torch.int64).to(
        torch.int32)  # bitmask rows over the 4 * vocab target ids: about half of them allowed
    allowed[0] = 0  # a row with nothing allowed
    for mapping, racing, bits in ((None, None, None), (to_target, None, None), (to_target, race, None),
                                  (to_target, race, allowed), (None, None, allowed)):
        extra = dict(noise=racing[0], inv_temps=racing[1], rows_per_group=racing[2]) if racing else {}
        p, ids = draft_topk(x, norm, 1e-6, linear, scale, k, mapping, allowed=bits, **extra)
        ban = None if bits is None else ~allowed_tokens(bits, 4 * vocab)[:, mapping if mapping is not None else
                                                                            torch.arange(vocab)]
        want_p, want_ids = expected_ranking(x, norm, linear, scale, k, mapping, racing, ban)
        assert p.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(ids, want_ids)  # the k largest logits, the smaller id first among equal ones
        torch.testing.assert_close(p, want_p, rtol=1e-5, atol=1e-7)  # another exp, another order of the sum
        ref_p, _ = draft_topk_reference(x, norm, 1e-6, linear, scale, k, mapping, allowed=bits, **extra)
        torch.testing.assert_close(ref_p, p, rtol=1e-5, atol=1e-7)


@needs_op
def test_equal_logits_rank_the_smaller_id_first():
    """An LM head whose rows 7, 3 and 5 are one vector gives those ids one logit: they rank 3, 5, 7, after the one
    larger logit (row 9, twice the vector), with equal probabilities."""
    hidden, vocab = 64, 64
    w = torch.zeros(vocab, hidden)
    v = torch.linspace(-1, 1, hidden)
    w[[3, 5, 7]] = v
    w[9] = 2 * v
    x = v.view(1, hidden).to(BF16)
    norm = torch.ones(hidden, dtype=BF16)
    p, ids = draft_topk(x, norm, 1e-6, [pack(w.to(BF16)), None, None], 1.0, 4)
    assert ids.tolist() == [[9, 3, 5, 7]]
    assert p[0, 1] == p[0, 2] == p[0, 3] and p[0, 0] > p[0, 1]


def test_heads_without_a_kernel_copy_keep_their_modules():
    """A plain torch linear (no kernel copy) or another norm than RMSNorm: no one-call ranking."""
    assert HeadTopk.for_head(RMSNorm(8, 1e-6), torch.nn.Linear(8, 16, bias=False)) is None
    assert HeadTopk.for_head(torch.nn.LayerNorm(8), torch.nn.Linear(8, 16, bias=False)) is None
    assert HeadTopk.for_head(RMSNorm(8, 1e-6), None) is None

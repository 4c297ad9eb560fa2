"""The draft_levels operator (an EAGLE-3 head's draft levels after the root's children in one call) and draft_level (one
level, its state handed back, a grammar's rows given) against their steps, and the engine's drafting through them:
the same trees as level by level, free and under a grammar, and lossless."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.platform.cpu import draft_levels as dl
from specserve.platform.cpu import fused_layer
from specserve.platform.cpu.draft_levels import (
    draft_level,
    draft_level_reference,
    draft_levels,
    draft_levels_reference,
    run_levels,
)
from specserve.speculative.eagle import EagleProposer
from tests.engine.grammars import constrained
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.model.test_draft_topk import lm_head
from tests.model.test_fused_layer import WIDE, kernel_linears, random_layer
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

BF16 = torch.bfloat16
needs_op = pytest.mark.skipif(not (fused_layer.available() and dl.native()),
                              reason="ops.cpp does not build here (a CPU with AVX2 or AVX512-BF16, and a compiler)")


def random_tree_inputs(gen: torch.Generator, bases: list[int], levels: int, k: int, int8: bool) -> dict:
    """A random EAGLE-3 head layer and LM head, a pool holding each request's prefix keys, scratch slots for the
    levels, level 0's children and the roots' hidden states: draft_levels' arguments (but the race's)."""
    hidden, heads, kv_heads, dim, inter, vocab, table_rows = 128, 4, 2, 64, 192, 320, 512
    B = len(bases)
    linears = random_layer(gen, 2 * hidden, heads, kv_heads, dim, inter, int8, bias=not int8)
    linears[3:] = random_layer(gen, hidden, heads, kv_heads, dim, inter, int8, bias=not int8)[3:]
    norm1, norm2, norm0, head_norm = ((torch.rand(hidden, generator=gen) + 0.5).to(BF16) for _ in range(4))
    slots = torch.randperm(table_rows - 1, generator=gen) + 1  # slot 0 is padding
    width = max(bases) + levels * k
    kv_slots = torch.zeros(B, width, dtype=torch.int64)
    scratch = torch.empty(B, levels, k, dtype=torch.int64)
    used = 0
    for b, base in enumerate(bases):  # request b: its prefix keys, then its levels' scratch columns
        kv_slots[b, : base + levels * k] = slots[used : used + base + levels * k]
        scratch[b] = kv_slots[b, base : base + levels * k].view(levels, k)
        used += base + levels * k
    positions = torch.tensor(bases).repeat_interleave(k) + torch.arange(levels).unsqueeze(1)  # [L, B K]
    rope = torch.randn(max(bases) + levels + 1, 2, dim, generator=gen).to(BF16)[positions.view(-1)]
    cos, sin = (t.view(levels, B * k, 1, dim) for t in rope.unsqueeze(1).unbind(2))
    root_p = torch.softmax(torch.randn(B, 2 * k, generator=gen), -1).topk(k).values  # [B, K], sorted
    return dict(
        root_p=root_p, root_ids=torch.randint(0, 4 * vocab, (B, k), generator=gen),
        hidden=torch.randn(B, hidden, generator=gen).to(BF16),
        embed=torch.randn(4 * vocab, hidden, generator=gen).to(BF16),
        linears=linears, norm1=norm1, norm2=norm2, embed_norm=norm0, eps=1e-5, heads=heads, attn_scale=0.125,
        amx_from=4, cos=cos, sin=sin, k_buf=(torch.randn(table_rows, kv_heads, dim, generator=gen) / 2).to(BF16),
        v_buf=(torch.randn(table_rows, kv_heads, dim, generator=gen) / 2).to(BF16), scratch=scratch,
        kv_slots=kv_slots, base=bases, head_norm=head_norm, head_eps=1e-6,
        head_linear=lm_head(gen, vocab, hidden, int8, bias=False), rank_scale=1.0,
        to_target=torch.randperm(4 * vocab, generator=gen)[:vocab], rank_amx_from=4)


def run_both(inputs: dict, **extra) -> tuple:
    """The operator and its reference on copies of the pools -> ((scores, tokens, parents), pools) of each."""
    results = []
    for op in (draft_levels, draft_levels_reference):
        args = dict(inputs, k_buf=inputs["k_buf"].clone(), v_buf=inputs["v_buf"].clone(), **extra)
        results.append((op(**args), (args["k_buf"], args["v_buf"])))
    return results


@needs_op
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("bases,levels,k", [([17], 5, 3), ([9, 23], 4, 2), ([30, 12, 5], 3, 4), ([6], 4, 1)])
def test_the_operator_drafts_what_its_steps_draft(int8, bases, levels, k):
    """One request and several with prefixes of different lengths, trees of 1 to 4 branches: the candidates' scores,
    tokens and parents, and the K and V written at the scratch slots, equal the reference's (the layer and ranking
    operators level by level with EagleCandidates' bookkeeping), bit for bit; with a score scale, and racing."""
    gen = torch.Generator().manual_seed(len(bases) * 100 + levels * 10 + k + int8)
    inputs = random_tree_inputs(gen, bases, levels, k, int8)
    vocab = inputs["to_target"].numel()
    race = dict(noise=torch.rand(len(bases), levels + 1, vocab, generator=gen).log().neg().log(),
                inv_temps=torch.rand(len(bases), generator=gen) + 0.5)
    for extra in ({}, {"rank_scale": 2.5}, race):
        (got, got_pools), (want, want_pools) = run_both(inputs, keep=k + levels * k * k, **extra)  # every level
        assert got[0].shape == (len(bases), levels * k * k)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert torch.equal(got[0], want[0])
        for a, b in zip(got_pools, want_pools, strict=True):
            assert torch.equal(a, b) and not torch.equal(a, inputs["k_buf"])


def random_rows(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """An int32 bitmask [rows, W] over `vocab` token ids allowing about half of them."""
    bits = torch.rand(rows, -(-vocab // 32) * 32, generator=gen) < 0.5  # [rows, 32 W]
    words = (bits.view(rows, -1, 32).long() << torch.arange(32)).sum(-1)  # [rows, W] as unsigned
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


@needs_op
@pytest.mark.parametrize("bases,levels,k", [([17], 5, 3), ([9, 23], 4, 2), ([6], 4, 1)])
def test_levels_one_call_each_draft_what_the_steps_draft_under_a_grammar_s_rows(bases, levels, k):
    """draft_level level by level (run_levels), with rows asked before each level: the same candidates and pools as
    its reference; with every token allowed, draft_levels' candidates; the rows are asked with each level's live
    paths (branch, tokens), and no drafted token is one its parent's row forbids."""
    gen = torch.Generator().manual_seed(levels * 10 + k)
    inputs = random_tree_inputs(gen, bases, levels, k, int8=False)
    B, targets = len(bases), inputs["to_target"]
    everything = torch.full((B * k, targets.max().item() // 32 + 1), -1, dtype=torch.int32)
    (free, _), _ = run_both(inputs, keep=k + levels * k * k)
    got_all = run_levels(draft_level, **dict(inputs, k_buf=inputs["k_buf"].clone(), v_buf=inputs["v_buf"].clone()),
                         keep=k + levels * k * k, allowed_rows=lambda branch, tokens: everything)
    assert all(torch.equal(a, b) for a, b in zip(got_all, free, strict=True))
    results = []
    for level in (draft_level, draft_level_reference):
        asked, rows = [], []

        def allowed_rows(branch, tokens, asked=asked, rows=rows):
            asked.append((None if branch is None else branch.clone(), tokens.clone()))
            rows.append(random_rows(gen, B * k, targets.max().item() + 1))
            return rows[-1]

        gen.manual_seed(99)
        args = dict(inputs, k_buf=inputs["k_buf"].clone(), v_buf=inputs["v_buf"].clone())
        results.append((run_levels(level, **args, keep=k + levels * k * k, allowed_rows=allowed_rows), asked, rows,
                        args["k_buf"]))
    (got, asked, rows, pool), (want, want_asked, _, want_pool) = results
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and torch.equal(pool, want_pool)
    assert len(asked) == levels and asked[0][0] is None and torch.equal(asked[0][1], inputs["root_ids"])
    for (branch, tokens), (want_branch, want_tokens) in zip(asked[1:], want_asked[1:], strict=True):
        assert torch.equal(branch, want_branch) and torch.equal(tokens, want_tokens)
    scores, tokens, parents = got
    assert not torch.equal(tokens, free[1])  # the rows changed what was drafted
    for j in range(levels):  # each level's K x K children under their live branch's row
        cols = slice(j * k * k, (j + 1) * k * k)
        for b in range(B):
            for n in range(k * k):
                t, row = tokens[b, cols][n].item(), rows[j][b * k + n // k]
                allowed = (row[t // 32].item() >> (t % 32)) & 1
                assert allowed or scores[b, cols][n] == 0  # a row with nothing left scores 0


@needs_op
def test_the_operator_stops_where_deeper_levels_cannot_change_the_tree():
    """With few candidates kept the exact stop ends drafting early, at the level the reference stops at; a threshold
    above every path's probability stops it before the first level (no candidates)."""
    gen = torch.Generator().manual_seed(7)
    inputs = random_tree_inputs(gen, [11, 20], 6, 3, int8=False)
    (got, _), (want, _) = run_both(inputs, keep=4)
    assert 0 < got[0].shape[1] < 6 * 9
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    (got, _), (want, _) = run_both(inputs, keep=100, threshold=2.0)
    assert got[0].shape == want[0].shape == (2, 0)


def proposals(e: Engine) -> list:
    """Every tree the engine's drafter proposes from now on (tokens and parents), recorded."""
    trees: list = []
    original = EagleProposer.propose

    def recording(self, reqs, shape=None):
        tree = original(self, reqs, shape)
        trees.append((tree.tokens.clone(), tree.parents.clone()))
        return tree

    e.loop.call(lambda s: setattr(s.decoder.proposer, "propose", recording.__get__(s.decoder.proposer)))
    return trees


@needs_op
def test_engine_drafts_the_same_trees_in_one_call_and_stays_lossless(model_factory, tmp_path, monkeypatch):
    """Greedy and seeded sampled EAGLE-3 over a bf16 target with fused layers: drafting each tree's levels in one call
    proposes the trees drafting level by level proposes (the same tokens out), and both give plain decoding's
    tokens, with drafts accepted."""
    from specserve.test.tiny import make_eagle3_head_dir

    kernel_linears(monkeypatch)
    target = model_factory("llama", num_hidden_layers=2, unit_embeddings=True, identity_layers=True, dtype=BF16,
                           **WIDE)
    seeded = [greedy(20, temperature=0.8, seed=s) for s in range(len(PROMPTS))]
    with Engine(model_path=target, max_total_tokens=4096) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS, greedy(20)) + e.generate(PROMPTS, seeded)]
    draft = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self")
    kw = spec_kwargs("EAGLE3", draft, 4, 3, 8, speculative_draft_dtype="bfloat16", disable_speculative_auto_off=True)

    def run(e: Engine, one_call: bool) -> None:
        outs = e.generate(PROMPTS[:1], greedy(20)) + e.generate(PROMPTS[1:], greedy(20))
        outs += e.generate(PROMPTS, seeded)
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, 1.0)

    draft_both_ways(target, kw, monkeypatch, run)


def draft_both_ways(target: str, kw: dict, monkeypatch, run) -> None:
    """Engines on `target` with kw drafting each tree's levels through the operators, then the head's levels off
    (level by level through its modules), each given to run(engine, one_call): both propose the same trees, and
    only the first drafts through the operators."""
    from specserve.speculative.draft_models import Eagle3HeadDraft

    runs = []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(Eagle3HeadDraft, "levels", None)
        with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
            trees = proposals(e)
            run(e, one_call)
            assert_no_kv_leak(e)
            calls = e.loop.call(lambda s: s.decoder.proposer.one_call_trees)
        assert (calls > 0) == one_call
        runs.append(trees)
    assert len(runs[0]) == len(runs[1]) > 0
    for (t1, p1), (t2, p2) in zip(*runs, strict=True):
        assert torch.equal(t1, t2) and torch.equal(p1, p2)


@needs_op
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_engine_drafts_the_same_trees_under_a_grammar_one_level_a_call(model_factory, tmp_path, monkeypatch,
                                                                        backend):
    """Constrained requests (a regex and a JSON schema, greedy and seeded, with a free one beside them) through an
    EAGLE-3 head over a bf16 target with fused layers: drafting each level in one call with the grammars' rows between
    the calls proposes the trees the engine's level-by-level path proposes, and both give constrained plain decoding's
    tokens, with drafts accepted."""
    from specserve.test.tiny import make_eagle3_head_dir

    kernel_linears(monkeypatch)
    target = model_factory("llama", num_hidden_layers=2, unit_embeddings=True, identity_layers=True, dtype=BF16,
                           **WIDE)
    params = [constrained("regex", 20), constrained("json_schema", 30), greedy(20),
              constrained("json_schema", 30, temperature=0.8, seed=3)]
    with Engine(model_path=target, max_total_tokens=4096, grammar_backend=backend) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS[:4], params)]
    draft = make_eagle3_head_dir(str(tmp_path / "h3"), target, kind="self")
    kw = spec_kwargs("EAGLE3", draft, 4, 3, 8, speculative_draft_dtype="bfloat16", disable_speculative_auto_off=True,
                     grammar_backend=backend)
    rows_asked = []  # the grammars' rows asked by one-call drafting
    original_rows = EagleProposer._level_rows

    def level_rows(self, *args):
        rows_asked.append(args[2])
        return original_rows(self, *args)

    monkeypatch.setattr(EagleProposer, "_level_rows", level_rows)

    def run(e: Engine, one_call: bool) -> None:
        outs = e.generate(PROMPTS[1:2], params[1]) + e.generate(PROMPTS[:4], params)
        assert [o["output_ids"] for o in outs] == plain[1:2] + plain
        assert_drafting_happened([outs[0], outs[1], outs[2]], 1.0)
        assert (len(rows_asked) > 0) == one_call
        rows_asked.clear()

    draft_both_ways(target, kw, monkeypatch, run)

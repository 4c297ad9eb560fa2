"""The SDPA backend: metadata on hand-checked inputs, and masked attention against a per-query reference."""

from __future__ import annotations

import torch

from specserve.attention import ForwardBatch, ForwardMode, attention
from specserve.attention.sdpa import SdpaBackend, build_attn_metadata
from specserve.cache.kv_pool import KVPool, ReqToTokenPool, SlotAllocator


def test_padding_indices_hand_checked():
    md = build_attn_metadata(torch.arange(1, 13).view(2, 6), kv_lens=[5, 3], q_lens=[2, 1])
    # request 0 has 2 new tokens (rows 0,1), request 1 one (row 2); pad row = T = 3
    assert md.q_index.tolist() == [[0, 1], [2, 3]]
    assert md.out_index.tolist() == [0, 1, 2]
    m = md.mask[:, 0].int().tolist()
    assert m[0] == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]  # prefix 3, then causal over the 2 new keys
    assert m[1] == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]  # 3 keys; padded query row sees key 0 only


def test_fast_paths():
    slots = torch.arange(1, 9).view(2, 4)
    decode = build_attn_metadata(slots, [4, 4], [1, 1])
    assert decode.mask is None and not decode.is_causal and decode.q_index is None
    prefill = build_attn_metadata(slots, [4, 4], [4, 4])
    assert prefill.mask is None and prefill.is_causal
    ragged = build_attn_metadata(slots, [4, 2], [1, 1])
    assert ragged.mask[:, 0, 0].tolist() == [[True] * 4, [True, True, False, False]]


def _reference(q, k_all, v_all, visible, scale):
    """q [n, H, D]; k_all/v_all [K, Hkv, D]; visible [n, K] bool -> [n, H*D], one query at a time."""
    rep = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(rep, dim=1)
    v = v_all.repeat_interleave(rep, dim=1)
    outs = []
    for i in range(q.shape[0]):
        idx = visible[i].nonzero().flatten()
        att = torch.einsum("hd,khd->hk", q[i], k[idx]) * scale
        outs.append(torch.einsum("hk,khd->hd", att.softmax(-1), v[idx]).reshape(-1))
    return torch.stack(outs)


def test_custom_tree_mask_equals_per_query_attention():
    torch.manual_seed(0)
    H, Hkv, D, prefix = 4, 2, 8, 5
    pool = KVPool(1, 32, Hkv, D, torch.float32, "cpu")
    alloc = SlotAllocator(32, "cpu")
    table = ReqToTokenPool(2, 32, "cpu")
    # a 5-node tree: 0 -> {1, 2}, 1 -> 3, 2 -> 4 (each node sees the prefix and its ancestors)
    parents = [-1, 0, 0, 1, 2]
    tree = torch.zeros(5, 5, dtype=torch.bool)
    for n, p in enumerate(parents):
        tree[n, n] = True
        while p >= 0:
            tree[n, p] = True
            p = parents[p]
    row = table.alloc()
    slots = alloc.alloc(prefix + 5)
    table.write(row, 0, slots)
    k_prefix, v_prefix = torch.randn(prefix, Hkv, D), torch.randn(prefix, Hkv, D)
    pool.k[0][slots[:prefix]], pool.v[0][slots[:prefix]] = k_prefix, v_prefix
    q, k, v = torch.randn(5, H, D), torch.randn(5, Hkv, D), torch.randn(5, Hkv, D)
    md = build_attn_metadata(table.req_to_token[[row]], [prefix + 5], [5], custom_masks=[tree])
    fb = ForwardBatch(ForwardMode.TARGET_VERIFY, torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long),
                      slots[prefix:], md, pool)
    got = attention(q, k, v, 0, fb, scale=D**-0.5)
    visible = torch.cat([torch.ones(5, prefix, dtype=torch.bool), tree], dim=1)
    want = _reference(q, torch.cat([k_prefix, k]), torch.cat([v_prefix, v]), visible, D**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_draft_step_mask_over_earlier_scratch_keys():
    """A draft-tree step: 2 new branch tokens see the prefix, the 4 scratch keys written by the previous level
    only along their own path ([q, t] mask with t = 6 > q = 2), and themselves."""
    torch.manual_seed(1)
    H, Hkv, D, prefix = 4, 2, 8, 3
    pool = KVPool(1, 32, Hkv, D, torch.float32, "cpu")
    slots = SlotAllocator(32, "cpu").alloc(prefix + 6)
    table = ReqToTokenPool(1, 32, "cpu")
    table.write(0, 0, slots)
    k_old, v_old = torch.randn(prefix + 4, Hkv, D), torch.randn(prefix + 4, Hkv, D)  # prefix + previous level
    pool.k[0][slots[: prefix + 4]], pool.v[0][slots[: prefix + 4]] = k_old, v_old
    # previous-level keys 0..3 (two levels of K=2); new branch 0 descends from old keys 1 and 2, branch 1 from 0, 3
    tail = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 0, 1, 0, 1]], dtype=torch.bool)  # [q=2, t=6]
    q, k, v = torch.randn(2, H, D), torch.randn(2, Hkv, D), torch.randn(2, Hkv, D)
    md = build_attn_metadata(table.req_to_token[[0]], [prefix + 6], [2], custom_masks=[tail])
    fb = ForwardBatch(ForwardMode.DRAFT_DECODE, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                      slots[prefix + 4 :], md, pool)
    got = attention(q, k, v, 0, fb, scale=D**-0.5)
    visible = torch.cat([torch.ones(2, prefix, dtype=torch.bool), tail], dim=1)
    want = _reference(q, torch.cat([k_old, k]), torch.cat([v_old, v]), visible, D**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_slot_allocator_and_table():
    alloc = SlotAllocator(4, "cpu")
    a = alloc.alloc(3)
    assert sorted(a.tolist()) == [1, 2, 3] and alloc.alloc(2) is None and alloc.available_size() == 1
    alloc.free(a[:2])
    assert alloc.available_size() == 3 and len(alloc.alloc(3)) == 3
    table = ReqToTokenPool(2, 8, "cpu")
    r1, r2 = table.alloc(), table.alloc()
    assert {r1, r2} == {0, 1} and table.alloc() is None
    table.free(r1)
    assert table.available_size() == 1


def test_equal_lengths_fast_path_matches_the_general_mask():
    """Requests with equal lengths, each with its own mask over its last t keys (t = q: a verify tree; t > q: a
    draft level seeing earlier levels): the direct [prefix | custom] mask equals the general path's, reached
    here by giving the second request a mask one column narrower and putting that column back afterwards."""
    torch.manual_seed(0)
    slots = torch.arange(40).view(2, 20)
    for t in (5, 8):
        own = torch.zeros(5, t, dtype=torch.bool)
        own[:, t - 5 :] = torch.eye(5, dtype=torch.bool)  # every query sees itself among the new keys
        customs = list((torch.rand(2, 5, t) < 0.5) | own)
        fast = build_attn_metadata(slots, [12, 12], [5, 5], custom_masks=customs)
        general = build_attn_metadata(slots, [12, 12], [5, 5], custom_masks=[customs[0], customs[1][:, 1:]])
        general.mask[1, 0, :, 12 - t] = customs[1][:, 0]  # the column the narrower mask left to the causal rule
        assert torch.equal(fast.mask, general.mask)
        assert fast.mask.shape == (2, 1, 5, 12) and bool(fast.mask[:, :, :, : 12 - t].all())
        assert torch.equal(fast.kv_slots, slots[:, :12]) and fast.q_index is None and not fast.is_causal


def test_equal_extends_after_a_prefix_match_the_general_causal_mask():
    """Equal chunks after equal prefixes (a batch-1 prefill chunk, a draft extend) take a direct [prefix | tril]
    mask; it equals what the general path builds for the same request inside a batch of unequal lengths."""
    slots = torch.arange(60).view(3, 20)
    fast = build_attn_metadata(slots[:2], [9, 9], [4, 4])
    general = build_attn_metadata(slots, [9, 9, 12], [4, 4, 2])  # a third, longer request forces padding
    assert fast.q_index is None and not fast.is_causal and fast.mask.shape == (2, 1, 4, 9)
    assert torch.equal(fast.mask, general.mask[:2, :, :, :9])
    assert fast.mask[0, 0].int().tolist()[0] == [1, 1, 1, 1, 1, 1, 0, 0, 0]  # 5 prefix keys, then itself only


def test_mixed_groups_equal_separate_attention():
    """A mixed batch (two one-token decode rows, then a 3-token prefill chunk) attends each group on its own:
    the same outputs as the two groups' own attention calls, and the decode rows are not padded to the chunk."""
    from specserve.attention import extend_inputs
    from specserve.attention.sdpa import mixed_attn_metadata

    torch.manual_seed(2)
    H, Hkv, D = 4, 2, 8
    pool = KVPool(1, 64, Hkv, D, torch.float32, "cpu")
    table = ReqToTokenPool(3, 32, "cpu")
    alloc = SlotAllocator(64, "cpu")
    for row, n in ((0, 6), (1, 4), (2, 5)):  # decode rows own 6 and 4 keys; the chunk starts after 2 cached
        table.write(row, 0, alloc.alloc(n))
        pool.k[0][table.req_to_token[row, :n]] = torch.randn(n, Hkv, D)
        pool.v[0][table.req_to_token[row, :n]] = torch.randn(n, Hkv, D)
    dec = build_attn_metadata(table.req_to_token[[0, 1]], [6, 4], [1, 1])
    _, _, chunk_loc, pre = extend_inputs(SdpaBackend(), table.req_to_token, [2], [2], [[7, 8, 9]])
    mixed = mixed_attn_metadata([(2, dec), (3, pre)])
    assert mixed.batch_size == 3 and mixed.max_q_len == 3 and dec.max_q_len == 1
    q, k, v = torch.randn(5, H, D), torch.randn(5, Hkv, D), torch.randn(5, Hkv, D)
    loc = torch.cat([table.req_to_token[0, 5:6], table.req_to_token[1, 3:4], chunk_loc])

    def run(md, rows):
        fb = ForwardBatch(ForwardMode.EXTEND, torch.zeros(len(rows), dtype=torch.long),
                          torch.zeros(len(rows), dtype=torch.long), loc[rows], md, pool)
        return attention(q[rows], k[rows], v[rows], 0, fb, scale=D**-0.5)

    got = run(mixed, list(range(5)))
    torch.testing.assert_close(got[:2], run(dec, [0, 1]))
    torch.testing.assert_close(got[2:], run(pre, [2, 3, 4]))


def test_decode_attention_folds_query_heads_per_kv_head():
    """One query per request (decode): the G query heads sharing a KV head are attended as G rows of that head
    (q viewed [B, Hkv, G, D]). Same outputs as per-query attention with the KV heads repeated, for GQA groups of
    1 (no GQA), 2 and 4, and requests of unequal lengths (padded keys masked)."""
    torch.manual_seed(3)
    D, lens = 8, [6, 3, 5]
    for H, Hkv in ((4, 4), (4, 2), (8, 2)):
        pool = KVPool(1, 64, Hkv, D, torch.float32, "cpu")
        table = ReqToTokenPool(3, 16, "cpu")
        alloc = SlotAllocator(64, "cpu")
        for row, n in enumerate(lens):
            table.write(row, 0, alloc.alloc(n))
            pool.k[0][table.req_to_token[row, :n]] = torch.randn(n, Hkv, D)
            pool.v[0][table.req_to_token[row, :n]] = torch.randn(n, Hkv, D)
        md = build_attn_metadata(table.req_to_token[[0, 1, 2]], lens, [1, 1, 1])
        assert md.max_q_len == 1 and md.mask is not None  # ragged: padded keys are masked
        q, k, v = torch.randn(3, H, D), torch.randn(3, Hkv, D), torch.randn(3, Hkv, D)
        loc = torch.stack([table.req_to_token[row, n - 1] for row, n in enumerate(lens)])  # each one's last key
        fb = ForwardBatch(ForwardMode.DECODE, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                          loc, md, pool)
        got = attention(q, k, v, 0, fb, scale=D**-0.5)  # [3, H*D]
        for row, n in enumerate(lens):
            keys = table.req_to_token[row, :n]
            want = _reference(q[row : row + 1], pool.k[0][keys], pool.v[0][keys], torch.ones(1, n, dtype=torch.bool),
                              D**-0.5)
            torch.testing.assert_close(got[row : row + 1], want, atol=1e-5, rtol=1e-5)


def test_verify_attention_folds_query_heads_in_half_precision(monkeypatch):
    """Several queries per request in bf16 on CPU, from FOLD_MIN_BATCH requests (verify trees at a large batch):
    each KV head's query heads are attended as G * Q rows of it (``_attend_folded``), as the CPU policy the batch
    carries decides. Checked against the per-query float32 reference and against SDPA's own GQA grouping (a batch
    with no policy), for ragged requests with tree masks and padded query rows, GQA groups of 2 and 4; a batch below
    FOLD_MIN_BATCH, float32, plain causal and the plain policy keep the kernel's path."""
    from specserve.attention import sdpa as backend
    from specserve.config import ServerArgs
    from specserve.platform import platform_policy
    from specserve.platform.cpu.policy import FOLD_MIN_BATCH

    cpu, plain = (platform_policy(ServerArgs(), torch.device(d)) for d in ("cpu", "cuda"))
    folded, fold = [], backend._attend_folded
    monkeypatch.setattr(backend, "_attend_folded", lambda *a: folded.append(1) or fold(*a))
    torch.manual_seed(5)
    D, lens, q_lens = 8, [9, 4, 7, 12, 6], [3, 2, 3, 1, 2]
    for H, Hkv in ((4, 2), (8, 2)):
        pool = KVPool(1, 96, Hkv, D, torch.bfloat16, "cpu")
        table = ReqToTokenPool(5, 16, "cpu")
        alloc = SlotAllocator(96, "cpu")
        masks = []
        for row, (n, q) in enumerate(zip(lens, q_lens, strict=True)):
            table.write(row, 0, alloc.alloc(n))
            pool.k[0][table.req_to_token[row, : n - q]] = torch.randn(n - q, Hkv, D).bfloat16()
            pool.v[0][table.req_to_token[row, : n - q]] = torch.randn(n - q, Hkv, D).bfloat16()
            masks.append(torch.eye(q, dtype=torch.bool) | torch.tensor([[True] + [False] * (q - 1)] * q))  # a star
        md = build_attn_metadata(table.req_to_token[list(range(5))], lens, q_lens, custom_masks=masks)
        T = sum(q_lens)
        q, k, v = (torch.randn(T, h, D).bfloat16() for h in (H, Hkv, Hkv))
        spans = enumerate(zip(lens, q_lens, strict=True))
        loc = torch.cat([table.req_to_token[row, n - ql : n] for row, (n, ql) in spans])  # the new tokens' slots
        fb = ForwardBatch(ForwardMode.TARGET_VERIFY, torch.zeros(T, dtype=torch.long),
                          torch.zeros(T, dtype=torch.long), loc, md, pool)
        md.platform = cpu  # what the runner's backend gives the metadata it builds
        qb = torch.zeros(5, md.max_q_len, H, D, dtype=torch.bfloat16)
        assert cpu.folds_query_heads(qb, Hkv, masked=True)
        assert not cpu.folds_query_heads(qb[: FOLD_MIN_BATCH - 1], Hkv, masked=True)
        assert not cpu.folds_query_heads(qb.float(), Hkv, masked=True)
        assert not cpu.folds_query_heads(qb, Hkv, masked=False) and not plain.folds_query_heads(qb, Hkv, masked=True)
        folded.clear()
        got = attention(q, k, v, 0, fb, scale=D**-0.5)  # [T, H*D]
        assert folded
        start = 0
        for row, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
            keys = table.req_to_token[row, :n]
            visible = torch.cat([torch.ones(ql, n - ql, dtype=torch.bool), masks[row]], dim=1)
            want = _reference(q[start : start + ql].float(), pool.k[0][keys].float(), pool.v[0][keys].float(),
                              visible, D**-0.5)
            torch.testing.assert_close(got[start : start + ql].float(), want, atol=2e-2, rtol=2e-2)
            start += ql
        md.platform, folded[:] = None, []  # the kernel's own grouping
        unfolded = attention(q, k, v, 0, fb, scale=D**-0.5)
        assert not folded
        torch.testing.assert_close(got.float(), unfolded.float(), atol=2e-2, rtol=2e-2)


def test_attended_slots_takes_only_the_attended_columns():
    from specserve.attention.sdpa import attended_slots

    table = torch.arange(4 * 10).view(4, 10)  # 4 rows, a context of 10 columns
    got = attended_slots(table, torch.tensor([2, 0]), [3, 5])
    assert got.tolist() == [[20, 21, 22, 23, 24], [0, 1, 2, 3, 4]]


def test_decode_metadata_hand_checked_and_equal_to_the_general_builder():
    """decode_attn_metadata (the plain decode step's builder): rows 2 and 0 of a 4 x 6 table holding 3 and 5 keys.
    Hand-checked slots and mask; the same fields as build_attn_metadata's one-query case; no mask when the lengths
    are equal."""
    from specserve.attention.sdpa import decode_attn_metadata

    table = torch.arange(4 * 6).view(4, 6)
    rows, positions = torch.tensor([2, 0]), torch.tensor([2, 4])  # the new token is each request's last key
    md = decode_attn_metadata(table, rows, positions, [3, 5])
    assert md.kv_slots.tolist() == [[12, 13, 14, 15, 16], [0, 1, 2, 3, 4]]
    assert md.mask[:, 0, 0].tolist() == [[True, True, True, False, False], [True] * 5]
    assert (md.batch_size, md.max_q_len, md.is_causal, md.q_index, md.out_index) == (2, 1, False, None, None)
    general = build_attn_metadata(table[rows], [3, 5], [1, 1])
    assert torch.equal(md.kv_slots, general.kv_slots) and torch.equal(md.mask, general.mask)
    same = decode_attn_metadata(table, rows, torch.tensor([3, 3]), [4, 4])
    assert same.mask is None and same.kv_slots.tolist() == [[12, 13, 14, 15], [0, 1, 2, 3]]


def test_compiled_decode_attention_reads_the_pool_by_slot(monkeypatch):
    """One query per request: the slot-reading formulation (taken by compiled CPU forwards) equals the per-query
    reference for two requests of 6 and 3 keys (padded, masked) in float32, called directly and from inside a
    compiled ``_attend``, which takes that path only while compiling (a spy counts the compiled trace's call)."""
    from specserve.attention import sdpa
    from specserve.attention.sdpa import _attend, _attend_one_query_by_slot, decode_attn_metadata

    torch.manual_seed(0)
    H, Hkv, D = 6, 2, 8
    k_buf, v_buf = torch.randn(16, Hkv, D), torch.randn(16, Hkv, D)  # slot 0 = padding
    table = torch.zeros(2, 8, dtype=torch.long)
    table[0, :6], table[1, :3] = torch.tensor([3, 9, 4, 12, 1, 7]), torch.tensor([15, 2, 8])
    md = decode_attn_metadata(table, torch.tensor([0, 1]), torch.tensor([5, 2]), [6, 3])
    q = torch.randn(2, H, D)
    want = torch.cat([_reference(q[b : b + 1], k_buf[table[b, :n]], v_buf[table[b, :n]],
                                 torch.ones(1, n, dtype=torch.bool), D**-0.5) for b, n in ((0, 6), (1, 3))])
    assert torch.allclose(_attend_one_query_by_slot(q, k_buf, v_buf, md, D**-0.5), want, atol=1e-5)
    calls = []
    real = sdpa._attend_one_query_by_slot
    monkeypatch.setattr(sdpa, "_attend_one_query_by_slot", lambda *a: calls.append(1) or real(*a))
    assert torch.allclose(_attend(q, k_buf, v_buf, md, D**-0.5, None), want, atol=1e-5)  # eager: SDPA
    assert not calls
    compiled = torch.compile(_attend, fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(q, k_buf, v_buf, md, D**-0.5, None), want, atol=1e-5)
    assert calls  # traced through the slot path


def test_padding_waste_hand_checked():
    from specserve.attention.sdpa import padding_waste

    # padded: 3 requests x 4 queries x 10 keys = 120 scores; their own: 4*10 + 1*3 + 2*6 = 55
    assert padding_waste([10, 3, 6], [4, 1, 2]) == 65
    assert padding_waste([7, 7], [7, 7]) == 0


def test_per_request_groups_equal_padded_attention(monkeypatch):
    """A prefill batch split into one group per request (``extend_inputs(..., may_split=True)`` when padding would
    waste enough): a long prompt, a short one, a chunk after a cached prefix and a one-token chunk. Same outputs as
    the padded [B, Qmax, Kmax] attention, and no group is padded. Nested groups flatten inside a mixed batch."""
    from specserve.attention import extend_inputs
    from specserve.attention import sdpa as backend

    monkeypatch.setattr(backend, "MIN_PADDING_PER_REQUEST", 0)  # split whatever the padding
    torch.manual_seed(4)
    H, Hkv, D = 4, 2, 8
    rows, starts, q_lens = [0, 1, 2, 3], [0, 0, 5, 9], [40, 3, 6, 1]
    pool = KVPool(1, 128, Hkv, D, torch.float32, "cpu")
    table = ReqToTokenPool(4, 64, "cpu")
    alloc = SlotAllocator(128, "cpu")
    for row, s, n in zip(rows, starts, q_lens, strict=True):
        table.write(row, 0, alloc.alloc(s + n))
        pool.k[0][table.req_to_token[row, :s]] = torch.randn(s, Hkv, D)  # the cached prefix
        pool.v[0][table.req_to_token[row, :s]] = torch.randn(s, Hkv, D)
    tokens = [[5] * n for n in q_lens]
    sdpa = backend.SdpaBackend()
    _, _, loc, padded = extend_inputs(sdpa, table.req_to_token, rows, starts, tokens)
    _, _, loc2, split = extend_inputs(sdpa, table.req_to_token, rows, starts, tokens, may_split=True)
    assert padded.groups is None and torch.equal(loc, loc2)
    assert [n for n, _ in split.groups] == q_lens
    assert [md.max_q_len for _, md in split.groups] == q_lens and split.groups[0][1].is_causal  # no prefix
    T = sum(q_lens)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)

    def run(md):
        fb = ForwardBatch(ForwardMode.EXTEND, torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long),
                          loc, md, pool)
        return attention(q, k, v, 0, fb, scale=D**-0.5)

    torch.testing.assert_close(run(split), run(padded), atol=1e-5, rtol=1e-5)
    nested = backend.mixed_attn_metadata([(2, padded), (T, split)])
    assert len(nested.groups) == 1 + len(q_lens) and nested.batch_size == 2 * len(q_lens)


def test_extend_splits_only_where_padding_wastes(monkeypatch):
    """The rule: split when padding wastes at least MIN_PADDING_PER_REQUEST scores per request on average."""
    from specserve.attention import extend_inputs
    from specserve.attention import sdpa as backend

    table = torch.arange(2 * 512).view(2, 512)
    tokens = [[1] * 100, [1] * 90]  # padded 2*100*100, their own 100*100 + 90*90: 1900 wasted, 950 per request
    monkeypatch.setattr(backend, "MIN_PADDING_PER_REQUEST", 950)
    assert extend_inputs(SdpaBackend(), table, [0, 1], [0, 0], tokens, may_split=True)[3].groups is not None
    assert extend_inputs(SdpaBackend(), table, [0, 1], [0, 0], tokens)[3].groups is None  # a caller that may not split
    monkeypatch.setattr(backend, "MIN_PADDING_PER_REQUEST", 951)
    assert extend_inputs(SdpaBackend(), table, [0, 1], [0, 0], tokens, may_split=True)[3].groups is None


def test_default_rule_splits_a_long_prompt_among_short_ones():
    from specserve.attention import extend_inputs

    table = torch.arange(16 * 2048).view(16, 2048)
    rows = list(range(16))
    long_and_short = [[1] * 1024] + [[1] * 16] * 15  # padding: 16 x 1024 x 1024 scores for ~1.05M real ones
    assert extend_inputs(SdpaBackend(), table, rows, [0] * 16, long_and_short, may_split=True)[3].groups is not None
    similar = [[1] * n for n in range(8, 128, 8)][:15] + [[1] * 128]  # the padding wastes ~2x, little per request
    assert extend_inputs(SdpaBackend(), table, rows, [0] * 16, similar, may_split=True)[3].groups is None

"""TreeKeys: a draft tree's level attention under SDPA, laid out once per tree (attention/sdpa.py)."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.sdpa import TreeKeys, build_attn_metadata


def _table(rows: int = 4, cols: int = 16) -> torch.Tensor:
    return torch.arange(100, 100 + rows * cols).view(rows, cols)  # distinct "slots" per (row, column)


def test_hand_checked_unequal_prefixes():
    table = _table()
    scratch = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # [B=2, 2 levels x K=2]
    keys = TreeKeys.build(table, rows=[1, 3], base=[2, 3], scratch=scratch)
    assert table[1, 2:6].tolist() == [1, 2, 3, 4] and table[3, 3:7].tolist() == [5, 6, 7, 8]
    assert keys.kv_slots.tolist() == [[116, 117, 1, 2, 3, 4, 122], [148, 149, 150, 5, 6, 7, 8]]
    level1 = keys.level(torch.eye(2, dtype=torch.bool).expand(2, 2, 2))  # each branch sees itself
    assert level1.kv_slots.shape == (2, 5) and level1.batch_size == 2 and level1.max_q_len == 2
    m = level1.mask[:, 0].int().tolist()
    assert m[0] == [[1, 1, 1, 0, 0], [1, 1, 0, 1, 0]]  # prefix 2, own scratch column, nothing past its keys
    assert m[1] == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]  # prefix 3
    level2 = keys.level(torch.tensor([[[1, 0, 1, 0], [1, 0, 0, 1]], [[0, 1, 1, 0], [0, 1, 0, 1]]]).bool())
    m = level2.mask[:, 0].int().tolist()
    assert m[0] == [[1, 1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 1, 0]]
    assert m[1] == [[1, 1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 1, 0, 1]]


@pytest.mark.parametrize("base", [[5, 5, 5], [3, 7, 5], [0, 2, 1]])
def test_levels_match_build_attn_metadata(base):
    """Same keys and mask as building each level with build_attn_metadata (the general path), at every level."""
    torch.manual_seed(0)
    B, K, levels = len(base), 3, 3
    rows = [2, 0, 3]
    table = _table(cols=32)
    scratch = torch.arange(1000, 1000 + B * levels * K).view(B, levels * K)
    keys = TreeKeys.build(table, rows, base, scratch)
    for j in range(1, levels + 1):
        tree = torch.rand(B, K, j * K) < 0.5
        tree[:, :, (j - 1) * K :] = torch.eye(K, dtype=torch.bool)  # the level's own columns: itself only
        kv_lens = [b + j * K for b in base]
        want = build_attn_metadata(table[torch.tensor(rows)], kv_lens, [K] * B, custom_masks=list(tree.unbind(0)))
        got = keys.level(tree)
        assert torch.equal(got.kv_slots, want.kv_slots)
        assert torch.equal(got.mask, want.mask)
        assert (got.q_index, got.out_index, got.is_causal) == (want.q_index, want.out_index, want.is_causal)

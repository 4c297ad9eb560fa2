"""The pure parts of tensor parallelism on hand-checked inputs: who holds which heads, rows and CPUs; the checkpoint
slices a rank loads; the flags' start-up checks."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specserve.config import ConfigError, ServerArgs
from specserve.models.loader import load_model
from specserve.models.tensor_parallel import (
    ZEROS,
    TPGroup,
    check_divisible,
    kv_heads_of,
    padded_vocab,
    shard_rules,
    split_range,
    take_shard,
)
from specserve.parallel.ranks import parse_cpulist, rank_cpus


def test_split_range_and_padded_vocab():
    assert [split_range(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    assert [split_range(12, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert padded_vocab(509, 2) == 510 and padded_vocab(512, 4) == 512 and padded_vocab(513, 4) == 516


def test_kv_heads_split_or_replicated():
    # 8 query heads over 4 KV heads (groups of 2): two ranks take two KV heads each
    assert [kv_heads_of(8, 4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    # 8 query heads, 2 KV heads, 4 ranks: ranks 0-1 (query heads 0-3) read KV head 0, ranks 2-3 KV head 1
    assert [kv_heads_of(8, 2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # one KV head (multi-query): every rank holds it
    assert [kv_heads_of(4, 1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]


def test_check_divisible_names_the_flag_and_what_does_not_split():
    check_divisible(2, 4, 2, 128)
    check_divisible(4, 8, 2, 128)  # KV heads replicated: 4 ranks over 2 KV heads
    with pytest.raises(ConfigError, match=r"--tp-size 3 .*4 attention heads.*2 KV heads.*MLP width 128"):
        check_divisible(3, 4, 2, 128)
    with pytest.raises(ConfigError, match="3 KV heads"):
        check_divisible(2, 6, 3, 128)


def test_rank_cpus_fill_a_numa_node_before_the_next():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    nodes = [{0, 1, 4, 5}, {2, 3, 6, 7}]
    assert rank_cpus(list(range(8)), nodes, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert rank_cpus([0, 1], [], 2) == [[0], [1]]
    assert rank_cpus([0], [], 2) == [[0], [0]]  # fewer CPUs than ranks: they share
    assert rank_cpus(list(range(5)), [], 2) == [[0, 1], [2, 3]]


def test_take_shard_reads_slices_pads_and_zeros(tmp_path):
    full = torch.arange(20.0).view(5, 4)
    save_file({"w": full}, str(tmp_path / "x.safetensors"))
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        lazy = f.get_slice("w")
        assert torch.equal(take_shard(lazy, (1, 2, 4), torch.empty(5, 2)), full[:, 2:4])
        # rows 3..6 of a 5-row tensor: two real rows, one row of padding
        assert torch.equal(take_shard(lazy, (0, 3, 6), torch.empty(3, 4)),
                           torch.cat([full[3:5], torch.zeros(1, 4)]))
        assert torch.equal(take_shard(lazy, None, full), full)
    assert torch.equal(take_shard(full, ZEROS, torch.empty(4)), torch.zeros(4))


@pytest.mark.parametrize("arch, overrides", [("llama", dict(num_key_value_heads=1, vocab_size=509)),
                                             ("qwen2", {})])
def test_two_shards_hold_exactly_the_whole_model(model_factory, arch, overrides):
    """Loading rank 0's and rank 1's shards (no collective runs at load) and putting them back together gives the
    checkpoint: q/k/v and gate/up by output rows, o_proj and down_proj by input columns, the vocabulary by rows,
    a row-parallel bias on rank 0 only."""
    path = model_factory(arch, **overrides)
    whole, spec, _ = load_model(path, "float32")
    shards = [load_model(path, "float32", tp=TPGroup(r, 2))[0] for r in range(2)]
    assert shard_rules(shards[1])  # rank 1 has rules (rank 0's biases load whole)
    a0, a1, aw = (m.model.layers[0].self_attn for m in (*shards, whole))
    q, kv = aw.q_size, aw.kv_size
    for piece, (lo, hi) in enumerate([(0, q), (q, q + kv), (q + kv, q + 2 * kv)]):
        parts = [a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size])[piece] for a in (a0, a1)]
        ref = aw.qkv_proj.weight[lo:hi]
        if piece and spec.num_kv_heads == 1:  # the one KV head, on both ranks
            assert torch.equal(parts[0], ref) and torch.equal(parts[1], ref)
        else:
            assert torch.equal(torch.cat(parts), ref)
    assert torch.equal(torch.cat([a0.o_proj.weight, a1.o_proj.weight], dim=1), aw.o_proj.weight)
    m0, m1, mw = (m.model.layers[0].mlp for m in (*shards, whole))
    assert torch.equal(torch.cat([m0.down_proj.weight, m1.down_proj.weight], dim=1), mw.down_proj.weight)
    gate = torch.cat([m.gate_up_proj.weight[: m.intermediate] for m in (m0, m1)])
    assert torch.equal(gate, mw.gate_up_proj.weight[: mw.intermediate])
    emb = torch.cat([s.model.embed_tokens.weight for s in shards])
    assert torch.equal(emb[: spec.vocab_size], whole.model.embed_tokens.weight)
    assert not emb[spec.vocab_size:].any()  # the padding rows
    assert torch.equal(torch.cat([s.lm_head.weight for s in shards])[: spec.vocab_size], whole.lm_head.weight)
    if aw.qkv_proj.bias is not None:
        q_bias = torch.cat([a.qkv_proj.bias[: a.q_size] for a in (a0, a1)])
        assert torch.equal(q_bias, aw.qkv_proj.bias[:q])


@pytest.mark.parametrize("flags, message", [
    (dict(tp_size=0), "--tp-size"),
    (dict(tp_size=3, nnodes=2), "--tp-size 3 must be a multiple of --nnodes 2"),
    (dict(tp_size=2, nnodes=2), "--dist-init-addr"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank"),
    (dict(tp_size=2, dist_init_addr="nohost"), "--dist-init-addr must be host:port"),
    (dict(tp_size=2, enable_torch_compile=True), "--enable-torch-compile"),
    (dict(tp_size=2, torch_compile_in_background=True), "--torch-compile-in-background"),
])
def test_scale_out_flags_fail_at_start_up_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        ServerArgs(model_path="m", **flags).validate()


def test_sglang_spellings_of_the_scale_out_flags():
    from specserve.launch_server import parse_args

    args = parse_args(["--model-path", "m", "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
                       "10.0.0.1:5000"], "launch_server", None)
    assert (args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr) == (2, 2, 1, "10.0.0.1:5000")

"""--enable-torch-compile: compiled decode, verify and draft forwards give the eager greedy output token for token
(with drafting and acceptance happening), batches above --torch-compile-max-bs run eager, compile time is
reported; the graphs are built by warm-up requests at start-up (unless --skip-server-warmup)."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.platform.cpu.packing import PackedLinear
from tests.engine.helpers import (
    PROMPTS,
    assert_greedy_equal_up_to_ties,
    assert_no_kv_leak,
    force_one_row_kernel,
    greedy,
    needs_onednn_bf16,
)
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


def test_compiled_plain_decode_equals_eager(target, plain):
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True, torch_compile_max_bs=4) as e:
        single = [e.generate(p, greedy(24))["output_ids"] for p in PROMPTS[:3]]  # batch 1: compiled
        # batch 3 of unequal lengths: compiled, the decode attention masking the shorter requests' padded keys
        three = [o["output_ids"] for o in e.generate(PROMPTS[:3], greedy(24))]
        batch = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]  # batch 8 > max bs 4: eager steps
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert single == plain[:3] and three == plain[:3] and batch == plain
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


@needs_onednn_bf16
@pytest.mark.parametrize("kernel", ["gemv", "packed"])
def test_compiled_bf16_with_packed_linears(model_factory, monkeypatch, kernel):
    """bf16 on CPU: the oneDNN-packed linears stay packed under torch.compile (this used to fail in inductor's
    lowering) and the compiled engine decodes what the eager one does (up to ties its decode attention, in
    float32, breaks otherwise than SDPA), at batch 3 and at batch 1, whose one-token forwards run their graphs with
    oneDNN off: the plain weights' matrix-vector kernel where the one-row kernel is gemv; where it is the packed
    kernel, no plain weight is kept and the packed op ignores the switch."""
    from contextlib import contextmanager

    from specserve.models import compile as compile_mod

    force_one_row_kernel(monkeypatch, kernel)
    one_row = []
    real = compile_mod.onednn_off

    @contextmanager
    def spy():
        with real():
            one_row.append(torch._C._get_mkldnn_enabled())
            yield

    monkeypatch.setattr(compile_mod, "onednn_off", spy)
    path = model_factory("llama", dtype=torch.bfloat16)
    outs = []
    for compiled in (False, True):
        with Engine(model_path=path, max_total_tokens=2048, enable_torch_compile=compiled) as e:
            packed = [m for m in e.scheduler.runner.model.modules() if isinstance(m, PackedLinear)]
            assert packed and all((m.plain is not None) == (kernel == "gemv") for m in packed)
            params = greedy(16, return_logprob=True, top_logprobs_num=2)
            outs.append(e.generate(PROMPTS[:3], params) + [e.generate(PROMPTS[3], params)])
            graphs = e.get_server_info()["torch_compile_graphs"] if compiled else None
    assert_greedy_equal_up_to_ties([o["output_ids"] for o in outs[1]], outs[0])
    assert graphs > 0
    assert len(one_row) >= 15 and not any(one_row)  # the batch-1 decode steps, oneDNN off inside
    assert torch._C._get_mkldnn_enabled()


def test_grouped_attention_runs_eagerly():
    """A forward attending request by request (a split prompt catch-up) is not compiled: its Python loop over a
    varying number of groups would make a graph per group count. The same forward ungrouped is compiled; one whose
    rows but the last of each request only write their K/V (``out_rows``) runs eagerly too."""
    from types import SimpleNamespace

    from specserve.attention import ForwardMode
    from specserve.models.compile import CompiledForward, CompileStats

    wrapper = CompiledForward(lambda fb: fb, max_bs=8, stats=CompileStats())

    def fb(groups, out_rows=None):
        return SimpleNamespace(mode=ForwardMode.DRAFT_EXTEND, attn=SimpleNamespace(batch_size=2, groups=groups),
                               out_rows=out_rows)

    assert wrapper.use_compiled(fb(None))
    assert not wrapper.use_compiled(fb([(3, None), (5, None)]))
    assert not wrapper.use_compiled(fb(None, torch.tensor([2, 7])))



def test_each_module_keeps_its_own_graphs(fresh_dynamo):
    """Two instances of one model class, compiled: each gets its own graphs and guards (a copy of the forward's code),
    so one instance's guards never meet the other's attributes. Where they shared one cache, dynamo's dict-tag
    guards raised "cannot create weak reference to 'NoneType' object" on the instance whose linears keep no plain
    weight (None where the other holds a tensor), as on the packed one-row kernel."""
    from types import SimpleNamespace

    from torch import nn

    from specserve.attention import ForwardMode
    from specserve.models.compile import CompileStats, compile_forward

    class Lin(nn.Module):
        def __init__(self, keep_plain: bool) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))
            self.plain = self.weight.detach().clone() if keep_plain else None

        def forward(self, x):  # [T, 4] -> [T, 4]
            return x @ (self.weight if self.plain is None else self.plain).T

    class Net(nn.Module):
        def __init__(self, keep_plain: bool) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Lin(keep_plain), Lin(keep_plain)])

        def forward(self, fb, x):  # [T, 4] -> [T, 4]
            for layer in self.layers:
                x = layer(x)
            return x

    fb = SimpleNamespace(mode=ForwardMode.DECODE, input_ids=torch.zeros(2, dtype=torch.long),
                         attn=SimpleNamespace(batch_size=2, groups=None), out_rows=None)
    torch.manual_seed(0)
    stats, nets, x = CompileStats(), [Net(True), Net(False)], torch.randn(2, 4)
    with torch.no_grad():
        want = [n(fb, x) for n in nets]
        for n in nets:
            compile_forward(n, max_bs=8, stats=stats)
        for _ in range(2):
            got = [n(fb, x) for n in nets]
            assert all(torch.allclose(g, w) for g, w in zip(got, want, strict=True))
    assert stats.compiled_calls == 4 and stats.graphs == 2  # one graph each, none rebuilt or shared
    assert nets[0].forward.compiled is not nets[1].forward.compiled

# ---------------------------------------------------------------- warm-up at start-up


def test_graphs_are_built_at_start_up_and_decode_as_eager(target, plain, fresh_dynamo):
    """With --enable-torch-compile the warm-up requests build the graphs of every batch size before the engine
    takes a request (none is built afterwards, at batch 1, 2 or 8), the outputs equal eager decoding's, and the
    warm-up leaves nothing behind: no cached prefix, no counted steps or tokens."""
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True) as e:
        start = e.get_server_info()
        single = e.generate(PROMPTS[0], greedy(24))["output_ids"]
        pair = [o["output_ids"] for o in e.generate(PROMPTS[1:3], greedy(24))]
        batch = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert [single, *pair] == plain[:3] and batch == plain
    assert start["torch_compile_graphs"] >= 2 and start["torch_compile_seconds"] > 0
    assert (start["generated_tokens"], start["num_decode_steps"], start["radix_cached_tokens"]) == (0, 0, 0)
    assert info["torch_compile_graphs"] == start["torch_compile_graphs"], "graphs built after start-up"
    assert info["torch_compile_calls"] > start["torch_compile_calls"]


def test_speculative_warm_up_resets_the_counters(target, self_head, plain):
    """EAGLE under --enable-torch-compile: after the warm-up, greedy outputs equal plain decoding with drafting and
    acceptance happening, and the speculative counters start from zero."""
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True,
                **spec_kwargs("EAGLE", self_head, 3, 2, 5)) as e:
        start = e.get_server_info()
        outs = e.generate(PROMPTS, greedy(24))
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in outs] == plain
    assert_drafting_happened(outs, min_accept_length=1.5)
    assert (start["spec_verify_ct"], start["avg_spec_accept_length"], start["generated_tokens"]) == (0, 0, 0)
    assert info["spec_verify_ct"] > 0


def test_one_graph_serves_every_batch_size(target, plain, fresh_dynamo):
    """The first compiled graph of a batch of several requests is already dynamic in the batch size and the key
    count: a later batch of another size (and other lengths) reuses it instead of compiling the forward again, and
    both decode as eager decoding does."""
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True, skip_server_warmup=True) as e:
        eight = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
        graphs = e.get_server_info()["torch_compile_graphs"]
        three = [o["output_ids"] for o in e.generate(PROMPTS[2:5], greedy(24))]
        info = e.get_server_info()
    assert eight == plain and three == plain[2:5]
    assert graphs > 0
    assert info["torch_compile_graphs"] == graphs, "a new batch size compiled the forward again"


def test_speculative_graphs_of_the_warm_up_serve_larger_batches(target, self_head, plain, fresh_dynamo):
    """EAGLE: the warm-up's batches of 3, 2 and 1 build the target's verify graphs that batches of 8 and 5 then use
    (the target builds none after start-up; the draft head may still meet a rarer catch-up shape), and their
    outputs equal plain decoding with drafting and acceptance happening (every step speculative: the batch
    policy's timing-based plain steps would vary the graphs met)."""
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True,
                disable_speculative_auto_off=True, **spec_kwargs("EAGLE", self_head, 3, 2, 5)) as e:
        stats = e.scheduler.runner.compile_stats
        target_graphs = stats.per_module["DecoderModel"]
        eight = e.generate(PROMPTS, greedy(24))
        five = e.generate(PROMPTS[:5], greedy(24))
    assert [o["output_ids"] for o in eight] == plain and [o["output_ids"] for o in five] == plain[:5]
    assert_drafting_happened(eight, min_accept_length=1.5)
    assert target_graphs > 0
    assert stats.per_module["DecoderModel"] == target_graphs, "a larger batch compiled the target again"


def test_skip_server_warmup_leaves_the_graphs_to_the_first_request(target, fresh_dynamo):
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True, skip_server_warmup=True) as e:
        assert e.get_server_info()["torch_compile_graphs"] == 0
        e.generate(PROMPTS[0], greedy(8))
        assert e.get_server_info()["torch_compile_graphs"] > 0


def test_warm_up_fits_a_short_context(target, fresh_dynamo):
    """A context shorter than the warm-up's requests: they are shortened to fit, and the engine still serves."""
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True, context_length=40) as e:
        assert e.get_server_info()["torch_compile_graphs"] > 0
        out = e.generate(PROMPTS[0], greedy(8))
        assert_no_kv_leak(e)
    assert len(out["output_ids"]) == 8


def test_ngram_trie_forgets_the_warm_up(target, fresh_dynamo):
    """NGRAM under --enable-torch-compile: the warm-up's made-up token streams are not left in the n-gram trie for
    users' requests to be drafted from; the first request then fills it."""
    with Engine(model_path=target, max_total_tokens=4096, enable_torch_compile=True,
                speculative_algorithm="NGRAM", speculative_num_draft_tokens=8) as e:
        cache = e.scheduler.decoder.proposer.cache
        assert e.get_server_info()["torch_compile_graphs"] > 0  # the warm-up ran
        assert e.loop.call(lambda s: cache.num_nodes) == 0
        e.generate(PROMPTS[0], greedy(8))
        assert e.loop.call(lambda s: cache.num_nodes) > 0

"""CUDA graphs (specserve.models.cuda_graph): the bucketing rules on hand-checked inputs, and greedy outputs with
graphs equal to eager ones for plain decode, EAGLE trees (draft levels + tree verify), EAGLE-3 and STANDALONE,
with drafting and acceptance happening.

On a CPU the graph bookkeeping runs under SPECSERVE_CUDA_GRAPH_EMULATE=1 (static buffers, padded batch and key
buckets, outputs copied out; the recorded forward re-run eagerly instead of replayed). The tests marked ``cuda``
capture real graphs; they need a GPU and do not run in CPU-only CI."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.attention.sdpa import kv_bucket
from specserve.models.cuda_graph import (
    EMULATE_ENV,
    CaptureChecker,
    GraphCaptureError,
    batch_bucket,
    graph_backend,
)
from specserve.test.tiny import make_eagle3_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs, staggered

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real graph capture)")


def test_batch_bucket():
    assert [batch_bucket(b, 32) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 32]
    assert batch_bucket(33, 32) is None and batch_bucket(0, 32) is None
    assert batch_bucket(5, 6) == 6  # never above the bound
    assert batch_bucket(12, 12) == 12


def test_kv_bucket():
    # 128, then four sizes per doubling: 160 192 224 256, 320 384 448 512, ...
    assert [kv_bucket(n) for n in (1, 128, 129, 160, 161, 255, 256, 257, 500, 513)] == \
        [128, 128, 160, 160, 192, 256, 256, 320, 512, 640]
    assert all(n <= kv_bucket(n) <= n * 1.25 for n in range(129, 5000))
    assert kv_bucket(9, min_bucket=8, steps=2) == 12  # octave 8, step 4


def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    assert graph_backend(cpu, disabled=False) is None
    monkeypatch.setenv(EMULATE_ENV, "1")
    assert graph_backend(cpu, disabled=False) == "emulate"
    assert graph_backend(cpu, disabled=True) is None
    assert graph_backend(torch.device("cuda"), disabled=False) == "cuda"


@pytest.mark.parametrize("bad", [
    lambda x, i: x.sum().item(),  # a host read
    lambda x, i: x[x > 0],  # boolean-mask indexing: a data-dependent shape
    lambda x, i: torch.nonzero(x),
    lambda x, i: x + torch.tensor([1.0, 2.0, 3.0]),  # Python data -> a host-to-device copy on CUDA
    lambda x, i: i.repeat_interleave(i),  # the output size depends on the values
    lambda x, i: x.masked_fill(x > 0, 0.0)[x > 1],
])
@pytest.mark.parametrize("inference", [False, True])  # the engine's tensors are inference tensors
def test_capture_checker_rejects_what_a_capture_cannot_record(bad, inference):
    with torch.inference_mode(inference):
        x, i = torch.randn(3), torch.tensor([1, 2, 0])
        with pytest.raises(GraphCaptureError), CaptureChecker():
            bad(x, i)


def test_capture_checker_lets_graphable_ops_through():
    x, w, i = torch.randn(4, 3), torch.randn(5, 3), torch.tensor([3, 0])
    buf = torch.zeros(6, 3)
    with CaptureChecker():
        buf[i] = x[:2]  # integer-index scatter, as the KV write
        y = torch.nn.functional.linear(x, w).softmax(-1).index_select(0, i)
        z = i.repeat_interleave(2, output_size=4)  # a static size
    assert y.shape == (2, 5) and torch.equal(buf[3], x[0]) and z.tolist() == [3, 3, 0, 0]


def test_a_failed_capture_falls_back_to_eager_and_serving_goes_on(monkeypatch, llama_dir, eager_random):
    """A forward that cannot be captured (here: a host read slipped into the attention) is logged, its bucket runs
    eagerly from then on, and every output is still right."""
    from specserve.attention import batch as backend

    real_attention = backend.attention

    def reads_the_host(q, k, v, layer_id, fb, scale):
        int(fb.positions.max())  # what a capture cannot record
        return real_attention(q, k, v, layer_id, fb, scale)

    monkeypatch.setenv(EMULATE_ENV, "1")
    monkeypatch.setattr("specserve.models.layers.attention", reads_the_host)
    with Engine(model_path=llama_dir, max_total_tokens=4096) as e:
        outs = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
        info = e.get_server_info()
    assert outs == eager_random
    assert info["cuda_graph_capture_failures"] == 1 and info["cuda_graph_graphs"] == 0  # tried once, not again
    assert info["cuda_graph_eager_calls"] >= 22  # the 23 decode steps after the failed capture ran eagerly


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")


@pytest.fixture(scope="module")
def eager_random(llama_dir):
    """A random 2-layer Llama: its greedy tokens are sensitive to any attention error (unlike the mirror target)."""
    with Engine(model_path=llama_dir, max_total_tokens=4096, disable_cuda_graph=True) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096, disable_cuda_graph=True) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


def _graph_info(e: Engine) -> dict:
    info = e.get_server_info()
    assert info["cuda_graph_graphs"] > 0 and info["cuda_graph_replays"] > 0, info
    assert info["cuda_graph_capture_failures"] == 0, "a graphed forward does what a capture cannot record"
    return info


def test_graphed_plain_decode_equals_eager(emulate, llama_dir, eager_random):
    """Batch 1 (bucket 1), batch 8 (bucket 8, mixed lengths), batch 3 (padded to 4) and batch 8 above a max bs of
    6 (eager): all equal to eager decoding; several key buckets are crossed on the way (prompt + 24 tokens)."""
    with Engine(model_path=llama_dir, max_total_tokens=4096, cuda_graph_max_bs=6) as e:
        single = [e.generate(p, greedy(24))["output_ids"] for p in PROMPTS[:2]]
        three = [o["output_ids"] for o in e.generate(PROMPTS[2:5], greedy(24))]
        eight = [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]
        info = _graph_info(e)
        assert_no_kv_leak(e)
    assert single == eager_random[:2] and three == eager_random[2:5] and eight == eager_random
    # on a GPU host the engine's default device is CUDA, and the emulated tests capture real graphs
    assert info["cuda_graph"] == ("cuda" if torch.cuda.is_available() else "emulate")
    assert info["cuda_graph_max_bs"] == 6
    assert info["cuda_graph_eager_calls"] > 0  # the prefills and the batch-8 steps


def test_graphed_long_context_crosses_key_buckets(emulate, llama_dir):
    """A request growing from 100 to 300 keys runs through the 128, 160, ..., 320 buckets: graphed output equal."""
    params = greedy(200)
    with Engine(model_path=llama_dir, max_total_tokens=4096, disable_cuda_graph=True) as e:
        want = e.generate(PROMPTS[7], params)["output_ids"]
    with Engine(model_path=llama_dir, max_total_tokens=4096) as e:
        got = e.generate(PROMPTS[7], params)["output_ids"]
        graphs = _graph_info(e)["cuda_graph_graphs"]
    assert got == want
    assert graphs >= 5  # decode at 128, 160, 192, 224, 256, (320) keys


def _staggered_equal_plain(target: str, kw: dict, plain) -> tuple[list[dict], list[dict], dict]:
    """3 requests, 5 more joining mid-generation (the batch bucket changes): all equal to plain, no KV leak.
    -> (first outputs, late outputs, server info)."""
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        first, late = staggered(e, PROMPTS[:3], greedy(24), PROMPTS[3:], greedy(24))
        info = _graph_info(e)
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in first + late] == plain
    return first, late, info


def test_graphed_eagle_tree_equals_plain(emulate, target, self_head, plain):
    """EAGLE topk 2: draft levels (DRAFT_DECODE, topk rows per request) and tree verify (TARGET_VERIFY, custom
    masks) graphed."""
    first, late, info = _staggered_equal_plain(target, spec_kwargs("EAGLE", self_head, 3, 2, 5), plain)
    assert_drafting_happened(first + late, min_accept_length=1.5)
    assert info["cuda_graph_graphs"] >= 3  # verify, and draft levels with different key counts


def test_graphed_overlap_scheduler_and_batch_aware_steps(emulate, target, self_head, plain):
    """The overlap scheduler's forward thread replays the graphs; batch-aware speculation switches between full
    chains, shrunk chains (verify forwards of other sizes) and plain steps (graphed decode) as requests join."""
    kw = spec_kwargs("EAGLE", self_head, 3, 1, 4, enable_spec_v2=True, speculative_batch_token_budget=10,
                     speculative_disable_batch_size=4, disable_speculative_auto_off=True)
    first, _, info = _staggered_equal_plain(target, kw, plain)
    assert_drafting_happened(first)
    assert info["spec_overlapped_steps"] > 0 and info["spec_plain_steps"] > 0 and info["spec_shrunk_steps"] > 0


def test_graphed_eagle3_and_standalone_equal_plain(emulate, model_factory, tmp_path):
    """EAGLE-3 (the target captures aux hidden states inside the graph) and STANDALONE (a draft decoder stack)."""
    target = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)
    with Engine(model_path=target, max_total_tokens=4096, disable_cuda_graph=True) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS[:4], greedy(20))]
    head = make_eagle3_head_dir(str(tmp_path / "e3"), target, kind="self")
    for kw in (spec_kwargs("EAGLE3", head, 3, 2, 4), spec_kwargs("STANDALONE", target, 3, 1, 4)):
        with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
            outs = e.generate(PROMPTS[:4], greedy(20))
            _graph_info(e)
            assert_no_kv_leak(e)
        assert [o["output_ids"] for o in outs] == want, kw["speculative_algorithm"]
        assert_drafting_happened(outs, min_accept_length=1.2)


def test_graphs_around_compiled_forwards(emulate, llama_dir, eager_random):
    """--enable-torch-compile with graphs: the graph records the compiled forward (as on CUDA); outputs equal."""
    with Engine(model_path=llama_dir, max_total_tokens=4096, enable_torch_compile=True) as e:
        outs = [o["output_ids"] for o in e.generate(PROMPTS[:2], greedy(24))]
        info = _graph_info(e)
    assert outs == eager_random[:2]
    assert info["torch_compile_graphs"] > 0


@CUDA
def test_cuda_graphs_on_gpu_equal_eager(target, self_head):
    """Real capture and replay on a GPU: plain and EAGLE greedy outputs with graphs equal those without."""
    for kw in ({}, spec_kwargs("EAGLE", self_head, 3, 2, 5)):
        outs = []
        for disable in (True, False):
            with Engine(model_path=target, device="cuda", max_total_tokens=4096, disable_cuda_graph=disable,
                        **kw) as e:
                outs.append([o["output_ids"] for o in e.generate(PROMPTS, greedy(24))])
                if not disable:
                    assert _graph_info(e)["cuda_graph"] == "cuda"
        assert outs[0] == outs[1]

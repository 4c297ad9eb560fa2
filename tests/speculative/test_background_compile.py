"""--torch-compile-in-background: the engine takes requests at once (no warm-up), each kind of forward runs eager
until the compile thread has built its graph from a copy of its first call's inputs, and then runs that graph; the
outputs equal eager decoding's throughout (plain and EAGLE, with drafting and acceptance happening); a compile that
fails leaves its kind eager and the engine serving; the copies never write a request's KV slots."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve import Engine
from specserve.attention import ForwardMode
from specserve.config import ServerArgs
from specserve.models import compile as compile_mod
from specserve.models.compile import BackgroundCompiler, CompileStats, variant_key
from specserve.platform.cpu import policy as cpu_policy
from specserve.platform.cpu.cpus import usable_cpus
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

WAIT_S = 600  # the compile thread's limit in a test: far above a tiny model's graphs (seconds each)
# a fixed thread count: the governor's probes (timing-driven) would add graphs for another count at any pass
PINNED = {"num_threads": usable_cpus()}
PASSES = 6  # passes over the prompts at most before every call meets a built graph


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))]


@pytest.fixture
def handed_over(monkeypatch):
    """The inputs of every call the engine hands to its compile thread (their copies)."""
    seen = []
    real = compile_mod.detached_inputs

    def spy(fb, args, kwargs):
        seen.append(real(fb, args, kwargs))
        return seen[-1]

    monkeypatch.setattr(compile_mod, "detached_inputs", spy)
    return seen


def _outputs(engine, prompts, batched: bool) -> list[list[int]]:
    if batched:
        return [o["output_ids"] for o in engine.generate(prompts, greedy(24))]
    return [engine.generate(p, greedy(24))["output_ids"] for p in prompts]


def _until_built(engine, run_pass) -> tuple[list, list[dict]]:
    """run_pass() over and over, waiting for the compile thread after each, until a pass builds no new graph (its
    calls all met built graphs; at most PASSES). -> (each pass's result, the server info after each pass)."""
    passes, infos = [], []
    for _ in range(PASSES):  # the first pass meets no graph; each later one the graphs the ones before asked for
        passes.append(run_pass())
        assert engine.scheduler.runner.background_compiler.wait(WAIT_S), "the compile thread did not finish"
        infos.append(engine.get_server_info())
        if len(infos) > 1 and infos[-1]["torch_compile_graphs"] == infos[-2]["torch_compile_graphs"]:
            break
    return passes, infos


def test_serves_at_once_then_runs_the_built_graphs(target, plain, fresh_dynamo, handed_over):
    with Engine(model_path=target, max_total_tokens=4096, torch_compile_in_background=True,
                disable_torch_compile_warmer=True, **PINNED) as e:
        start = e.get_server_info()
        passes, infos = _until_built(e, lambda: _outputs(e, PROMPTS[:2], batched=False)
                                     + _outputs(e, PROMPTS, batched=True))
        assert_no_kv_leak(e)
    assert start["torch_compile_graphs"] == 0 and start["generated_tokens"] == 0  # no warm-up requests
    assert passes == [plain[:2] + plain] * len(passes)
    built, last = infos[-2], infos[-1]
    assert built["torch_compile_kinds_built"] >= 2 and built["torch_compile_kinds_failed"] == 0  # batch 1 and more
    assert built["torch_compile_graphs"] >= built["torch_compile_kinds_built"]
    assert infos[0]["torch_compile_eager_calls"] > 0  # the calls before their graph was ready
    # the last pass ran the built graphs only: no eager call, no new graph
    assert last["torch_compile_calls"] > built["torch_compile_calls"]
    assert (last["torch_compile_eager_calls"], last["torch_compile_graphs"]) == (
        built["torch_compile_eager_calls"], built["torch_compile_graphs"])
    # the copies handed over: one per graph built, every K/V write aimed at the padding slot 0
    assert len(handed_over) == last["torch_compile_graphs"]
    for fb, _, _ in handed_over:
        assert fb.out_cache_loc.numel() > 0 and not fb.out_cache_loc.any()


def test_eagle_outputs_equal_plain_before_and_after_the_graphs(target, self_head, plain, fresh_dynamo):
    kw = spec_kwargs("EAGLE", self_head, 3, 2, 5)
    with Engine(model_path=target, max_total_tokens=4096, torch_compile_in_background=True,
                disable_torch_compile_warmer=True, **PINNED, disable_speculative_auto_off=True, **kw) as e:
        passes, infos = _until_built(e, lambda: e.generate(PROMPTS, greedy(24)))
        stats = e.scheduler.runner.compile_stats
        assert_no_kv_leak(e)
    for outs in passes:
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs, min_accept_length=1.5)
    built, last = infos[-2], infos[-1]
    assert last["torch_compile_graphs"] == built["torch_compile_graphs"], f"still building after {PASSES} passes"
    assert last["torch_compile_kinds_failed"] == 0
    assert stats.per_module["DecoderModel"] >= 1 and len(stats.per_module) >= 2  # the target's and the head's
    # the last pass ran built graphs only: no eager call
    assert last["torch_compile_calls"] > built["torch_compile_calls"]
    assert last["torch_compile_eager_calls"] == built["torch_compile_eager_calls"]


def test_graphs_for_each_thread_count_the_governor_picks(target, plain, fresh_dynamo, monkeypatch):
    """Without --num-threads the thread count follows contention under background compiling too: the engine builds
    each kind's graph at each count it runs with (dynamo guards on the count), and at either count the calls run
    compiled with outputs equal to eager decoding's."""
    monkeypatch.setattr(cpu_policy, "usable_cpus", lambda: 2)  # the governor's counts: 2 and 1
    with Engine(model_path=target, max_total_tokens=4096, torch_compile_in_background=True,
                disable_torch_compile_warmer=True) as e:
        assert e.scheduler.runner.background_compiler.counts == {2, 1}
        assert e.get_server_info()["cpu_threads_adaptive"]
        runs = {}
        for threads in (2, 1):  # each count in turn, held (the governor's probes would make the test a race)
            e.loop.call(lambda s, n=threads: s.runner.platform.fix_threads(n))
            runs[threads] = _until_built(e, lambda: _outputs(e, PROMPTS[:3], batched=True)
                                         + _outputs(e, PROMPTS[3:4], batched=False))
    for passes, _ in runs.values():
        assert passes == [plain[:4]] * len(passes)
    for threads, (_, infos) in runs.items():
        built, last = infos[-2], infos[-1]
        assert last["torch_compile_graphs"] == built["torch_compile_graphs"], f"still building at {threads}"
        assert last["torch_compile_calls"] > built["torch_compile_calls"]  # ran built graphs at this count
        assert last["torch_compile_eager_calls"] == built["torch_compile_eager_calls"]
    kinds = runs[1][1][-1]["torch_compile_kinds_by_threads"]
    assert set(kinds) == {2, 1} and kinds[1] >= 2  # batch 1 and more, at one thread too


def test_a_failed_compile_leaves_its_kind_eager(target, plain, fresh_dynamo, monkeypatch):
    def broken(fn, **_):
        def run(*args, **kwargs):
            raise RuntimeError("inductor failed")
        return run

    monkeypatch.setattr(compile_mod.torch, "compile", broken)
    with Engine(model_path=target, max_total_tokens=4096, torch_compile_in_background=True,
                disable_torch_compile_warmer=True, **PINNED) as e:
        first = _outputs(e, PROMPTS[:3], batched=True)
        assert e.scheduler.runner.background_compiler.wait(WAIT_S)
        second = _outputs(e, PROMPTS[:3], batched=True)
        info = e.get_server_info()
    assert first == plain[:3] and second == plain[:3]
    assert info["torch_compile_kinds_failed"] >= 1 and info["torch_compile_kinds_built"] == 0
    assert info["torch_compile_calls"] == 0 and info["torch_compile_eager_calls"] > 0


def _fb(mode, batch: int, tokens: int, mask: bool = False):
    attn = SimpleNamespace(batch_size=batch, kv_slots=torch.zeros(batch, 7, dtype=torch.long),
                           mask=torch.ones(batch, 1, tokens // batch, 7, dtype=torch.bool) if mask else None,
                           q_index=None, out_index=None, is_causal=False, one_query=tokens == batch, groups=None)
    return SimpleNamespace(mode=mode, attn=attn, input_ids=torch.zeros(tokens, dtype=torch.long),
                           logits_indices=None, input_embeds=None, capture_layers=(), out_rows=None)


def test_variant_key_tells_graphs_apart():
    decode = ForwardMode.DECODE
    assert variant_key(_fb(decode, 2, 2), ()) == variant_key(_fb(decode, 5, 5), ())  # one graph for batch >= 2
    assert variant_key(_fb(decode, 1, 1), ()) != variant_key(_fb(decode, 2, 2), ())  # batch 1 is specialized
    assert variant_key(_fb(decode, 2, 2), ()) != variant_key(_fb(decode, 2, 2, mask=True), ())
    assert variant_key(_fb(decode, 2, 8), ()) != variant_key(_fb(ForwardMode.TARGET_VERIFY, 2, 8), ())
    hidden = (torch.zeros(2, 4),)
    assert variant_key(_fb(decode, 2, 2), hidden) != variant_key(_fb(decode, 2, 2), ())


def test_the_scheduler_gives_the_compile_a_core():
    """While a graph is being built the scheduler's forwards run on one OpenMP thread fewer than the platform's
    count; all of them after."""
    was = torch.get_num_threads()
    bc = BackgroundCompiler(CompileStats(), target=lambda: 2, counts=(2,))
    try:
        bc.stats.kinds_pending = 1
        assert bc.fit_threads() == 1 and torch.get_num_threads() == 1
        bc.stats.kinds_pending = 0
        assert bc.fit_threads() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(was)


def test_kinds_are_built_only_at_the_platforms_counts(monkeypatch):
    """No graph is built for a thread count the platform never runs at (one fewer while a build runs, under a fixed
    count): such a call asks for the platform's count instead. At one of its counts a kind is handed over once per
    kind and count."""
    monkeypatch.setattr(compile_mod, "detached_inputs", lambda fb, args, kwargs: (fb, args, kwargs))
    fb, key = _fb(ForwardMode.DECODE, 2, 2), variant_key(_fb(ForwardMode.DECODE, 2, 2), ())
    fixed = BackgroundCompiler(CompileStats(), target=lambda: 2, counts=(2,))
    assert fixed.claim((1,) + key, fb, (), {}) is None
    assert fixed.build_count(1) == 2  # a call one thread short asks for the fixed count's graph
    adaptive = BackgroundCompiler(CompileStats(), target=lambda: 2, counts=(2, 1))
    assert adaptive.claim((1,) + key, fb, (), {}) is not None
    assert adaptive.claim((1,) + key, fb, (), {}) is None  # being built
    assert adaptive.claim((2,) + key, fb, (), {}) is not None
    assert adaptive.build_count(1) == 1
    adaptive.build_at_target = True  # the cache-filling child: graphs for the count it warms, not the yielded one
    assert adaptive.build_count(1) == 2


def test_the_flag_turns_torch_compile_on():
    args = ServerArgs(model_path="demo", torch_compile_in_background=True)
    args.validate()
    assert args.enable_torch_compile


def test_copies_keep_strides():
    """The compile thread's copies keep each tensor's sizes and strides (dynamo guards on them): a view into a
    longer table's rows, and an expanded tensor whose elements share memory."""
    from specserve.models.compile import _strided_copy

    table = torch.arange(40).view(4, 10)
    for t in (table[1:3, :6], torch.tensor([[1, 2, 3]]).expand(5, 3), torch.arange(6)):
        c = _strided_copy(t)
        assert (c.size(), c.stride()) == (t.size(), t.stride()) and torch.equal(c, t)
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()

"""specserve.platform: which policy a device gets, what the plain one declines, and that every forward of an engine
(target prefill, decode and verify, draft extends and tree levels) attends under its runner's one policy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve import Engine
from specserve.config import ServerArgs
from specserve.platform import CpuPolicy, PlatformPolicy, platform_policy
from specserve.platform.cpu.packing import PackedLinear
from specserve.test.tiny import make_eagle_head_dir
from tests.engine.helpers import PROMPTS, greedy, needs_onednn_bf16

F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("device,kind", [("cpu", CpuPolicy), ("cuda", PlatformPolicy), ("meta", PlatformPolicy)])
def test_platform_policy_per_device(device, kind):
    policy = platform_policy(ServerArgs(), torch.device(device))
    assert type(policy) is kind and policy.device == torch.device(device)


def test_the_plain_policy_declines_every_cpu_tweak():
    policy = platform_policy(ServerArgs(), torch.device("cuda"))
    model = nn.Sequential(nn.Linear(8, 8).to(BF16))
    assert policy.pack_weights(model) == 0 and type(model[0]) is nn.Linear and not policy.packs_weights
    assert policy.tune_allocator() is False
    assert policy.draft_dtype(BF16, 1000) == BF16
    assert not policy.mixed_linears(F32, BF16) and policy.mix_linears(model) == 0
    assert policy.draft_kv_dtype(F32, BF16) == F32 and not policy.runs_half_precision(10**6)
    assert not policy.folds_query_heads(torch.zeros(8, 4, 4, 2, dtype=BF16), 2, masked=True)


@pytest.mark.parametrize("disable", [pytest.param(False, marks=needs_onednn_bf16), True])
def test_cpu_policy_packs_unless_disabled(disable):
    policy = platform_policy(ServerArgs(disable_cpu_weight_packing=disable), torch.device("cpu"))
    model = nn.Sequential(nn.Linear(8, 8).to(BF16), nn.Linear(8, 8))  # bf16 packs, float32 does not
    assert policy.packs_weights is not disable
    assert policy.pack_weights(model) == (0 if disable else 1)
    assert isinstance(model[0], nn.Linear if disable else PackedLinear) and type(model[1]) is nn.Linear


def test_cpu_policy_sets_the_thread_count(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("specserve.platform.cpu.policy.usable_cpus", lambda: 2)
    try:
        platform_policy(ServerArgs(num_threads=1), torch.device("cpu")).configure_threads()
        assert torch.get_num_threads() == 1
        platform_policy(ServerArgs(), torch.device("cpu")).configure_threads()  # no --num-threads: the usable CPUs
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_every_forward_attends_under_the_runners_policy(model_factory, tmp_path, monkeypatch):
    from specserve.attention import sdpa as backend

    path = model_factory("llama", num_hidden_layers=1, unit_embeddings=True, dtype=BF16)
    head = make_eagle_head_dir(str(tmp_path / "head"), path, kind="self")
    seen, attend = [], backend._attend
    monkeypatch.setattr(backend, "_attend", lambda *a: seen.append(a[5]) or attend(*a))
    with Engine(model_path=path, max_total_tokens=4096, speculative_algorithm="EAGLE",
                speculative_draft_model_path=head, speculative_num_steps=3, speculative_eagle_topk=2,
                speculative_num_draft_tokens=4) as e:
        platform = e.scheduler.runner.platform
        assert isinstance(platform, CpuPolicy) and e.scheduler.decoder.proposer.platform is platform
        e.generate(PROMPTS, greedy(8))
    assert seen and all(p is platform for p in seen)


def test_the_loop_times_decode_steps_and_the_server_info_shows_the_threads(model_factory):
    path = model_factory("llama", num_hidden_layers=1)
    with Engine(model_path=path, max_total_tokens=4096) as e:
        governor = e.scheduler.runner.platform.governor
        e.generate(PROMPTS[0], greedy(12))  # one prefill step, 11 decode steps
        info = e.get_server_info()
    assert governor.busy_s > 0 and sum(len(s) for s in governor.samples.values()) + len(governor.last) > 0
    assert info["cpu_threads_adaptive"] is True and info["cpu_threads"] in governor.levels
    assert {"cpu_threads_max", "cpu_thread_switches", "cpu_thread_probes"} <= info.keys()
    with Engine(model_path=path, max_total_tokens=4096, num_threads=1) as e:
        info = e.get_server_info()
    assert e.scheduler.runner.platform.governor is None
    assert info["cpu_threads_adaptive"] is False and info["cpu_threads"] == 1

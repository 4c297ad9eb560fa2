"""--torch-compile-in-background on CPU with a cold cache: a niced child process fills torch.compile's cache first
(``models/compile_warm.py``). Meanwhile the engine serves eager and builds nothing; then it builds its graphs from
the cache (inductor's FX-graph cache hits, no misses); a later engine with the same settings finds the child's marker
and starts no child; a failed child leaves the engine building in its own process; shutting down stops the child."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from specserve import Engine
from specserve.config import ServerArgs
from specserve.models import compile_warm
from specserve.models.compile import BackgroundCompiler, CompileStats
from tests.engine.helpers import PROMPTS, greedy

WAIT_S = 600
PASSES = 6


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return _outputs(e)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty inductor cache of this test's own (the child inherits the variable)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor"


def _engine(target: str) -> Engine:
    return Engine(model_path=target, max_total_tokens=4096, torch_compile_in_background=True)


def _outputs(engine: Engine) -> list[list[int]]:
    """Three prompts at once, then one alone (decode at batch 3 and at batch 1)."""
    return [o["output_ids"] for o in engine.generate(PROMPTS[:3], greedy(16))] + [
        engine.generate(PROMPTS[3], greedy(16))["output_ids"]]


def _built_from_cache(engine: Engine, plain) -> dict:
    """Passes over the prompts until one builds no new graph; each equals eager decoding. -> the last server info."""
    compiler = engine.scheduler.runner.background_compiler
    infos = []
    for _ in range(PASSES):
        assert _outputs(engine) == plain
        assert compiler.wait(WAIT_S), "the compile thread did not finish"
        infos.append(engine.get_server_info())
        if len(infos) > 1 and infos[-1]["torch_compile_graphs"] == infos[-2]["torch_compile_graphs"]:
            break
    return infos[-1]


def test_a_child_fills_the_cache_then_the_engine_builds_from_it(target, plain, cache_dir, fresh_dynamo):
    with _engine(target) as e:
        warmer = e.scheduler.runner.background_compiler.warmer
        assert warmer is not None and warmer.proc.poll() is None
        assert e.get_server_info()["torch_compile_warming_cache"]
        assert _outputs(e) == plain  # served at once, eager
        graphs = e.get_server_info()["torch_compile_graphs"]
        if not warmer.done.is_set():  # read after the graph count: builds only start once the child is done
            assert graphs == 0
        assert warmer.done.wait(WAIT_S) and warmer.ok, open(warmer.log_path).read()
        assert os.path.exists(warmer.marker) and str(cache_dir) in warmer.marker
        hits = counters["inductor"]["fxgraph_cache_hit"]
        misses = counters["inductor"]["fxgraph_cache_miss"]
        info = _built_from_cache(e, plain)
    assert not info["torch_compile_warming_cache"]
    assert info["torch_compile_kinds_built"] >= 2 and info["torch_compile_kinds_failed"] == 0  # batch 1 and more
    # every graph came out of the child's cache entries
    assert counters["inductor"]["fxgraph_cache_hit"] - hits >= info["torch_compile_graphs"] > 0
    assert counters["inductor"]["fxgraph_cache_miss"] == misses
    with _engine(target) as e:  # the same settings again: the marker says the cache is warm
        assert e.scheduler.runner.background_compiler.warmer is None
        assert not e.get_server_info()["torch_compile_warming_cache"]


def test_a_failed_child_leaves_the_building_to_the_engine(target, plain, cache_dir, fresh_dynamo, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", "/bin/false")  # the child's interpreter: exits 1 at once
        e = _engine(target)
    with e:
        warmer = e.scheduler.runner.background_compiler.warmer
        assert warmer.done.wait(60) and not warmer.ok
        info = _built_from_cache(e, plain)
    assert info["torch_compile_kinds_built"] >= 2 and not os.path.exists(warmer.marker)


def test_shutting_down_stops_the_child(target, cache_dir):
    e = _engine(target)
    proc = e.scheduler.runner.background_compiler.warmer.proc
    e.shutdown()
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is not None


def test_the_marker_key_follows_the_settings_that_shape_graphs():
    base = {"model_path": "m", "dtype": "bfloat16", "num_threads": 2, "port": 30000, "host": "127.0.0.1"}
    key = compile_warm.warm_key(base)
    assert compile_warm.warm_key({**base, "port": 8000, "host": "0.0.0.0"}) == key  # where it listens: no matter
    assert compile_warm.warm_key({**base, "num_threads": 1}) != key  # dynamo guards on the thread count
    assert compile_warm.warm_key({**base, "dtype": "float32"}) != key


def test_the_child_gets_no_api_key():
    args = ServerArgs(model_path="m", api_key="secret", admin_api_key="admin-secret", dp_size=2)
    settings = compile_warm.child_settings(args, 4096)
    assert "secret" not in str(settings)
    assert settings["dp_size"] == 1 and settings["max_total_tokens"] == 4096
    assert settings["torch_compile_in_background"] and settings["disable_torch_compile_warmer"]


def test_the_scheduler_leaves_the_child_a_core():
    """While the child fills the cache the scheduler's forwards run on one OpenMP thread fewer, and the compile
    thread builds nothing; all threads once the child is done."""
    was = torch.get_num_threads()
    bc = BackgroundCompiler(CompileStats(), target=lambda: 2, counts=(2,))
    bc.warmer = SimpleNamespace(done=threading.Event(), close=lambda: None)
    try:
        assert bc.warming() and bc.idle()
        bc.fit_threads()
        assert torch.get_num_threads() == 1
        bc.warmer.done.set()
        bc.fit_threads()
        assert torch.get_num_threads() == 2 and not bc.warming()
    finally:
        torch.set_num_threads(was)

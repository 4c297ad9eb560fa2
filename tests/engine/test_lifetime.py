"""An engine's scheduler, KV pools and drafter are freed as soon as the engine is dropped, without waiting for a
full garbage collection: nothing inside forms a reference cycle that would keep gigabytes of KV pool alive (a
server process or a test session creating engines one after another would otherwise grow until it is killed)."""

from __future__ import annotations

import gc
import weakref

import pytest

from specserve import Engine
from specserve.test.tiny import make_eagle_head_dir
from tests.engine.helpers import greedy


@pytest.fixture()
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _dropped(engine_kwargs: dict) -> list[weakref.ref]:
    """Run an engine, shut it down, drop it -> weak references to its scheduler, KV pool and decoder."""
    e = Engine(**engine_kwargs)
    e.generate(["a b c a b c a b", "x y x y x"], greedy(12))
    sched = e.scheduler
    refs = [weakref.ref(sched), weakref.ref(sched.runner.kv_pool), weakref.ref(sched.decoder)]
    e.shutdown()
    del e, sched
    return refs


@pytest.mark.parametrize("mode", ["plain", "NGRAM", "EAGLE-overlap"])
def test_a_dropped_engine_is_freed_at_once(no_gc, model_factory, tmp_path, mode):
    target = model_factory("llama", num_hidden_layers=1, unit_embeddings=True)
    kw = {"model_path": target, "max_total_tokens": 2048}
    if mode == "NGRAM":
        kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    elif mode == "EAGLE-overlap":
        head = make_eagle_head_dir(str(tmp_path / "head"), target, kind="self")
        kw.update(speculative_algorithm="EAGLE", speculative_draft_model_path=head, speculative_num_steps=3,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=4, enable_spec_v2=True)
    refs = _dropped(kw)
    assert [r() is None for r in refs] == [True, True, True]

"""A speculative algorithm added from outside the package (``tests/speculative/toy_proposer.py``): it is selected by
name, its flag rule runs at start-up, and its drafts go through the same lossless verification as every built-in."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.config import ConfigError, ServerArgs
from specserve.speculative import registry
from tests.engine.helpers import assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened
from tests.speculative.toy_proposer import LookupProposer, continuation

PROMPTS = ["a b c d e f a b c d e f a b c", "x = 1\ny = 2\nx = 1\ny = 2\nx =", "def f(x):\n    return x\ndef f("]


@pytest.fixture()
def lookup(monkeypatch):
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))  # undone after the test
    registry.register_algorithm("LOOKUP", LookupProposer)


def test_continuation_is_a_one_gram_lookup():
    assert continuation([5, 1, 2, 3, 9, 1], 2) == [2, 3]
    assert continuation([5, 1, 2, 3, 1, 4, 1], 5) == [4, 1]  # the LAST earlier occurrence
    assert continuation([7, 8, 9], 3) == []


def test_registered_name_is_a_valid_algorithm_and_its_rule_runs(lookup):
    args = ServerArgs(model_path="m", speculative_algorithm="lookup").validate()
    assert args.speculative_algorithm == "LOOKUP" and args.speculative_num_draft_tokens == 4
    with pytest.raises(ConfigError, match="^--speculative-algorithm must be one of .*LOOKUP"):
        ServerArgs(model_path="m", speculative_algorithm="NOPE").validate()


def test_non_proposer_is_refused():
    with pytest.raises(TypeError, match="not a Proposer subclass"):
        registry.register_algorithm("BAD", object)


def test_entry_point_plugins_are_found(monkeypatch):
    class FakeEntryPoint:
        name = "lookup2"

        @staticmethod
        def load():
            return LookupProposer

    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    monkeypatch.setattr(registry, "entry_points", lambda group: [FakeEntryPoint] if group == registry.ENTRY_POINT_GROUP
                        else [])
    assert "LOOKUP2" in registry.algorithm_names()
    assert registry.algorithm_class("LOOKUP2") is LookupProposer


def test_greedy_output_equals_plain_decoding(target, lookup):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        plain = [o["output_ids"] for o in e.generate(PROMPTS, greedy(40))]
    with Engine(model_path=target, max_total_tokens=4096, speculative_algorithm="LOOKUP",
                speculative_num_draft_tokens=5, disable_speculative_auto_off=True) as e:
        outs = e.generate(PROMPTS, greedy(40))
        assert [o["output_ids"] for o in outs] == plain
        assert_drafting_happened(outs)
        assert_no_kv_leak(e)

"""A one-layer draft network's catch-up extend writes K/V for every row but runs the rest of its layer (attention,
o_proj, MLP) for each request's last row alone (``ForwardBatch.out_rows``): the same drafting state, the same drafts
and the same greedy output as running every row; a deeper draft network runs every row."""

from __future__ import annotations

import pytest
import torch

import specserve.speculative.eagle as eagle
from specserve import Engine
from specserve.attention import extend_batch
from specserve.test.tiny import make_eagle3_head_dir, make_eagle_head_dir, make_mimo_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import assert_drafting_happened, spec_kwargs

ALL_ROWS, LAST_ROWS = False, True  # last_rows_only for every extend
STORE_STATES = eagle.EagleProposer._store_states


@pytest.fixture(scope="module")
def setups(target, model_factory, tmp_path_factory, tokenizer_dir):
    """name -> (target, draft head or None, the target's greedy output of PROMPTS): an EAGLE-2 head with random
    weights on the shared mirror target; an EAGLE-3 head mirroring a bigram target (its random heads are never
    accepted); a MiMo target's own MTP layer (EAGLE without a draft path)."""
    d = tmp_path_factory.mktemp("catch_up")
    bigram = model_factory("llama", num_hidden_layers=4, unit_embeddings=True, identity_layers=True)
    setups = {"EAGLE": (target, make_eagle_head_dir(str(d / "eagle"), target, kind="random", seed=3)),
              "EAGLE3": (bigram, make_eagle3_head_dir(str(d / "eagle3"), bigram, kind="self")),
              "MTP": (make_mimo_dir(str(d / "mimo"), kind="self", tokenizer_dir=tokenizer_dir,
                                    max_position_embeddings=1024), None)}
    out = {}
    for algorithm, (path, head) in setups.items():
        with Engine(model_path=path, max_total_tokens=4096) as e:
            out[algorithm] = (path, head, [o["output_ids"] for o in e.generate(PROMPTS, greedy(16))])
    return out


def _record_last_only(monkeypatch) -> list[bool]:
    """-> the list each draft extend's last_only flag is appended to, from now on."""
    flags = []

    def recording_extend(*args, **kwargs):
        flags.append(args[8] if len(args) > 8 else kwargs.get("last_only", False))
        return extend_batch(*args, **kwargs)

    monkeypatch.setattr(eagle, "extend_batch", recording_extend)
    return flags


def _run(target, head, name, last_only, monkeypatch):
    """Greedy PROMPTS with every catch-up's last_rows_only = last_only -> (outputs, the drafting states each catch-up
    stored (their hidden [h] and top-k ids, in call order), the last_only flag of each draft extend)."""
    monkeypatch.setattr(eagle, "last_rows_only", lambda q_lens: last_only)
    states = []

    def recording_store(self, reqs, last_hidden):
        STORE_STATES(self, reqs, last_hidden)
        states.extend((r.spec_state.hidden.clone(), r.spec_state.topk_ids.tolist()) for r in reqs)

    monkeypatch.setattr(eagle.EagleProposer, "_store_states", recording_store)
    flags = _record_last_only(monkeypatch)
    algorithm = "EAGLE" if name == "MTP" else name
    with Engine(model_path=target, max_total_tokens=4096, **spec_kwargs(algorithm, head, 3, 2, 6)) as e:
        outs = e.generate(PROMPTS, greedy(16))
        assert_no_kv_leak(e)
    return outs, states, flags


@pytest.mark.parametrize("name", ["EAGLE", "EAGLE3", "MTP"])
def test_last_rows_only_catch_up_drafts_as_every_row_does(setups, name, monkeypatch):
    target, head, plain = setups[name]
    every, every_states, every_flags = _run(target, head, name, ALL_ROWS, monkeypatch)
    last, last_states, last_flags = _run(target, head, name, LAST_ROWS, monkeypatch)
    assert not any(every_flags) and last_flags and all(last_flags)  # each run took the path it was meant to
    assert [o["output_ids"] for o in every] == plain == [o["output_ids"] for o in last]
    assert_drafting_happened(last, min_accept_length=1.0)
    # the same states after every catch-up (float32: the last rows' attention through a decode's metadata rounds
    # apart from the extend's only in the last bits), hence the same drafts and the same verify steps
    assert len(every_states) == len(last_states)
    for (h_every, ids_every), (h_last, ids_last) in zip(every_states, last_states, strict=True):
        torch.testing.assert_close(h_last, h_every, rtol=1e-4, atol=1e-5)
        assert ids_last == ids_every
    assert [o["meta_info"]["spec_accept_histogram"] for o in last] == \
        [o["meta_info"]["spec_accept_histogram"] for o in every]


def test_a_deeper_draft_network_runs_every_row(target, tmp_path, monkeypatch):
    """STANDALONE drafts with a whole LM: its later layers need every row's output for their K/V."""
    monkeypatch.setattr(eagle, "last_rows_only", lambda q_lens: True)
    flags = _record_last_only(monkeypatch)
    with Engine(model_path=target, max_total_tokens=4096,
                **spec_kwargs("STANDALONE", target, 3, 1, 4)) as e:
        outs = e.generate(PROMPTS[:2], greedy(8))
    assert flags and not any(flags)
    assert all(o["output_ids"] for o in outs)


def test_which_catch_ups_run_their_last_rows_only():
    """From KV_ONLY_MIN_ROWS rows, or with unequal rows per request (which the fused CPU layer never takes); a few
    rows each, alike, run every row."""
    n = eagle.KV_ONLY_MIN_ROWS
    assert eagle.last_rows_only([n]) and eagle.last_rows_only([n - 8, 8])
    assert eagle.last_rows_only([3, 4]) and eagle.last_rows_only([1, 1, 2])
    assert not eagle.last_rows_only([5]) and not eagle.last_rows_only([3, 3, 3])
    assert not eagle.last_rows_only([n // 2 - 1, n // 2 - 1])

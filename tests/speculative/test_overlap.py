"""The overlap scheduler (Spec V2): a step's output processing runs beside the next step's forward part, and
every output equals plain decoding's: across requests joining and leaving, batch-aware plain and shrunk steps,
finishes inside accepted runs (stop strings are found one step late and trimmed back), logprobs, seeded sampling,
chunked prefill, radix reuse, retraction and abort. Plus its switches and the topk-1-only start-up error."""

from __future__ import annotations

import threading

import pytest

from specserve import Engine
from specserve.config import ConfigError, ServerArgs
from specserve.test.tiny import make_eagle3_head_dir
from tests.engine.helpers import PROMPTS, assert_no_kv_leak, greedy
from tests.speculative.helpers import (
    assert_chunked_radix_and_retraction_lossless,
    assert_drafting_happened,
    assert_same_outputs,
    plain_finish_case,
    spec_kwargs,
    staggered,
)

LENGTHS = [8, 20, 32, 44, 56, 68]
LATE = [PROMPTS[6], PROMPTS[7]]
# the (3, 1, 4) chain with budget 10: batch 1-2 full chain, 3 a chain of 3, 4 a chain of 2, 5+ plain steps
POLICY = dict(speculative_batch_token_budget=10, speculative_disable_batch_size=4, disable_speculative_auto_off=True)


def v2(algorithm: str, draft: str | None, **extra) -> dict:
    return spec_kwargs(algorithm, draft, 3, 1, 4, enable_spec_v2=True, **extra)


# ------------------------------------------------------------------ switches
@pytest.mark.parametrize("env", ["SPECSERVE_ENABLE_SPEC_V2", "SGLANG_ENABLE_SPEC_V2"])
def test_environment_switches_it_on_and_topk_above_one_fails_at_start_up(monkeypatch, target, self_head, env):
    monkeypatch.setenv(env, "True")
    assert ServerArgs(model_path=target, **spec_kwargs("EAGLE", self_head, 3, 1, 4)).validate().enable_spec_v2
    with pytest.raises(ConfigError, match=r"^--speculative-eagle-topk 4: the overlap scheduler .* topk 1 only"):
        ServerArgs(model_path=target, **spec_kwargs("EAGLE", self_head, 3, 4, 8)).validate()
    with pytest.raises(ConfigError, match="--speculative-eagle-topk 2"):
        Engine(model_path=target, **spec_kwargs("EAGLE", self_head, 3, 2, 5))
    monkeypatch.setenv(env, "0")
    assert not ServerArgs(model_path=target, **spec_kwargs("EAGLE", self_head, 3, 4, 8)).validate().enable_spec_v2


def test_default_tree_is_a_chain_with_the_overlap_scheduler(target, self_head):
    args = ServerArgs(model_path=target, speculative_algorithm="EAGLE", speculative_draft_model_path=self_head,
                      enable_spec_v2=True).validate()
    args.resolve_speculative_defaults("LlamaForCausalLM")  # (5, 4, 8) without the overlap scheduler
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)


# ------------------------------------------------------------------ lossless
@pytest.fixture(scope="module")
def drafts(target, self_head, tmp_path_factory):
    return {"EAGLE": self_head, "STANDALONE": target, "NGRAM": None,
            "EAGLE3": make_eagle3_head_dir(str(tmp_path_factory.mktemp("d") / "eagle3"), target, kind="random")}


@pytest.fixture(scope="module")
def plain(target):
    with Engine(model_path=target, max_total_tokens=4096) as e:
        return ([o["output_ids"] for o in e.generate(PROMPTS[:6], [greedy(n) for n in LENGTHS])],
                [o["output_ids"] for o in e.generate(LATE, greedy(24))],
                [o["output_ids"] for o in e.generate(PROMPTS, greedy(24))])


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
def test_greedy_equals_plain_across_joins_leaves_and_batch_aware_steps(target, drafts, plain, algorithm):
    with Engine(model_path=target, max_total_tokens=4096, **v2(algorithm, drafts[algorithm], **POLICY)) as e:
        first, late = staggered(e, PROMPTS[:6], [greedy(n) for n in LENGTHS], LATE, greedy(24))
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in first] == plain[0]
    assert [o["output_ids"] for o in late] == plain[1]
    assert info["spec_overlap"] and info["spec_overlapped_steps"] > 0  # output processing ran beside a forward
    assert info["spec_verify_ct"] > 0 and info["spec_plain_steps"] > 0 and info["spec_shrunk_steps"] > 0
    assert [o["meta_info"]["completion_tokens"] for o in first] == LENGTHS
    if algorithm in ("EAGLE", "STANDALONE"):  # drafts that mirror the target: accepted
        assert info["avg_spec_accept_length"] > 1.5
    # where SGLang's tests read it
    assert info["internal_states"][0]["avg_spec_accept_length"] == info["avg_spec_accept_length"]


def test_draft_stop_threshold_shortens_chains_and_keeps_outputs(target, self_head, plain):
    """A stop threshold cuts chains short (fewer verify nodes than N); the overlapped steps stay exact."""
    kw = v2("EAGLE", self_head, speculative_draft_stop_threshold=0.5)
    with Engine(model_path=target, max_total_tokens=4096, **kw) as e:
        first, late = staggered(e, PROMPTS[:6], [greedy(n) for n in LENGTHS], LATE, greedy(24))
        prop, info = e.loop.scheduler.decoder.proposer, e.get_server_info()
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in first] == plain[0]
    assert [o["output_ids"] for o in late] == plain[1]
    assert info["spec_overlapped_steps"] > 0 and info["spec_verify_ct"] > 0
    assert prop.draft_trees > 0 and prop.draft_forwards < 2 * prop.draft_trees  # chains of 3 were cut


@pytest.mark.parametrize("extra,min_accept", [
    ({"max_new_tokens": 7}, 1.5),
    ({"stop_token_ids": None}, 1.5),  # filled in with a token plain decoding emits
    ({"stop": None}, 1.5),  # filled in with text plain decoding emits: found one step late, trimmed back
    ({"stop_regex": None}, 1.5),  # the same as a regex
    # the head drafts without the penalty and the bias: fewer of its drafts survive (accept length 1.33)
    ({"min_new_tokens": 10, "logit_bias": {"5": 3.0}, "repetition_penalty": 1.3}, 1.2),
])
def test_finishes_logprobs_and_text_equal_plain(target, self_head, extra, min_accept):
    params, want = plain_finish_case(target, PROMPTS[:4], greedy(24, return_logprob=True, top_logprobs_num=2), extra)
    # every step speculative: the batch policy's timing-based choices would make the accept length vary by machine
    with Engine(model_path=target, max_total_tokens=4096, **v2("EAGLE", self_head, disable_speculative_auto_off=True)
                ) as e:
        got = e.generate(PROMPTS[:4], params)
        info = e.get_server_info()
        assert_no_kv_leak(e)
    assert_drafting_happened(got, min_accept_length=min_accept)
    assert_same_outputs(got, want)
    if "stop" in extra or "stop_regex" in extra:  # it ended requests after the next forward part had already run
        assert isinstance(got[0]["meta_info"]["finish_reason"]["matched"], str)
        assert info["spec_trimmed_finishes"] > 0


def test_streamed_chunks_add_up_to_plain_output(target, self_head):
    """Streaming under the overlap scheduler with --stream-interval 2, ended by a stop string found one step late:
    the chunks add up to plain decoding's ids, text and logprobs."""
    params, want = plain_finish_case(target, PROMPTS[:1], greedy(24, return_logprob=True, top_logprobs_num=2),
                                     {"stop": None})
    with Engine(model_path=target, max_total_tokens=4096, stream_interval=2, **v2("EAGLE", self_head)) as e:
        chunks = list(e.generate(PROMPTS[0], params, stream=True))
        assert_no_kv_leak(e)
    assert sum((c["output_ids"] for c in chunks), []) == want[0]["output_ids"]
    assert "".join(c["text"] for c in chunks) == want[0]["text"]
    lps = sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
    assert [t for _, t, _ in lps] == [t for _, t, _ in want[0]["meta_info"]["output_token_logprobs"]]
    assert chunks[-1]["meta_info"]["finish_reason"] == want[0]["meta_info"]["finish_reason"]
    assert chunks[-1]["meta_info"]["spec_verify_ct"] > 0
    assert all(len(c["output_ids"]) >= 2 for c in chunks[1:-1])  # after the first token, at least 2 a chunk


def test_seeded_sampling_equals_plain(target, self_head):
    params = [{"temperature": 0.4, "top_p": 0.9, "max_new_tokens": 24, "ignore_eos": True, "seed": 7 + i}
              for i in range(4)]
    with Engine(model_path=target, max_total_tokens=4096) as e:
        want = [o["output_ids"] for o in e.generate(PROMPTS[:4], params)]
    with Engine(model_path=target, max_total_tokens=4096, **v2("EAGLE", self_head)) as e:
        got = e.generate(PROMPTS[:4], params)
        assert e.get_server_info()["spec_overlapped_steps"] > 0
    assert [o["output_ids"] for o in got] == want
    assert_drafting_happened(got)


def test_chunked_prefill_radix_reuse_and_retraction(target, self_head, plain):
    assert_chunked_radix_and_retraction_lossless(target, v2("EAGLE", self_head), PROMPTS, greedy(24), plain[2],
                                                 min_accept_length=1.5, retraction_tokens=160)


def test_abort_mid_generation_frees_everything_and_others_go_on(target, self_head, plain):
    with Engine(model_path=target, max_total_tokens=4096, **v2("EAGLE", self_head)) as e:
        box: dict = {}
        others = threading.Thread(target=lambda: box.setdefault("outs", e.generate(PROMPTS, greedy(24))))
        others.start()
        chunks = 0
        for _ in e.generate(PROMPTS[0], greedy(200), stream=True):  # leaving the loop early aborts it
            chunks += 1
            if chunks == 3:
                break
        others.join()
        assert [o["output_ids"] for o in box["outs"]] == plain[2]
        assert e.get_server_info()["spec_overlapped_steps"] > 0
        assert_no_kv_leak(e)


def test_a_finish_found_by_the_next_forward_part_first_is_not_an_error(target, self_head, monkeypatch):
    """Force the race the threads allow: the next step's forward part (which marks a request that ends in it as
    stopped) completes before the previous step's outputs are processed. Processing must judge each request by
    what its own step's forward part found, and outputs must equal plain decoding's."""
    from specserve.scheduler import spec_decode, spec_overlap

    done = threading.Condition()
    counts = {"forwards": 0, "processed": 0}
    orig_forward, orig_process = spec_overlap.OverlapPipeline._forward, spec_decode.SpecDecoder.process

    def forward(self, reqs, shape):
        try:
            return orig_forward(self, reqs, shape)
        finally:
            with done:
                counts["forwards"] += 1
                done.notify_all()

    raced = []

    def process(self, record):
        with done:  # record k is processed beside forward part k + 1: let that one finish first
            counts["processed"] += 1
            done.wait_for(lambda: counts["forwards"] > counts["processed"], timeout=2)  # a drain has none
        raced.extend(r for b, r in enumerate(record.reqs) if r.spec_stopped and not record.stopped[b])
        return orig_process(self, record)

    monkeypatch.setattr(spec_overlap.OverlapPipeline, "_forward", forward)
    monkeypatch.setattr(spec_decode.SpecDecoder, "process", process)
    params = [dict(greedy(24), max_new_tokens=5 + 3 * i) for i in range(4)]  # requests end in different steps
    with Engine(model_path=target, max_total_tokens=4096) as e:
        want = e.generate(PROMPTS[:4], params)
    with Engine(model_path=target, max_total_tokens=4096, **v2("EAGLE", self_head)) as e:
        got = e.generate(PROMPTS[:4], params)
        assert e.get_server_info()["spec_overlapped_steps"] > 0
        assert_no_kv_leak(e)
    assert raced, "no request was ended by a forward part before its previous step's outputs were processed"
    assert_drafting_happened(got, min_accept_length=1.5)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in want]


def test_a_failing_output_part_aborts_its_requests_and_the_engine_keeps_serving(target, self_head, plain,
                                                                                   monkeypatch):
    """The output part raising while the next forward part runs beside it: the requests end with an abort (none
    is left waiting), their KV comes back, and later requests are served as before."""
    from specserve.scheduler import spec_decode

    orig_process, calls = spec_decode.SpecDecoder.process, []

    def process(self, record):
        calls.append(record)
        if len(calls) == 3:
            raise RuntimeError("injected output failure")
        return orig_process(self, record)

    with Engine(model_path=target, max_total_tokens=4096, **v2("EAGLE", self_head)) as e:
        monkeypatch.setattr(spec_decode.SpecDecoder, "process", process)
        outs = e.generate(PROMPTS[:3], greedy(24))
        assert len(calls) >= 3
        reasons = [o["meta_info"]["finish_reason"] for o in outs]
        assert all(r["type"] == "abort" and "injected output failure" in r["message"] for r in reasons)
        assert_no_kv_leak(e)
        again = e.generate(PROMPTS, greedy(24))
        assert [o["output_ids"] for o in again] == plain[2]
        assert_no_kv_leak(e)

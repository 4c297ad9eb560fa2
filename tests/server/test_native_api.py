"""SGLang's native endpoints: /generate (single, batch, ids, stream), health, info, flush, abort, metrics."""

from __future__ import annotations

import threading

import pytest

from specserve import Engine
from tests.server.conftest import CONTEXT, MAX_TOTAL_TOKENS
from tests.server.helpers import GREEDY, metric, poll, sse_json

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:"]
META_FIELDS = {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"}


@pytest.fixture(scope="module")
def offline(server_model):
    """The offline Engine's greedy results for PROMPTS: the server must give the same."""
    with Engine(model_path=server_model, max_total_tokens=4096, num_threads=1) as e:
        return e.generate(PROMPTS, {**GREEDY, "max_new_tokens": 12})


def test_generate_single_matches_offline_engine(server, offline):
    r = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 12}})
    assert r.status_code == 200
    out = r.json()
    assert out["text"] == offline[0]["text"] and out["output_ids"] == offline[0]["output_ids"]
    meta = out["meta_info"]
    assert META_FIELDS <= set(meta)
    assert meta["completion_tokens"] == 12 and meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == offline[0]["meta_info"]["prompt_tokens"]


def test_generate_batch_text_ids_and_n(server, offline):
    params = [{**GREEDY, "max_new_tokens": 12}, {**GREEDY, "max_new_tokens": 12}, {**GREEDY, "max_new_tokens": 5}]
    outs = server.post("/generate", json={"text": PROMPTS, "sampling_params": params}).json()
    assert [o["text"] for o in outs[:2]] == [o["text"] for o in offline[:2]]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [12, 12, 5]
    assert outs[2]["output_ids"] == offline[2]["output_ids"][:5]

    ids = [offline[0]["output_ids"][:3], offline[1]["output_ids"][:4]]
    by_ids = server.post("/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 3}})
    assert [o["meta_info"]["prompt_tokens"] for o in by_ids.json()] == [3, 4]
    single_ids = server.post("/generate", json={"input_ids": ids[0], "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(single_ids.json(), dict) and single_ids.json()["meta_info"]["prompt_tokens"] == 3

    n2 = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": {"n": 2, "max_new_tokens": 4,
                                                                                 "seed": 1}}).json()
    assert isinstance(n2, list) and len(n2) == 2


def test_generate_logprobs(server):
    out = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 6},
                                         "return_logprob": True, "top_logprobs_num": 2}).json()
    meta = out["meta_info"]
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == out["output_ids"]
    tops = meta["output_top_logprobs"]
    assert all(len(row) == 2 and row[0][1] == tok for row, tok in zip(tops, out["output_ids"], strict=True))


def test_generate_stream_is_cumulative_and_ends_with_done(server, offline):
    body = {"text": PROMPTS[1], "sampling_params": {**GREEDY, "max_new_tokens": 12}, "stream": True}
    with server.post("/generate", json=body, stream=True) as resp:
        events = sse_json(resp)
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert texts[-1] == offline[1]["text"] and events[-1]["output_ids"] == offline[1]["output_ids"]
    assert [e["meta_info"]["finish_reason"] is not None for e in events].count(True) == 1

    batch = {"text": PROMPTS[:2], "sampling_params": {**GREEDY, "max_new_tokens": 12}, "stream": True}
    with server.post("/generate", json=batch, stream=True) as resp:
        events = sse_json(resp)
    last = {e["index"]: e["text"] for e in events}
    assert last == {0: offline[0]["text"], 1: offline[1]["text"]}


def test_generate_stop_strings(server, offline):
    stop = offline[0]["text"][6:9]
    out = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": {
        **GREEDY, "max_new_tokens": 12, "stop": stop}}).json()
    assert out["text"] == offline[0]["text"][:offline[0]["text"].index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_health_model_info_server_info(server):
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200
    info = server.get("/get_model_info").json()
    assert info["model_path"] == server.model and info["is_generation"] is True
    assert info["context_length"] == CONTEXT and info["vocab_size"] > 0
    si = server.info()
    assert si["max_total_tokens"] == MAX_TOTAL_TOKENS and si["enable_metrics"] is True  # server args
    assert {"num_running_reqs", "num_waiting_reqs", "kv_usage", "free_slots"} <= set(si)  # runtime state
    assert si["internal_states"][0]["max_total_tokens"] == MAX_TOTAL_TOKENS


def test_flush_cache_empties_the_prefix_cache(server):
    server.post("/generate", json={"text": PROMPTS[2], "sampling_params": {"max_new_tokens": 2}})
    assert server.info()["radix_cached_tokens"] > 0
    assert server.post("/flush_cache").status_code == 200
    info = server.info()
    assert info["radix_cached_tokens"] == 0 and info["free_slots"] == info["max_total_tokens"]


def test_abort_request_ends_a_running_stream(server):
    body = {"text": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 4000}, "stream": True,
            "rid": "to-abort"}
    events: list = []
    with server.post("/generate", json=body, stream=True) as resp:
        reader = threading.Thread(target=lambda: events.extend(sse_json(resp)))
        reader.start()
        poll(lambda: server.info()["num_running_reqs"] == 1, what="the request to run")
        assert server.post("/abort_request", json={"rid": "to-abort"}).json() == {"aborted": 1}
        reader.join(timeout=120)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 4000
    assert server.post("/abort_request", json={"rid": "to-abort"}).json() == {"aborted": 0}


def test_metrics_count_requests_and_tokens(server):
    before = server.get("/metrics").text
    out = server.post("/generate", json={"text": PROMPTS[1], "sampling_params": {**GREEDY, "max_new_tokens": 7}})
    after = server.get("/metrics").text
    meta = out.json()["meta_info"]
    delta = lambda name, labels="": metric(after, name, labels) - metric(before, name, labels)  # noqa: E731
    assert delta("specserve:num_requests_total", 'finish_reason="length"') == 1
    assert delta("specserve:prompt_tokens_total") == meta["prompt_tokens"]
    assert delta("specserve:generation_tokens_total") == 7
    assert delta("specserve:time_to_first_token_seconds_count") == 1
    assert delta("specserve:inter_token_latency_seconds_count") == 6
    for gauge in ("specserve:num_running_reqs", "specserve:num_queue_reqs", "specserve:token_usage"):
        assert f"\n{gauge} " in after

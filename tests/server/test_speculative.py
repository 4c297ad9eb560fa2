"""The server with speculative decoding on (NGRAM: no draft model needed): lossless through HTTP, speculative
metrics in meta_info, /get_server_info and /metrics, and multi-token steps reaching streaming clients."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.utils import terminate_process
from tests.server.conftest import start_server
from tests.server.helpers import GREEDY, metric, sse_json

REPETITIVE = [
    "def f(x):\n    return x\ndef f(x):\n    return x\ndef f(",
    "a b c d e f a b c d e f a b c",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
    "x = 1\ny = 2\nx = 1\ny = 2\nx =",
]
NEW = 48


@pytest.fixture(scope="module")
def target(model_factory) -> str:
    return model_factory("llama", num_hidden_layers=1, unit_embeddings=True, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    with Engine(model_path=target, max_total_tokens=8192, num_threads=1) as e:
        return [o["output_ids"] for o in e.generate(REPETITIVE, {**GREEDY, "max_new_tokens": NEW})]


@pytest.fixture(scope="module")
def spec_server(target, tmp_path_factory):
    s = start_server(target, str(tmp_path_factory.mktemp("spec") / "server.log"), "--max-total-tokens", "8192",
                     "--enable-metrics", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8")
    yield s
    terminate_process(s.proc)


def test_generate_is_lossless_and_reports_spec_meta(spec_server, plain):
    outs = spec_server.post("/generate", json={"text": REPETITIVE,
                                               "sampling_params": {**GREEDY, "max_new_tokens": NEW}}).json()
    assert [o["output_ids"] for o in outs] == plain
    metas = [o["meta_info"] for o in outs]
    assert all(m["spec_verify_ct"] > 0 for m in metas)
    assert max(m["spec_accept_length"] for m in metas) > 1.0  # drafting really happened
    assert all(m["spec_accept_length"] == pytest.approx(NEW / m["spec_verify_ct"]) for m in metas)

    info = spec_server.info()
    assert info["speculative_algorithm"] == "NGRAM" and info["avg_spec_accept_length"] > 1.0
    assert info["internal_states"][0]["avg_spec_accept_length"] == info["avg_spec_accept_length"]
    text = spec_server.get("/metrics").text
    assert metric(text, "specserve:avg_spec_accept_length") == pytest.approx(info["avg_spec_accept_length"])


def test_streaming_carries_multi_token_steps(spec_server, plain):
    body = {"prompt": REPETITIVE[0], "max_tokens": NEW, "stream": True, **GREEDY,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with spec_server.post("/v1/completions", json=body, stream=True) as resp:
        events = sse_json(resp)
    counts = [e["usage"]["completion_tokens"] for e in events]
    steps = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    assert counts[-1] == NEW and max(steps) > 1  # accepted drafts arrive as several tokens in one chunk
    full = spec_server.post("/v1/completions", json={"prompt": REPETITIVE[0], "max_tokens": NEW, **GREEDY}).json()
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == full["choices"][0]["text"]

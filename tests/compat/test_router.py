"""sglang-router (SGLang's Rust load balancer, from PyPI, unchanged) in front of two specserve servers: the
OpenAI endpoints, the native /generate (plain and streamed) and the cache flush pass through it, and round-robin
spreads the requests over both workers."""

from __future__ import annotations

import json

import pytest
import requests

from specserve.utils import terminate_process
from tests.compat.router import start_router
from tests.server.conftest import start_server
from tests.server.helpers import sse_json

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def workers(model_factory, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router")
    ws = [start_server(model_factory("llama"), str(log_dir / f"worker{i}.log")) for i in range(2)]
    yield ws
    for w in ws:
        terminate_process(w.proc)


@pytest.fixture(scope="module")
def router(workers):
    proc, url = start_router([w.url for w in workers], "round_robin")
    yield url
    terminate_process(proc)


def generated(worker) -> int:
    return worker.info()["generated_tokens"]


def test_requests_through_the_router(router, workers):
    import openai

    direct = workers[0].post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0,
                                                                                   "max_new_tokens": 8}}).json()
    before = [generated(w) for w in workers]
    client = openai.OpenAI(base_url=router + "/v1", api_key="None", max_retries=0)
    assert [m.id for m in client.models.list().data] == [workers[0].model]
    for _ in range(2):  # round robin: one to each worker
        r = client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.choices[0].text == direct["text"] and r.usage.completion_tokens == 8
    after = [generated(w) for w in workers]
    assert all(b - a >= 8 for a, b in zip(before, after, strict=True))  # both workers served one
    chat = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.usage.completion_tokens == 4
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="any", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert streamed == direct["text"]


def test_native_generate_through_the_router(router, workers):
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    direct = workers[1].post("/generate", json=body).json()
    routed = requests.post(router + "/generate", json=body, timeout=60)
    assert routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == direct["output_ids"]
    with requests.post(router + "/generate", json={**body, "stream": True}, stream=True, timeout=60) as resp:
        events = sse_json(resp)
    assert events[-1]["output_ids"] == direct["output_ids"] and events[-1]["text"] == direct["text"]
    flushed = requests.post(router + "/flush_cache", timeout=60)
    assert flushed.status_code == 200 and json.loads(flushed.text)["workers_flushed"] == 2

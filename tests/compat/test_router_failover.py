"""sglang-router (PyPI, unchanged) with its cache-aware policy in front of two specserve servers: a repeated prompt
goes to the worker that holds its prefix; when a worker dies, the request it was running ends (an error, or the
router's retry on the live worker), not a hang, and once the router's health check has seen the worker gone every
request goes to the live one."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from specserve.utils import terminate_process
from tests.compat.router import start_router
from tests.server.conftest import start_server

PROMPT = "def fibonacci(n):\n    " * 6  # long enough to be worth routing by its prefix


@pytest.fixture(scope="module")
def workers(model_factory, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router-failover")
    model = model_factory("llama", max_position_embeddings=4096)
    ws = [start_server(model, str(log_dir / f"worker{i}.log")) for i in range(2)]
    yield ws
    for w in ws:
        terminate_process(w.proc)


@pytest.fixture(scope="module")
def router(workers):
    proc, url = start_router([w.url for w in workers], "cache_aware", "--health-check-interval-secs", "1")
    yield url
    terminate_process(proc)


def generated(worker) -> int:
    return worker.info()["generated_tokens"]


def complete(router: str, prompt: str, max_tokens: int = 8, timeout: float = 60) -> requests.Response:
    return requests.post(router + "/v1/completions", json={"model": "any", "prompt": prompt, "max_tokens": max_tokens,
                                                           "temperature": 0, "ignore_eos": True}, timeout=timeout)


def test_cache_aware_routing_keeps_a_prefix_on_one_worker(router, workers):
    before = [generated(w) for w in workers]
    answers = [complete(router, PROMPT) for _ in range(4)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
    grew = [generated(w) - b for w, b in zip(workers, before, strict=True)]
    assert sorted(grew) == [0, 32]  # all four on one worker: the one holding the prefix
    assert all(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in answers[1:])


def test_a_dead_worker_fails_its_request_and_is_routed_around(router, workers):
    box = {}

    def long_request():
        try:
            box["response"] = complete(router, "import os\n" * 4, max_tokens=3000, timeout=120)
        except requests.RequestException as e:
            box["error"] = e

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    busy = None
    while busy is None:
        assert time.monotonic() < deadline, "the long request never started"
        busy = next((w for w in workers if w.info()["num_running_reqs"] > 0), None)
        time.sleep(0.05)
    busy.proc.kill()
    start = time.monotonic()
    t.join(timeout=90)
    assert not t.is_alive(), "the request on the dead worker hangs"
    assert time.monotonic() - start < 90
    response = box.get("response")
    if response is not None:  # the router may have retried it on the live worker, where it completes
        assert response.status_code >= 500 or response.json()["usage"]["completion_tokens"] == 3000
    live = next(w for w in workers if w is not busy)
    # a request may still go to the dead worker (500 from the router) until its health check (every second here)
    # takes the worker out of rotation
    deadline = time.monotonic() + 30
    while complete(router, "y = 0\n").status_code != 200:
        assert time.monotonic() < deadline, "the router keeps routing to the dead worker"
        time.sleep(0.5)
    before = generated(live)
    answers = [complete(router, f"x = {i}\n") for i in range(4)]
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert generated(live) - before >= 4 * 8

"""`specserve serve --tp 2` over HTTP: the official client gets one process's greedy answer; when a rank dies the
server stops (exit code 1) instead of hanging its clients."""

from __future__ import annotations

import os
import signal

import pytest

from specserve.utils import terminate_process
from tests.server.conftest import start_server

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def servers(model_factory, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tp-server")
    model = model_factory("llama")
    one = start_server(model, str(log_dir / "tp1.log"), "--dtype", "float32")
    two = start_server(model, str(log_dir / "tp2.log"), "--dtype", "float32", "--tp", "2")
    yield one, two
    for s in (one, two):
        terminate_process(s.proc)


def rank_processes(pid: int) -> list[int]:
    """The tensor-parallel ranks among process pid's children (Python's resource tracker is one too)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(p) for p in f.read().split()]
    out = []
    for kid in kids:
        with open(f"/proc/{kid}/cmdline") as f:
            if "specserve.parallel.ranks" in f.read():
                out.append(kid)
    return out


def test_tp2_server_answers_as_one_process_and_stops_when_a_rank_dies(servers):
    import openai

    one, two = servers
    answers = []
    for s in (one, two):
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="None", max_retries=0)
        done = client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0)
        answers.append(done.choices[0].text)
    assert answers[0] == answers[1]
    info = two.info()
    assert info["tp_size"] == 2 and info["tp_all_reduces"] > 0 and info["tp_messages"] > 0
    followers = rank_processes(info["worker_pid"])
    assert len(followers) == 1
    os.kill(followers[0], signal.SIGKILL)
    client = openai.OpenAI(base_url=two.url + "/v1", api_key="None", max_retries=0, timeout=60)
    try:  # the request in flight ends as an abort (or, when the server is already gone, a connection error)
        cut = client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0)
        assert cut.choices[0].finish_reason == "abort"
    except openai.APIConnectionError:
        pass
    assert two.proc.wait(timeout=60) == 1
    assert "rank 1 exited" in two.log()

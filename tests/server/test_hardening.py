"""Requests that must not hang, starve or crash the server: limits checked before any work, the tokenizer pool,
request chat templates, the admin key and per-client rids, and a shutdown no client can hold up.

One server with two client keys, an admin key and small limits; the shared default server for the defaults.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
from transformers import AutoTokenizer

from specserve.request_limits import NORMALIZER_SLACK, max_token_chars
from specserve.utils import terminate_process
from tests.server.conftest import CONTEXT, start_server
from tests.server.helpers import GREEDY, poll, sse_json

KA, KB, ADMIN = "key-a", "key-b", "admin-key"
A, B, ADM = ({"Authorization": f"Bearer {k}"} for k in (KA, KB, ADMIN))
LIMITS = ["--max-request-bytes", "65536", "--max-request-samples", "8", "--max-stop-strings", "4",
          "--max-stop-string-chars", "16", "--max-top-logprobs", "5"]
SLOW_TEMPLATE = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def guarded(server_model, tmp_path_factory):
    s = start_server(server_model, str(tmp_path_factory.mktemp("guarded") / "server.log"), *LIMITS,
                     "--admin-api-key", ADMIN, "--max-running-requests", "2",
                     "--max-queued-requests", "2", "--trust-request-chat-template", "--chat-template-timeout", "0.5",
                     "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}", api_key=KA,
                     api_keys=f"{KA},{KB}")
    yield s
    terminate_process(s.proc)


def _error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---------------------------------------------------------------------------------------------- limits
@pytest.mark.parametrize("body, param, flag", [
    ({"text": "hi", "sampling_params": {"n": 1_000_000}}, "n", "--max-request-samples"),
    ({"text": ["hi"] * 9}, "prompt", "--max-request-samples"),
    ({"text": ["hi"] * 3, "sampling_params": {"n": 3}}, "prompt", "--max-request-samples"),
    ({"text": "hi", "sampling_params": {"stop": [str(i) for i in range(1000)]}}, "stop", "--max-stop-strings"),
    ({"text": "hi", "sampling_params": {"stop": "x" * 17}}, "stop", "--max-stop-string-chars"),
    ({"text": "hi", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num", "--max-top-logprobs"),
    ({"text": "hi", "sampling_params": {"top_logprobs_num": 6, "return_logprob": True}}, "top_logprobs_num",
     "--max-top-logprobs"),
])
def test_generate_limits_answer_400_naming_the_flag(guarded, body, param, flag):
    error = _error(guarded.post("/generate", json=body), 400)
    assert error["param"] == param and flag in error["message"], error
    assert guarded.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_openai_limits_use_openai_names(guarded):
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]}
    error = _error(guarded.post("/v1/completions", json=body), 400)
    assert error["param"] == "stop" and "--max-stop-strings" in error["message"]
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 6}
    error = _error(guarded.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "top_logprobs" and "--max-top-logprobs" in error["message"]


def test_body_size_limit_with_and_without_content_length(guarded):
    big = {"text": "x" * 70_000}
    error = _error(guarded.post("/generate", json=big), 413)
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
    chunks = iter([json.dumps(big).encode()[i:i + 8192] for i in range(0, 70_020, 8192)])
    r = guarded.post("/generate", data=chunks, headers={"Content-Type": "application/json"})  # chunked: no length
    assert _error(r, 413)["code"] == "request_too_large"
    assert guarded.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).ok


def test_prompt_longer_than_any_context_is_refused_before_tokenizing(server, server_model):
    """The default server: 10 MB of text can never fit in the context; it is refused without being tokenized."""
    bound = CONTEXT * max_token_chars(AutoTokenizer.from_pretrained(server_model)) * NORMALIZER_SLACK
    for path, body in (("/generate", {"text": "ab " * (bound // 3 + 1)}),
                       ("/v1/completions", {"prompt": "ab " * (bound // 3 + 1), "max_tokens": 1})):
        error = _error(server.post(path, json=body), 400)
        assert error["param"] == "prompt" and "characters" in error["message"], error


# ---------------------------------------------------------------------------------------------- tokenizer pool
def test_a_heavy_tokenization_does_not_stall_other_requests(server):
    """A 3 MB /tokenize runs on one thread of the pool while small requests are answered on the others."""
    finished: list[str] = []
    big = threading.Thread(target=lambda: (server.post("/tokenize", json={"prompt": "lorem ipsum " * 250_000}),
                                           finished.append("big")))
    big.start()
    time.sleep(0.3)
    for i in range(3):
        assert server.post("/tokenize", json={"prompt": f"small {i}"}).json()["count"] > 0
        finished.append(f"small {i}")
    big.join(timeout=120)
    assert finished[-1] == "big", finished


def test_request_chat_templates_are_refused_by_default(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"chat_template": "{{ 'x' * 1000000000 }}"}}
    error = _error(server.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "chat_template_kwargs" and "--trust-request-chat-template" in error["message"]


def test_a_runaway_chat_template_is_cut_at_its_timeout(guarded):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}}
    result: list = []
    slow = threading.Thread(target=lambda: result.append(guarded.post("/v1/chat/completions", json=body)))
    slow.start()
    ok = guarded.post("/v1/chat/completions", json={**body, "chat_template_kwargs": None})
    slow.join(timeout=60)
    assert ok.status_code == 200
    error = _error(result[0], 400)
    assert error["param"] == "messages" and "--chat-template-timeout" in error["message"]


# ---------------------------------------------------------------------------------------------- keys and rids
def _long_stream(server, headers: dict, rid: str, events: list, cut: bool = False
                 ) -> tuple[threading.Thread, requests.Response]:
    """A long greedy stream read on a thread into events (cut: the server may end it without [DONE])."""
    body = {"text": "long", "sampling_params": {**GREEDY, "max_new_tokens": 3000}, "stream": True, "rid": rid}
    resp = server.post("/generate", json=body, stream=True, headers=headers)
    assert resp.status_code == 200

    def read() -> None:
        if not cut:
            events.extend(sse_json(resp))
            return
        try:
            events.extend(line for line in resp.iter_lines() if line)
        except requests.RequestException:
            events.append("cut")

    reader = threading.Thread(target=read)
    reader.start()
    return reader, resp


def test_clients_abort_only_their_own_requests(guarded):
    events: list = []
    reader, resp = _long_stream(guarded, A, "shared-rid", events)
    with resp:
        poll(lambda: guarded.get("/get_server_info", headers=ADM).json()["num_running_reqs"] == 1, what="running")
        assert guarded.post("/abort_request", json={"rid": "shared-rid"}, headers=B).json() == {"aborted": 0}
        assert _error(guarded.post("/abort_request", json={"abort_all": True}, headers=B), 403)["code"] == "forbidden"
        # B's own request under the same rid neither collides with A's nor learns of it
        mine = guarded.post("/generate", headers=B, json={"text": "b", "rid": "shared-rid",
                                                          "sampling_params": {"max_new_tokens": 2}})
        assert mine.status_code == 200 and mine.json()["meta_info"]["id"] == "shared-rid"
        assert guarded.post("/abort_request", json={"rid": "shared-rid"}, headers=A).json() == {"aborted": 1}
        reader.join(timeout=120)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_the_admin_aborts_anyones_request(guarded):
    events: list = []
    reader, resp = _long_stream(guarded, B, "b-rid", events)
    with resp:
        poll(lambda: guarded.get("/get_server_info", headers=ADM).json()["num_running_reqs"] == 1, what="running")
        assert guarded.post("/abort_request", json={"rid": "b-rid"}, headers=ADM).json() == {"aborted": 1}
        reader.join(timeout=120)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_paths_and_pids_are_the_admins(guarded, server_model):
    assert os.path.isabs(server_model)
    for headers in (A, B):
        texts = [guarded.get(p, headers=headers).text for p in ("/get_server_info", "/get_model_info", "/v1/models")]
        texts.append(guarded.get("/v1/models/other", headers=headers).text)  # the 404 names the served model
        assert not any(server_model in t for t in texts)
        info = guarded.get("/get_server_info", headers=headers).json()
        assert isinstance(info["worker_pid"], str) and info["internal_states"][0]["worker_pid"] == info["worker_pid"]
        assert info["api_key"] == info["admin_api_key"] == "***"
    info = guarded.get("/get_server_info", headers=ADM).json()
    assert info["model_path"] == server_model and isinstance(info["worker_pid"], int)
    assert guarded.get("/v1/models", headers=ADM).json()["data"][0]["root"] == server_model
    assert _error(guarded.post("/flush_cache", headers=A), 403)["code"] == "forbidden"
    assert guarded.post("/flush_cache", headers=ADM).status_code == 200
    assert requests.get(guarded.url + "/health_generate", timeout=60).status_code == 200  # probes need no key


def test_health_generate_counts_against_the_queue(guarded):
    """Four long requests fill 2 running + 2 queued; a probe then gets 503 instead of queueing a fifth."""
    streams = []
    try:
        for i in range(4):
            events: list = []
            streams.append((*_long_stream(guarded, A, f"fill-{i}", events), events))
        poll(lambda: guarded.get("/get_server_info", headers=ADM).json()["num_inflight_reqs"] == 4, what="full")
        r = requests.get(guarded.url + "/health_generate", timeout=60)
        assert r.status_code == 503 and "capacity" in r.json()["error"]["message"]
    finally:
        guarded.post("/abort_request", json={"abort_all": True}, headers=ADM)
        for reader, resp, _ in streams:
            reader.join(timeout=120)
            resp.close()
    poll(lambda: requests.get(guarded.url + "/health_generate", timeout=60).ok, what="the probe to pass again")


# ---------------------------------------------------------------------------------------------- shutdown
def test_a_stalled_body_does_not_hold_the_shutdown(server_model, tmp_path):
    """A client that sends half its body and stalls gets 503 when SIGTERM comes, and the server exits at once."""
    s = start_server(server_model, str(tmp_path / "server.log"))
    try:
        port = int(s.url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"text\": ")
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        sock.settimeout(30)
        answer = b""
        while chunk := sock.recv(4096):  # the server closes the connection after its answer
            answer += chunk
        answer = answer.decode()
        assert answer.startswith("HTTP/1.1 503") and "shutting_down" in answer, answer
        assert s.proc.wait(timeout=30) == 0
    finally:
        terminate_process(s.proc)


def test_graceful_shutdown_timeout_cuts_in_flight_requests(server_model, tmp_path):
    s = start_server(server_model, str(tmp_path / "server.log"), "--graceful-shutdown-timeout", "1",
                     "--max-running-requests", "1")
    try:
        streams = []
        for i in range(3):  # one runs, two wait: far more than a second of decoding on one thread
            events: list = []
            streams.append(_long_stream(s, {}, f"long-{i}", events, cut=True))
        poll(lambda: s.info()["num_running_reqs"] == 1, what="running")
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        assert "timeout graceful shutdown exceeded" in s.log()
        for reader, resp in streams:
            reader.join(timeout=30)
            resp.close()
    finally:
        terminate_process(s.proc)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_worker_keeps_a_tuned_heap_and_trims_it(server):
    # the worker tunes malloc as the Engine does (one arena, heap kept) and so has a trimmer, which runs at once
    # when the loop is idle; a trim count that only exists once the settings were applied
    def trims() -> int:
        return requests.get(server.url + "/get_server_info", timeout=30).json().get("cpu_heap_trims", 0)

    poll(lambda: trims() >= 1, timeout=30, what="a heap trim in the worker")


def test_limit_flags_are_checked_at_start_up(server_model):
    for flag, value in (("--max-request-bytes", "0"), ("--tokenizer-worker-num", "0"),
                        ("--graceful-shutdown-timeout", "-1"), ("--chat-template-timeout", "0")):
        r = subprocess.run([sys.executable, "-m", "specserve.launch_server", "--model-path", server_model, flag, value],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and flag in r.stderr, (flag, r.stderr)

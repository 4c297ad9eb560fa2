"""Clients that go away: their requests are aborted and their KV freed, and the server keeps serving."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

from tests.server.helpers import GREEDY, metric, poll

STORM = 50
LONG = 2000  # tokens a storm request would generate if it were not aborted


def _open_stream(url: str, path: str, body: dict) -> http.client.HTTPConnection:
    """Starts a streaming request and returns once its first SSE event has arrived (it is generating)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    while not resp.readline().startswith(b"data: "):
        pass
    return conn


def _aborted(server) -> float:
    return metric(server.get("/metrics").text, "specserve:num_requests_total", 'finish_reason="abort"')


def _idle_and_free(server) -> bool:
    info = server.info()
    return (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_locked_tokens"] == 0
            and info["num_inflight_reqs"] == 0)


def test_disconnect_storm_frees_everything(server):
    aborted_before = _aborted(server)
    bodies = [
        ("/v1/completions", {"prompt": f"storm {i}:", "max_tokens": LONG, "stream": True, **GREEDY})
        if i % 2 else
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"storm {i}"}], "max_tokens": LONG,
                                  "stream": True, **GREEDY})
        for i in range(STORM)
    ]
    conns: list = [None] * STORM
    errors: list = []

    def client(i: int) -> None:
        try:
            conns[i] = _open_stream(server.url, *bodies[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(STORM)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert server.info()["num_running_reqs"] > 0  # they are mid-generation
    for conn in conns:  # drop every client mid-generation
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()

    poll(lambda: _idle_and_free(server), timeout=120, what="the running set to empty")
    assert _aborted(server) - aborted_before == STORM
    info = server.info()
    assert info["free_req_rows"] == info["max_running_requests"] + 1
    assert server.post("/flush_cache").status_code == 200
    assert server.info()["free_slots"] == info["max_total_tokens"]  # every KV slot is free again

    start = time.monotonic()
    r = server.post("/v1/completions", json={"prompt": "after the storm", "max_tokens": 8, **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert time.monotonic() - start < 60


def test_non_streaming_client_disconnect_aborts(server):
    aborted_before = _aborted(server)
    u = urlparse(server.url)
    body = json.dumps({"text": "a long one", "sampling_params": {"max_new_tokens": 4000, **GREEDY}}).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=60)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    poll(lambda: server.info()["num_running_reqs"] == 1, what="the request to run")
    sock.close()
    poll(lambda: _idle_and_free(server), timeout=120, what="the aborted request to leave")
    assert _aborted(server) - aborted_before == 1

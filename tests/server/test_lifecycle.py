"""A server started the way the docs' notebook cells start SGLang (launch_server_cmd / wait_for_server /
terminate_process), with --api-key and 1 running + 1 queued slot: auth, overload, graceful shutdown.

The tests run in file order; the last one shuts the server down.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from specserve.utils import launch_server_cmd, terminate_process, wait_for_server
from tests.server.conftest import server_env
from tests.server.helpers import GREEDY, poll

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 2000


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def limited(server_model, monkeypatch_module, template_file):
    for name, value in server_env().items():
        monkeypatch_module.setenv(name, value)
    proc, port = launch_server_cmd(
        f"""
python3 -m specserve.launch_server --model-path {server_model} --host 127.0.0.1 \\
    --max-running-requests 1 --max-queued-requests 1 --api-key {KEY} --num-threads 1 --log-level warning \\
    --chat-template {template_file} --served-model-name tiny-chat
""",
        host="127.0.0.1",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, timeout=300, process=proc, api_key=KEY)
        yield proc, url
    finally:
        terminate_process(proc)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_api_key_is_required(limited):
    _, url = limited
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(url + "/v1/models", headers=headers, timeout=60).status_code == 401
    assert requests.get(url + "/health", timeout=60).status_code == 200  # health checks need no key
    assert requests.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200


def test_chat_template_flag_and_served_name(limited, server_model):
    import transformers

    _, url = limited
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    body = {"model": "tiny-chat", "messages": messages, "max_tokens": 2}
    r = requests.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "tiny-chat"
    tok = transformers.AutoTokenizer.from_pretrained(server_model)
    rendered = "[system] Be brief.\n[user] Name a prime.\n[assistant]"
    assert tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False) == rendered
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False))
    models = requests.get(url + "/v1/models", headers=AUTH, timeout=60).json()["data"]
    assert [m["id"] for m in models] == ["tiny-chat"]


def test_overload_answers_503_at_once(limited):
    _, url = limited
    barrier = threading.Barrier(10)
    results: list = [None] * 10

    def one(i: int) -> None:
        barrier.wait()
        body = {"prompt": f"load {i}", "max_tokens": LONG, "stream": True, **GREEDY}
        with requests.post(url + "/v1/completions", json=body, headers=AUTH, stream=True, timeout=300) as r:
            answered = time.monotonic()
            if r.status_code != 200:
                results[i] = (r.status_code, answered, r.json())
                return
            finish = None
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            results[i] = (200, time.monotonic(), finish)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    ok = [r for r in results if r[0] == 200]
    busy = [r for r in results if r[0] == 503]
    assert len(ok) == 2 and len(busy) == 8, [r[0] for r in results]
    assert all(r[2] == "length" for r in ok)  # both admitted requests ran to completion
    assert all(r[2]["error"]["code"] == "queue_full" and r[2]["error"]["type"] == "server_error" for r in busy)
    assert max(r[1] for r in busy) < min(r[1] for r in ok)  # every 503 came before any success finished


def _children(pid: int) -> list[int]:
    """Processes whose parent is pid (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_drains_refuses_new_and_leaves_no_child(limited):
    proc, url = limited
    children = _children(proc.pid)
    assert children, "the server has a model worker process"
    worker_pid = requests.get(url + "/get_server_info", headers=AUTH, timeout=60).json()["worker_pid"]
    assert worker_pid in children

    body = {"prompt": "drain me", "max_tokens": LONG, "stream": True, **GREEDY}
    finish: list = []
    chunks: list = []
    resp = requests.post(url + "/v1/completions", json=body, headers=AUTH, stream=True, timeout=300)
    lines = resp.iter_lines(decode_unicode=True)
    first = next(line for line in lines if line.startswith("data: "))
    chunks.append(first)

    def read_rest() -> None:
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(line)
                finish.append(json.loads(line[6:])["choices"][0]["finish_reason"])

    reader = threading.Thread(target=read_rest)
    reader.start()
    proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            r = requests.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=AUTH, timeout=5)
        except requests.ConnectionError:
            return True
        return r.status_code == 503

    poll(refused, timeout=60, what="new requests to be refused")
    assert not any(finish)  # refused while the in-flight request was still streaming
    reader.join(timeout=300)
    resp.close()
    assert finish and finish[-1] == "length"  # the in-flight request ran to its end
    assert proc.wait(timeout=120) == 0
    poll(lambda: not any(_alive(c) for c in children), timeout=30, what="the children to exit")

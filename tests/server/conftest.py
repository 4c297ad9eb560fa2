"""Server fixtures: real `python -m specserve.launch_server` subprocesses on loopback with a tiny random model."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import requests

import specserve
from specserve.utils import free_port, terminate_process, wait_for_server

START_TIMEOUT_S = 300
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(specserve.__file__)))


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    log_path: str
    api_key: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, timeout=120, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        return requests.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, timeout=120, **kw)

    def info(self) -> dict:
        return self.get("/get_server_info").json()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def server_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}


def start_server(model_dir: str, log_path: str, *extra: str, api_key: str | None = None,
                 api_keys: str | None = None) -> Server:
    """api_key: the key the tests send; api_keys: the server's --api-key value when it holds several keys."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.launch_server", "--model-path", model_dir, "--port", str(port),
           "--num-threads", "1", *extra]
    if api_keys or api_key:
        cmd += ["--api-key", api_keys or api_key]
    log = open(log_path, "w")  # noqa: SIM115 - the server writes it for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env())
    log.close()
    server = Server(proc, f"http://127.0.0.1:{port}", model_dir, log_path, api_key)
    try:
        wait_for_server(server.url, timeout=START_TIMEOUT_S, process=proc, api_key=api_key)
    except Exception:
        terminate_process(proc)
        raise RuntimeError("server did not start:\n" + server.log()) from None
    return server


CONTEXT = 4096
MAX_TOTAL_TOKENS = 65536


@pytest.fixture(scope="session")
def server_model(model_factory) -> str:
    """The tiny random Llama with a long context, so a request can run long enough to be caught running."""
    return model_factory("llama", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
def server(server_model, tmp_path_factory):
    """The shared server: default limits, metrics on, KV room for 50 concurrent long requests."""
    s = start_server(server_model, str(tmp_path_factory.mktemp("server") / "server.log"),
                     "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--enable-metrics")
    yield s
    terminate_process(s.proc)


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)

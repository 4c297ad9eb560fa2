"""sglang-router (PyPI, unchanged) started in front of specserve servers for the compat tests."""

from __future__ import annotations

import subprocess
import sys
import time

import requests

from specserve.utils import free_port


def start_router(worker_urls: list[str], policy: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """-> (the router process, its URL) once its /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                             "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
                             "--prometheus-port", str(free_port()), "--log-level", "warn", *extra])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "the router exited"
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "the router did not come up"
        time.sleep(0.3)

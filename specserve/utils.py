"""Helpers to run a server from Python (a notebook, a script, a test), mirroring ``sglang.utils``:

    from specserve.utils import launch_server_cmd, wait_for_server, terminate_process, print_highlight

    server_process, port = launch_server_cmd("python3 -m specserve.launch_server --model-path PATH")
    wait_for_server(f"http://localhost:{port}", process=server_process)
    ...
    terminate_process(server_process)
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (PR_SET_PDEATHSIG), so no worker or rank outlives it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_command(command: str) -> tuple[list[str], dict[str, str]]:
    """A shell-style command line (backslash-newline continuations, leading VAR=value assignments) as
    (argv, extra environment). A leading ``python``/``python3`` becomes this interpreter, so the command
    runs in the same environment as the caller."""
    argv = shlex.split(command.replace("\\\n", " "))
    env = {}
    while argv and _ENV_ASSIGNMENT.match(argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    if argv and _PYTHON.match(os.path.basename(argv[0])):
        argv[0] = sys.executable
    return argv, env


def launch_server_cmd(command: str, host: str = "0.0.0.0", port: int | None = None) -> tuple[subprocess.Popen, int]:
    """Starts `command` (e.g. ``python3 -m specserve.launch_server --model-path ...``) with ``--port`` set to
    `port` (a free one by default) in its own session; returns (process, port). Output goes to ours."""
    port = free_port("127.0.0.1" if host in ("0.0.0.0", "") else host) if port is None else port
    argv, env = split_command(command)
    proc = subprocess.Popen([*argv, "--port", str(port)], env={**os.environ, **env}, start_new_session=True)
    return proc, port


def wait_for_server(base_url: str, timeout: float | None = None, process: subprocess.Popen | None = None,
                    api_key: str | None = None) -> None:
    """Blocks until ``GET base_url/v1/models`` answers 200. Raises RuntimeError if `process` exits first,
    TimeoutError after `timeout` seconds (None: wait as long as it takes)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key or 'None'}"})
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status == 200:
                    json.load(resp)
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the server at {base_url} was not ready within {timeout}s")
        time.sleep(0.2)


def terminate_process(process: subprocess.Popen, timeout: float = 60.0) -> int:
    """Graceful stop: SIGTERM (the server drains and stops its worker), then after `timeout` seconds SIGKILL
    to the process (and to its process group when it leads one, as launch_server_cmd's do). Returns the
    exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
        except ProcessLookupError:
            pass
    return process.wait()


def print_highlight(text) -> None:
    """Prints `text` in bold green (as sglang.utils.print_highlight does in a terminal)."""
    print(f"\x1b[1;32m{text}\x1b[0m", flush=True)

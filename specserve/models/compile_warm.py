"""``--torch-compile-in-background`` on CPU: torch.compile's cache filled by a low-priority child process first.

Building a graph is mostly inductor's Python code generation, which holds the interpreter lock that every eager op
of the scheduler's thread needs: while SmolLM2's largest graphs were built in the server process, its eager decoding
fell from about 48 to 2 tok/s for a minute and a half. A graph whose compiled code is already in inductor's on-disk
cache (``TORCHINDUCTOR_CACHE_DIR``, by default a folder in the system's temporary directory) is rebuilt from it in
seconds, so on a cold cache the server first leaves the building to a child process:

- the child (``python -m specserve.warm_compile``, a module above the engine) loads the same model with the same
  settings and runs the warm-up requests through a background-compiling engine of its own, pass after pass until
  one builds no new graph, at each thread count the server's governor may pick (a graph is built per count), so
  its graphs are the ones the server will ask for;
- meanwhile the server decodes eager on one OpenMP thread fewer, leaving the child a core, and builds nothing
  (``BackgroundCompiler`` holds its builds back). The child runs at a low priority (``CHILD_NICE``), so the
  server's threads come first;
- when the child exits the server builds its graphs from the cache. The child leaves a marker
  (``specserve-warm/<key>.done`` in inductor's cache folder) keyed by the settings, torch's version and specserve's,
  so a later start with the same settings skips the child. If the child fails, the server builds from scratch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

from specserve.utils import die_with_parent
from specserve.version import __version__

logger = logging.getLogger(__name__)

MARKER_DIR = "specserve-warm"
#: the child's CPU priority. The server leaves it a core (one OpenMP thread fewer), where its code generation runs;
#: but a compiled graph of its own runs on the server's thread count, and the thread on the server's core then gets
#: the share this sets: at 19 (about 1.5% of a busy core) the child's last pass over the warm-up requests, running its
#: graphs and building none, had not ended after 4 minutes beside a busy server; 10 gives it about a tenth of the
#: server's core, taken only while such a graph runs
CHILD_NICE = 10
#: settings that do not change a graph (where the server listens, what it logs, what it calls the model)
NOT_IN_KEY = frozenset({"host", "port", "api_key", "admin_api_key", "served_model_name", "log_level",
                        "enable_metrics", "stream_interval", "log_requests", "dp_size", "disable_torch_compile_warmer"})


#: what a marker promises about the cache; a change of it makes earlier markers stale (graphs per thread count: the
#: child builds every count the server's governor may pick)
CACHE_LAYOUT = "a graph per kind and thread count"


def warm_key(settings: dict) -> str:
    """The marker's name for these settings (``dataclasses.asdict`` of the ServerArgs) -> hex digest."""
    kept = {k: v for k, v in sorted(settings.items()) if k not in NOT_IN_KEY}
    text = json.dumps([torch.__version__, __version__, CACHE_LAYOUT, kept], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def marker_path(settings: dict) -> str:
    """Where the child marks a warm cache for these settings (inside inductor's cache folder: a cache cleared with
    its folder takes its markers along)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), MARKER_DIR, warm_key(settings) + ".done")


def child_settings(args, max_total_tokens: int) -> dict:
    """The child's ServerArgs fields: the server's, background compile without a warmer of its own, one replica, the
    server's KV capacity (the K/V pool is a graph input: its size is in a graph's cache key), and no API keys (the
    child serves nobody, and its command line is visible to every user of the machine)."""
    settings = dataclasses.asdict(args)
    settings.update(torch_compile_in_background=True, enable_torch_compile=True, disable_torch_compile_warmer=True,
                    dp_size=1, max_total_tokens=max_total_tokens, skip_server_warmup=True, api_key=None,
                    admin_api_key=None)
    return settings


class CacheWarmer:
    """The child process filling the cache; ``done`` is set when it has exited (either way)."""

    def __init__(self, proc: subprocess.Popen, log_path: str, marker: str) -> None:
        self.proc = proc
        self.log_path = log_path
        self.marker = marker
        self.started = time.monotonic()
        self.done = threading.Event()
        self.ok = False
        threading.Thread(target=self._watch, name="specserve-compile-warmer", daemon=True).start()

    def _watch(self) -> None:
        rc = self.proc.wait()
        self.ok = rc == 0 and os.path.exists(self.marker)
        took = time.monotonic() - self.started
        if self.ok:
            logger.info("torch.compile: the child process filled the cache in %.0f s; building the graphs", took)
        elif rc < 0:
            logger.info("torch.compile: the cache-filling child process was stopped (signal %d)", -rc)
        else:
            logger.warning("torch.compile: the cache-filling child process failed (exit %d after %.0f s, its log: "
                           "%s); the graphs are built in this process", rc, took, self.log_path)
        self.done.set()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()


def start_cache_warmer(args, max_total_tokens: int) -> CacheWarmer | None:
    """A child process filling torch.compile's cache for these settings, or None when a child already did (its
    marker is there)."""
    settings = child_settings(args, max_total_tokens)
    marker = marker_path(settings)
    if os.path.exists(marker):
        logger.info("torch.compile: the cache is warm for these settings (%s)", marker)
        return None
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    fd, log_path = tempfile.mkstemp(prefix="specserve-compile-warm-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.warm_compile", json.dumps(settings), marker],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child_setup)
    logger.info("torch.compile: a child process (pid %d, niced) fills the cache first; until it is done every forward "
                "runs eager", proc.pid)
    return CacheWarmer(proc, log_path, marker)


def _child_setup() -> None:
    """In the child before it runs Python: a low CPU priority (``CHILD_NICE``), and (Linux) killed when the server
    process dies, so a killed server leaves no child compiling."""
    os.nice(CHILD_NICE)
    die_with_parent()

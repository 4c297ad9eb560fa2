"""The server's handle on the model worker process: start it, send to it, read from it, stop it."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from specserve.config import ServerArgs

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0


class WorkerStartError(RuntimeError):
    """The worker could not load the model (bad path, too little memory, ...); the message says why."""


class WorkerProcess:
    def __init__(self, args: ServerArgs, replica: int = 0) -> None:
        """Starts ``python -m specserve.server.worker`` (replica `replica` of --dp-size) and sends it the
        configuration (returns at once)."""
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        self.replica = replica
        self.proc = subprocess.Popen([sys.executable, "-m", "specserve.server.worker", str(fd), str(replica)],
                                     pass_fds=[fd])
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.send(args)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def wait_ready(self, timeout: float | None = None) -> dict:
        """Blocks until the worker has loaded the model; returns its model info or raises WorkerStartError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if self.proc.poll() is not None:
                raise WorkerStartError(f"the model worker exited with code {self.proc.returncode} while starting")
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise WorkerStartError(f"the model worker did not start within {timeout:.0f}s")
        try:
            kind, payload = self.conn.recv()
        except EOFError as e:
            raise WorkerStartError("the model worker exited while starting") from e
        if kind == "error":
            self.stop()
            raise WorkerStartError(payload)
        return payload

    def start_reader(self, on_message: Callable[[tuple], None], on_exit: Callable[[], None]) -> None:
        """Reads the worker's messages on a thread; on_message/on_exit are called on that thread."""

        def run() -> None:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    break
                on_message(msg)
            on_exit()

        self._reader = threading.Thread(target=run, name="specserve-worker-reader", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Asks the worker to exit and waits; kills it if it does not. Returns its exit code."""
        if self.proc.poll() is None:
            try:
                self.send(("stop", None))
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the model worker did not stop within %.0fs; killing it", timeout)
                self.kill()
        if self._reader is not None:  # the worker is gone, so the reader sees EOF and ends
            self._reader.join(timeout=5)
        self.conn.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

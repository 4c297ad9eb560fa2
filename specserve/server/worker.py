"""The model worker: the scheduler loop in its own process, so the model never blocks the HTTP front end.

Started by the server as ``python -m specserve.server.worker FD REPLICA`` where FD is its end of a socket pair
(``multiprocessing.connection.Connection``) and REPLICA its index among --dp-size replicas (pinned to its share of
the CPUs when there are several). It runs the very ``Scheduler`` and ``SchedulerLoop`` the
offline Engine uses; only delivery differs: each step's outputs go back as one message.

Messages (small picklable tuples):

    server -> worker   (args: ServerArgs)                  first message: the configuration
                       ("add", [ReqSpec, ...])              new requests (already tokenized and validated)
                       ("abort", rid)                       abort one request; frees its KV
                       ("call", call_id, name)              run a named query/command on the loop thread
                       ("stop", None)                       exit
    worker -> server   ("ready", info dict) | ("error", message)   once, after loading the model
                       ("out", [ReqOutput, ...])            one step's outputs (token id deltas)
                       ("reply", call_id, ok, value)

Detokenization happens in the server process, except for requests with stop strings (the scheduler must
see their text to find the stops; see ``frontend.py``), so the worker loads the tokenizer for those only.
The worker exits when the server says stop or when the connection closes (the server died); on Linux it
also asks the kernel to kill it if its parent dies.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from specserve.config import ServerArgs
from specserve.engine import SchedulerLoop, _server_info, build_scheduler, grammar_backend, load_tokenizer
from specserve.models.loader import dtype_name
from specserve.parallel.ranks import pin
from specserve.request import Req, ReqOutput
from specserve.sampling.detokenizer import StopChecker
from specserve.sampling.params import SamplingParams
from specserve.scheduler.scheduler import Scheduler
from specserve.utils import die_with_parent

logger = logging.getLogger(__name__)

LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"


@dataclass
class ReqSpec:
    """A scheduler request as a small picklable message (a Req holds a generator and a detokenizer)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]
    seed: int | None  # the request's generator seed; None for greedy requests (no generator)
    stream: bool = True  # False: the server reads only the finished result (see Req.stream)

    @classmethod
    def from_req(cls, req: Req) -> ReqSpec:
        seed = req.generator.initial_seed() if req.generator is not None else None
        return cls(req.rid, req.origin_input_ids, req.params, req.stop_ids, seed, req.stream)

    def to_req(self, tokenizer, device: torch.device) -> Req:
        gen = None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)
        checker = StopChecker(tokenizer, self.params) if self.params.has_text_stops else None
        req = Req(self.rid, self.input_ids, self.params, self.stop_ids, gen, checker)
        req.stream = self.stream
        return req


def runtime_state(s: Scheduler) -> dict:
    """What /get_server_info and /metrics report: the Engine's server info and the worker's pid."""
    return {**_server_info(s), "worker_pid": os.getpid()}


CALLS = {
    "server_info": runtime_state,
    "flush_cache": lambda s: s.flush_cache(),
}


class _Sender:
    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def __call__(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send(msg)


class _ReplyBox:
    """Stands in for SchedulerLoop.call's queue: the loop thread's put() sends the reply to the server."""

    def __init__(self, call_id: int, send: _Sender) -> None:
        self.call_id, self.send = call_id, send

    def put(self, item: tuple[bool, Any]) -> None:
        ok, value = item
        self.send(("reply", self.call_id, ok, value if ok else f"{type(value).__name__}: {value}"))


class WorkerLoop(SchedulerLoop):
    """SchedulerLoop whose outputs leave as one message per step instead of per-request callbacks."""

    def __init__(self, scheduler: Scheduler, send: _Sender, grammar=None) -> None:
        self.send = send
        super().__init__(scheduler, grammar)

    def _dispatch(self, outputs: list[ReqOutput]) -> None:
        if outputs:
            self.send(("out", outputs))

    def fatal(self, message: str) -> None:
        """The worker exits (its requests were ended with the message): the server sees it gone and stops."""
        logger.error("the model worker exits: %s", message)
        logging.shutdown()
        os._exit(1)


def serve(conn: Connection, loop: WorkerLoop, tokenizer, device: torch.device) -> None:
    """Forward the server's messages into the loop's inbox until stop or the server goes away."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            logger.info("the server closed the connection; exiting")
            return
        kind = msg[0]
        if kind == "add":
            loop.inbox.put(("add", [spec.to_req(tokenizer, device) for spec in msg[1]]))
        elif kind == "abort":
            loop.inbox.put(("abort", msg[1]))
        elif kind == "call":
            _, call_id, name = msg
            loop.inbox.put(("call", (CALLS[name], _ReplyBox(call_id, loop.send))))
        elif kind == "stop":
            return


def model_info(s: Scheduler, tokenizer) -> dict:
    runner = s.runner
    eos = set(runner.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return {
        "model_dir": runner.model_dir,
        "architecture": runner.spec.architecture,
        "context_length": runner.context_len,
        "vocab_size": runner.spec.vocab_size,
        "max_total_tokens": runner.max_total_tokens,
        "max_running_requests": runner.max_running_requests,
        "eos_token_ids": sorted(eos),
        "device": str(runner.device),
        "dtype": dtype_name(runner.dtype),
        "worker_pid": os.getpid(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    conn = Connection(int(argv[0]))
    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole group (Ctrl-C, systemd stop, timeout)
        signal.signal(sig, signal.SIG_IGN)     # must not cut in-flight requests: the server drains, then stops us
    args: ServerArgs = conn.recv()
    replica = int(argv[1]) if len(argv) > 1 else 0
    share = pin(replica, args.dp_size) if args.dp_size > 1 else None  # before torch sizes its threads; TP ranks
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)  # split this share between them
    logging.getLogger("specserve").setLevel(args.log_level.upper())
    if share is not None:
        logger.info("replica %d of %d pinned to CPUs %s", replica, args.dp_size, share)
    send = _Sender(conn)
    try:
        scheduler = build_scheduler(args)
        tokenizer = load_tokenizer(args, scheduler.runner.model_dir)
    except Exception as e:  # noqa: BLE001 - report any load failure to the server, which prints it
        send(("error", f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)))
        return 1
    loop = WorkerLoop(scheduler, send, grammar_backend(args, tokenizer, scheduler.runner.spec.vocab_size))
    send(("ready", model_info(scheduler, tokenizer)))
    try:
        serve(conn, loop, tokenizer, scheduler.device)
    finally:
        loop.stop()
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Start the HTTP server: ``python -m specserve.launch_server --model-path PATH [--port 30000] [...]``.

Same flags as ``sglang.launch_server`` (generated from ``ServerArgs``; ``--help`` lists them). Start-up
order: validate the flags, bind the port, start the model worker and load the tokenizer, then serve;
any failure before serving exits with code 2 and one line naming the flag or the problem. When the model
is loaded and the port is listening, one line with the URL is logged.

SIGTERM / SIGINT: the listening socket closes (new connections are refused, new requests on open
connections get 503, and requests still sending their body are cut with 503), in-flight requests run to completion
(at most ``--graceful-shutdown-timeout`` seconds, then they are cut), the worker is stopped and the process exits 0
leaving no child process.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from collections.abc import Callable

import uvicorn

from specserve.args import add_server_args, server_args_from
from specserve.config import LOG_LEVELS, ConfigError, ServerArgs
from specserve.server.worker import LOG_FORMAT

logger = logging.getLogger("specserve.server")


def parse_args(argv: list[str] | None, prog: str,
               default_model: Callable[[argparse.Namespace], None] | None) -> ServerArgs:
    p = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP (OpenAI-compatible API, "
                                "SGLang's native /generate).")
    add_server_args(p)
    ns = p.parse_args(argv)
    if ns.model_path is None:
        if default_model is None:
            raise ConfigError("--model-path is required")
        default_model(ns)  # fills ns.model_path (and may choose speculative defaults)
    return server_args_from(ns)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    logging.getLogger("specserve").setLevel(level.upper())


def uvicorn_log_level(level: str) -> str:
    """uvicorn's own start-up/shutdown lines only when debugging: the ready line is ours."""
    return "debug" if level == "debug" else max(level, "warning", key=LOG_LEVELS.index)


def bind_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def server_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(args: ServerArgs) -> int:
    from specserve.server.app import create_app
    from specserve.server.manager import RequestManager
    from specserve.server.worker_client import WorkerStartError

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: --port {args.port}: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    try:
        manager = RequestManager(args)
    except (WorkerStartError, ConfigError, ValueError) as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(manager)
    config = uvicorn.Config(app, log_config=None, log_level=uvicorn_log_level(args.log_level),
                            access_log=args.log_level == "debug", lifespan="on",
                            timeout_graceful_shutdown=args.graceful_shutdown_timeout)
    server = _Server(config, manager, server_url(args.host, args.port))
    manager.on_worker_exit = server.request_exit
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal it drained on: already handled
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if manager.worker_failed:
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn.Server that logs the ready line and starts draining on SIGTERM/SIGINT."""

    def __init__(self, config: uvicorn.Config, manager, url: str) -> None:
        super().__init__(config)
        self.manager, self.url = manager, url

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            logger.info("specserve is ready at %s (model %r; OpenAI API at %s/v1)", self.url,
                        self.manager.served_model_name, self.url)

    def handle_exit(self, sig, frame) -> None:
        if not self.manager.draining:
            logger.info("received %s: draining %d in-flight requests, refusing new ones",
                        signal.Signals(sig).name, self.manager.num_inflight)
        self.manager.draining = True  # at once; the event that cuts body reads is set on the loop
        loop = self.manager.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.manager.start_draining)
        super().handle_exit(sig, frame)

    def request_exit(self) -> None:
        self.should_exit = True


def main(argv: list[str] | None = None, prog: str = "python -m specserve.launch_server",
         default_model: Callable[[argparse.Namespace], None] | None = None) -> int:
    try:
        args = parse_args(argv, prog, default_model)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    if args.node_rank > 0:  # this node runs its tensor-parallel ranks for node 0, which serves
        from specserve.parallel.ranks import run_node

        logger.info("node %d of %d: running tensor-parallel ranks for %s", args.node_rank, args.nnodes,
                    args.dist_init_addr)
        run_node(args)
        return 0
    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())

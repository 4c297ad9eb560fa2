"""Command line: ``specserve generate``, ``specserve serve``, ``specserve build-token-map``,
``specserve eval-acceptance`` (and, as they land, benchmarks, training).

Flags are generated from the ``ServerArgs`` dataclass (``specserve.args``), so the help text, the defaults and the
validation live in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from specserve.args import add_server_args, serve_demo, server_args_from, use_demo
from specserve.config import ConfigError
from specserve.train.cli import COMMANDS as TRAIN_COMMANDS


def cmd_generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="specserve generate", description="Generate a completion offline.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--demo", action="store_true", help="use the default model (as without --model-path)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    add_server_args(p)
    ns = p.parse_args(argv)
    if ns.demo or ns.model_path is None:
        use_demo(ns)
    try:
        args = server_args_from(ns)
        from specserve.engine import Engine

        engine = Engine(**dataclasses.asdict(args))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
    start = time.perf_counter()
    try:
        if ns.stream:
            meta = {}
            print(ns.prompt, end="", flush=True)
            for chunk in engine.generate(ns.prompt, params, stream=True):
                print(chunk["text"], end="", flush=True)
                meta = chunk["meta_info"]
            print()
        else:
            out = engine.generate(ns.prompt, params)
            print(ns.prompt + out["text"])
            meta = out["meta_info"]
    finally:
        engine.shutdown()
    dt = time.perf_counter() - start
    n = meta.get("completion_tokens", 0)
    accept = f", accept length {meta['spec_accept_length']:.2f}" if "spec_accept_length" in meta else ""
    print(f"[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s{accept}, finish: {meta.get('finish_reason')}]",
          file=sys.stderr)
    return 0


def cmd_build_token_map(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="specserve build-token-map",
        description="Write an FR-Spec token map (--speculative-token-map): the N most frequent target token ids "
                    "over a corpus. Plain-text files are read as is; .jsonl files hold one record per line with "
                    "chat 'messages' or ShareGPT 'conversations' (rendered with the chat template) or 'text'.",
    )
    p.add_argument("--model", "--model-path", dest="model", required=True, help="target model folder (tokenizer "
                   "and config.json are read, not the weights)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--corpus", nargs="+", required=True, help="corpus files (.txt or anything else: plain text; "
                   ".jsonl: chat records)")
    p.add_argument("--size", type=int, required=True, help="number of hot token ids N (e.g. 32768)")
    p.add_argument("--out", default=None, help="output file (default: freq_N.pt)")
    p.add_argument("--no-eos", action="store_true", help="do not force the target's EOS ids into the map")
    ns = p.parse_args(argv)
    from specserve.models.loader import ModelLoadError
    from specserve.speculative.token_map import build_token_map, save_token_map

    out = ns.out or f"freq_{ns.size}.pt"
    missing = [f for f in ns.corpus if not os.path.isfile(f)]
    if missing:
        print(f"error: --corpus: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        ids = build_token_map(ns.model, ns.corpus, ns.size, include_eos=not ns.no_eos,
                              tokenizer_path=ns.tokenizer_path)
    except (OSError, ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_token_map(ids, out)
    print(f"wrote {ids.numel()} hot token ids to {out}", file=sys.stderr)
    return 0


def cmd_serve(argv: list[str]) -> int:
    """``specserve serve``: ``python -m specserve.launch_server``, serving the demo model without --model-path."""
    from specserve.launch_server import main as launch_main

    return launch_main(argv, prog="specserve serve", default_model=serve_demo)


def cmd_eval_acceptance(argv: list[str]) -> int:
    """``specserve eval-acceptance``: accept length / per-position rates and speed vs plain decoding."""
    from specserve.bench.eval_acceptance import main as eval_main

    return eval_main(argv)


def _bench(module: str):
    """A benchmark command living in ``specserve.bench.<module>`` (imported only when run)."""
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(f"specserve.bench.{module}").main(argv)

    return run


COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "build-token-map": cmd_build_token_map,
            "eval-acceptance": cmd_eval_acceptance, "bench-speculative": _bench("bench_speculative"),
            "bench-serving": _bench("bench_serving"), "bench-compare": _bench("bench_compare"),
            "eval-head": _bench("eval_head")}
COMMANDS.update(TRAIN_COMMANDS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: specserve {" + ",".join(COMMANDS) + "} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

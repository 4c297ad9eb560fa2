"""Speculative decoding: draft trees (tree.py) and their verification (verify.py), as pure tensor functions."""

from specserve.speculative.tree import (
    DraftTree,
    EagleCandidates,
    LevelExpansion,
    build_chain,
    build_tree,
    cap_depth,
    drafting_can_stop,
    expand_level,
    select_eagle_tree,
)
from specserve.speculative.verify import (
    VerifyResult,
    race_node_ids,
    verify_greedy,
    verify_sampling,
    verify_sampling_with_coins,
)

__all__ = [
    "DraftTree",
    "EagleCandidates",
    "LevelExpansion",
    "VerifyResult",
    "build_chain",
    "build_tree",
    "cap_depth",
    "drafting_can_stop",
    "expand_level",
    "race_node_ids",
    "select_eagle_tree",
    "verify_greedy",
    "verify_sampling",
    "verify_sampling_with_coins",
]

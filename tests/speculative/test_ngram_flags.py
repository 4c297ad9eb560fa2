"""--speculative-ngram-* validation cases beyond tests/unit/test_config_cli.py, and the flags -> cache mapping."""

from __future__ import annotations

import pytest

from specserve.config import ConfigError, ServerArgs
from specserve.speculative.ngram_cache import NgramCache


@pytest.mark.parametrize("overrides,flag", [
    (dict(speculative_ngram_min_match_window_size=0), "--speculative-ngram-min-match-window-size"),
    (dict(speculative_ngram_min_bfs_breadth=0), "--speculative-ngram-min-bfs-breadth"),
    (dict(speculative_ngram_capacity=0), "--speculative-ngram-capacity"),
])
def test_zero_ngram_sizes_are_rejected_naming_the_flag(overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerArgs(speculative_algorithm="NGRAM", **overrides).validate()


def test_ngram_flags_are_not_checked_without_ngram():
    args = ServerArgs(speculative_ngram_branch_length=1)
    assert args.validate() is args


def test_validated_flags_build_a_cache():
    # match type is case-insensitive on the command line; N defaults to the max window (12) -> 11 draft nodes
    args = ServerArgs(speculative_algorithm="ngram", speculative_ngram_match_type="prob").validate()
    cache = NgramCache.from_server_args(args, args.speculative_num_draft_tokens)
    assert (cache.match_type, cache.max_window, cache.branch_length, cache.max_draft_nodes) == ("PROB", 12, 18, 11)

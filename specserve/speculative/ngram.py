"""NGRAM proposer (``--speculative-algorithm NGRAM``): no draft model; drafts come from an n-gram trie of token
sequences seen before (``ngram_cache.NgramCache``, shared by all requests), verified by the target like every
other method (lossless).

- after a request's prompt is fully prefilled, its prompt + first token are inserted (prompt lookup works from
  the first step); after every verify step, the n-grams ending in the new tokens are inserted;
- ``propose`` matches each request's recent tokens (suffix windows from the max match window down) and turns
  the matched continuations into a tree (at most N - 1 nodes below the root). A request with no match gets a
  root-only tree: its verify row is exactly a plain decode step (one token, no padding forwarded).
- the cache's storage grows with use (``--speculative-ngram-capacity`` is a cap, not an allocation); a warning
  names the flag when a full cache would take a large share of the machine's RAM (see ``ngram_cache``);
- ``SGLANG_NGRAM_FORCE_GREEDY_VERIFY=True`` (or ``SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY``) verifies sampled
  requests by argmax, as SGLang does: faster acceptance, but NOT lossless for temperature > 0 (documented).
"""

from __future__ import annotations

import logging

import torch

from specserve.flags import ConfigError, env_flag, require_choice, require_positive
from specserve.platform.cpu.cpus import physical_ram_bytes
from specserve.speculative.base import PrefillChunk, Proposer, VerifiedStep
from specserve.speculative.batch_policy import TreeShape
from specserve.speculative.ngram_cache import NgramCache, capacity_memory_warning
from specserve.speculative.tree import DraftTree, build_tree

logger = logging.getLogger(__name__)

FORCE_GREEDY_ENV = ("SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY", "SGLANG_NGRAM_FORCE_GREEDY_VERIFY")


def force_greedy_verify_from_env() -> bool:
    return env_flag(FORCE_GREEDY_ENV)


NGRAM_POSITIVE = ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
                  "speculative_ngram_min_bfs_breadth", "speculative_ngram_max_bfs_breadth",
                  "speculative_ngram_branch_length", "speculative_ngram_capacity")


class NgramProposer(Proposer):
    @classmethod
    def check_args(cls, args) -> None:
        """The n-gram flags' ranges; --speculative-num-draft-tokens defaults to the max match window."""
        for n in NGRAM_POSITIVE:
            require_positive(args, n)
        args.speculative_ngram_match_type = args.speculative_ngram_match_type.upper()
        require_choice(args, "speculative_ngram_match_type", ("BFS", "PROB"))
        lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
        branch = args.speculative_ngram_branch_length
        if branch <= 1:
            raise ConfigError(f"--speculative-ngram-branch-length must be > 1, got {branch}")
        if not lo <= hi < branch:
            raise ConfigError(
                "--speculative-ngram-max-match-window-size: need 0 < min window <= max window < branch length; "
                f"got min {lo}, max {hi}, branch length {branch}"
            )
        if args.speculative_ngram_min_bfs_breadth > args.speculative_ngram_max_bfs_breadth:
            raise ConfigError(
                "--speculative-ngram-min-bfs-breadth must be <= --speculative-ngram-max-bfs-breadth, got "
                f"{args.speculative_ngram_min_bfs_breadth} > {args.speculative_ngram_max_bfs_breadth}"
            )
        if args.speculative_num_draft_tokens is None:
            args.speculative_num_draft_tokens = hi
        elif args.speculative_num_draft_tokens < 2:
            raise ConfigError("--speculative-num-draft-tokens must be >= 2 (the root plus at least one draft)")

    def __init__(self, args, runner, kv) -> None:
        self.device = runner.device
        self.num_draft_tokens = args.speculative_num_draft_tokens
        self.cache = NgramCache.from_server_args(args, self.num_draft_tokens)
        self.window = args.speculative_ngram_max_match_window_size
        warning = capacity_memory_warning(self.cache.capacity, self.cache.match_type, physical_ram_bytes())
        if warning:
            logger.warning("NGRAM: %s", warning)
        self.force_greedy_verify = force_greedy_verify_from_env()
        if self.force_greedy_verify:
            logger.warning("NGRAM: force-greedy verification is on: sampled requests are verified by argmax (lossy)")

    def after_prefill(self, chunks: list[PrefillChunk], out) -> None:
        for c in chunks:
            if c.completed and not c.req.finished:
                self.cache.insert(c.req.fill_ids)

    def after_verify(self, steps: list[VerifiedStep], out) -> None:
        for s in steps:
            self.cache.insert(s.req.fill_ids, num_new=len(s.new_tokens))

    def forget(self) -> None:
        self.cache.reset()

    def propose(self, reqs, shape: TreeShape | None = None) -> DraftTree:
        matches = self.cache.batch_match([r.fill_ids[-self.window:] for r in reqs])
        if shape is not None and shape.num_draft_tokens < self.num_draft_tokens:  # batch-aware shrinking
            keep = shape.num_draft_tokens - 1  # candidates are in topological order: a prefix is a tree
            matches = [(toks[:keep], pars[:keep]) for toks, pars in matches]
        width = max(1, max(len(toks) for toks, _ in matches))
        tokens = torch.zeros(len(reqs), width, dtype=torch.int64)
        parents = torch.zeros(len(reqs), width, dtype=torch.int64)
        for b, (toks, pars) in enumerate(matches):
            if toks:
                tokens[b, : len(toks)] = torch.tensor(toks)
                parents[b, : len(pars)] = torch.tensor(pars) + 1  # build_tree: 0 = root, node i+1 = candidate i
        num_nodes = torch.tensor([len(t) + 1 for t, _ in matches])
        roots = torch.tensor([r.last_token for r in reqs], dtype=torch.int64)
        return build_tree(roots.to(self.device), tokens.to(self.device), parents.to(self.device),
                          num_nodes.to(self.device))

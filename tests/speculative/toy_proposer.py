"""A toy speculative algorithm, written the way docs/extending.md describes: one Proposer subclass, registered
under a name (here at run time; a package would use the entry point). It drafts by 1-gram lookup in the request's
own tokens: the tokens that followed the last earlier occurrence of its last token."""

from __future__ import annotations

import torch

from specserve.speculative.base import Proposer
from specserve.speculative.tree import DraftTree, build_chain


class LookupProposer(Proposer):
    def __init__(self, args, runner, kv) -> None:
        self.device = runner.device
        self.num_draft_tokens = args.speculative_num_draft_tokens

    @classmethod
    def check_args(cls, args) -> None:
        if args.speculative_num_draft_tokens is None:
            args.speculative_num_draft_tokens = 4

    def propose(self, reqs, shape=None) -> DraftTree:
        n = self.num_draft_tokens if shape is None else shape.num_draft_tokens
        drafts = [continuation(r.fill_ids, n - 1) for r in reqs]  # up to n - 1 tokens each
        width = max(1, max(len(d) for d in drafts))
        tokens = torch.zeros(len(reqs), width, dtype=torch.int64)  # [B, width]
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
        roots = torch.tensor([r.last_token for r in reqs], dtype=torch.int64)  # [B]
        num_nodes = torch.tensor([len(d) + 1 for d in drafts])  # [B] root included
        return build_chain(roots.to(self.device), tokens.to(self.device), num_nodes.to(self.device))


def continuation(ids: list[int], k: int) -> list[int]:
    """The at most k tokens after the last earlier occurrence of ids[-1] (none when it did not occur)."""
    last = ids[-1]
    for i in range(len(ids) - 2, -1, -1):
        if ids[i] == last:
            return ids[i + 1 : i + 1 + k]
    return []

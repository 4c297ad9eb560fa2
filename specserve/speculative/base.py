"""The proposer interface every speculative algorithm implements (``specserve.speculative.registry`` picks one).

One speculative decode step (driven by ``specserve.scheduler.spec_decode.SpecDecoder``):

    propose(reqs) -> DraftTree            the drafter's candidate tree per request (node 0 = the root token)
    target verify forward over the tree   one forward, tree attention mask, logits at every node
    verify -> accepted path + bonus token commit the accepted nodes' KV slots, free the rest
    after_verify(...)                     the drafter catches up on the accepted tokens (draft extend)

and after each prefill forward ``after_prefill(...)`` seeds the drafter. The scheduler never branches on the
algorithm's name: everything algorithm-specific sits behind this interface, one file per algorithm.

KV invariant between steps, for every running request: the target's KV holds positions ``0 .. seq_len - 2``;
the root (the last token, ``req.last_token`` at position ``seq_len - 1``) is the first input of the next
verify forward. A drafter with its own KV cache uses the SAME slot indices as the target (``req_to_token``),
so committing or freeing slots after verification is one operation for both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.flags import ConfigError

if TYPE_CHECKING:
    import torch

    from specserve.models.llama import ModelOutput
    from specserve.platform import PlatformPolicy
    from specserve.request import Req
    from specserve.speculative.batch_policy import TreeShape
    from specserve.speculative.tree import DraftTree


# Table columns (and RoPE positions) past a step's tree for the tokens a grammar forces (structured outputs'
# jump-forward, SpecDecoder._jump_forward), which go into the KV slots of drafting's scratch.
GRAMMAR_ROOM = 8

@dataclass(frozen=True)
class DraftMemory:
    """Memory a drafter allocates beside the target: its weights and its KV cache per token slot, and the dtype a
    separate draft model is loaded in (sized here, so the drafter loads it in that dtype; None: no such model)."""

    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    dtype: torch.dtype | None = None


@dataclass
class PrefillChunk:
    """One request's rows in a prefill forward: positions [start, start + length) were computed."""

    req: Req
    start: int
    length: int
    row_offset: int  # first row of this request in the forward's flattened [T] token rows
    completed: bool  # the prompt is fully prefilled (and a first token was sampled) in this forward


@dataclass
class VerifiedStep:
    """What one verify step did for one request (input to ``Proposer.after_verify``)."""

    req: Req
    root_pos: int  # position of the root (its KV was computed by the verify forward)
    accepted_nodes: list[int]  # tree node ids of the accepted path, root first (accepted draft count + 1)
    new_tokens: list[int]  # tokens appended after this step (may be trimmed by a finish)
    row_offset: int  # first row of this request's nodes in the verify forward's [B*N] rows


class Proposer(ABC):
    """Drafts candidate trees for a batch of requests. Subclasses live one per file in ``specserve/speculative``,
    and ``specserve.speculative.registry`` maps each --speculative-algorithm name to one.

    The class methods are the algorithm's start-up rules, which the registry calls before any model is loaded:
    ``check_args`` (its flags), ``default_tree`` (its draft tree when none is given), ``lookahead`` (how far past a
    request's last token a step writes) and ``select`` (a more specific class for this target, e.g. EAGLE -> MTP)."""

    #: nodes verified per request per step, root included (``--speculative-num-draft-tokens``)
    num_draft_tokens: int
    #: residual-stream layers the target must capture in prefill and verify forwards (EAGLE-3)
    capture_layers: tuple[int, ...] = ()
    #: verify sampled requests by argmax too (NGRAM's documented lossy switch); False = lossless
    force_greedy_verify: bool = False
    #: trees drafted with draft-model levels beyond the first (EAGLE family), and those levels' forwards: up to
    #: steps - 1 per tree, fewer where drafting stopped early; both stay 0 for drafters without levels (NGRAM)
    draft_trees: int = 0
    draft_forwards: int = 0
    #: structured outputs: the grammar states the last ``propose`` drafted through, one per request of that call
    #: (``PathStates``; None for a request drafted without its grammar, or the whole list None), which the verify
    #: step's tree reshaping (``masks.jump_forward``) reuses; the scheduler clears it after the step
    grammar_walks: list | None = None

    #: --speculative-draft-model-path must be given
    needs_draft_model: bool = False

    # ------------------------------------------------------------------ start-up rules (class methods)
    @classmethod
    def check_args(cls, args) -> None:
        """Check (and normalize) this algorithm's flags at start-up; raise ConfigError naming the flag."""
        if cls.needs_draft_model and not args.speculative_draft_model_path:
            raise ConfigError(
                f"--speculative-draft-model-path is required with --speculative-algorithm {args.speculative_algorithm}"
            )

    @classmethod
    def default_tree(cls, args, architecture: str) -> tuple[int, int, int] | None:
        """(num_steps, eagle_topk, num_draft_tokens) when the user gave no tree flags; None leaves them unset."""
        return None

    @classmethod
    def lookahead(cls, args) -> int:
        """Table columns past a request's root one step may write (draft scratch, then verify nodes, grammar-forced
        nodes included)."""
        steps, topk = args.speculative_num_steps or 1, args.speculative_eagle_topk or 1
        return max(args.speculative_num_draft_tokens or 1, steps * topk) + 1 + GRAMMAR_ROOM

    @classmethod
    def select(cls, args, target_spec) -> type[Proposer]:
        """The class that drafts for this target (default: this one)."""
        return cls

    @classmethod
    def memory_cost(cls, args, target_spec, target_dtype: torch.dtype, platform: PlatformPolicy) -> DraftMemory:
        """What this drafter will allocate beside the target, known before it is built (the target's KV capacity
        is sized from what is left): none by default."""
        return DraftMemory()

    def draft_slots_per_request(self) -> int:
        """KV slots per request drafting needs beside the tree's nodes (scratch, and any it holds between steps)."""
        return 0

    def scratch_slots_per_request(self) -> int:
        """The part of draft_slots_per_request that is free again by the verify forward (drafting's scratch)."""
        return 0

    def max_positions_ahead(self) -> int:
        """How far past a request's root position drafting and verification write (for RoPE/table sizes)."""
        return self.num_draft_tokens + GRAMMAR_ROOM

    def after_prefill(self, chunks: list[PrefillChunk], out: ModelOutput) -> None:  # noqa: B027 - optional hook
        """Seed drafting state from a prefill forward (called after its tokens were sampled and appended)."""

    @abstractmethod
    def propose(self, reqs: list[Req], shape: TreeShape | None = None) -> DraftTree:
        """-> DraftTree with B = len(reqs) rows; tokens[:, 0] must be each request's root (last token).

        shape: the tree size for this step (batch-aware speculation shrinks it as the batch grows; never larger
        than the configured steps / topk / num_draft_tokens); None = the configured size."""

    def after_verify(self, steps: list[VerifiedStep], out: ModelOutput) -> None:  # noqa: B027 - optional hook
        """Catch up on the accepted tokens of the requests that keep running."""

    def release(self, req: Req) -> None:  # noqa: B027 - optional hook
        """Drop any per-request state (the request finished, was aborted or retracted)."""

    def forget(self) -> None:  # noqa: B027 - optional hook
        """Drop what earlier requests taught the drafter beyond their own state (the n-gram trie): after the
        scheduler's warm-up requests, whose made-up tokens no user's request should be drafted from."""

    def draft_modules(self) -> list:
        """The draft networks whose ``forward(fb, *tensors)`` may be compiled (``--enable-torch-compile``) and graphed
        (CUDA graphs)."""
        return []

"""PlatformPolicy: the device-specific tuning decisions of a serving process, in one object.

``platform_policy(args, device)`` makes it once at start-up (``Engine``, which hands it to ``ModelRunner``; a runner
handed none makes its own); ``ModelRunner`` keeps it as ``runner.platform`` and the code that sets up the process,
loads weights, sizes and runs drafts and attends asks it instead of testing the device itself. This base class is
the plain policy (CUDA and any other device): it answers "no" to every CPU-only tweak. ``cpu/policy.py``'s
``CpuPolicy`` says where they apply.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.platform.cpu.omp import release_thread_pool


class PlatformPolicy:
    def __init__(self, args, device: torch.device) -> None:
        self.args = args  # ServerArgs: the flags that switch tweaks off or size them
        self.device = device
        self._threads: int | None = None  # thread_target's count, read once (the forwards' thread lowers its own)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # ------------------------------------------------------------------ the process
    def tune_allocator(self) -> bool:
        """Set the C allocator up for serving; called before the model's tensors and the scheduler thread exist
        (``Engine``). -> whether the settings were applied."""
        return False

    def upkeep(self, idle: bool) -> None:
        """Called by the scheduler loop once per iteration (``idle``: it has nothing to run): periodic
        housekeeping of the process, such as handing a kept heap's free pages back (``cpu/malloc.py``)."""

    def configure_threads(self) -> None:
        """Set torch's thread count for the forwards (``--num-threads``); called before the model loads."""

    def apply_threads(self) -> None:
        """Give the calling thread, about to run forwards, the thread count in force; called before each step."""

    def thread_target(self) -> int:
        """The OpenMP thread count the next forward should run with (torch.compile's background builds key their
        graphs by it: dynamo guards on the count): here the count the first caller had."""
        if self._threads is None:
            self._threads = torch.get_num_threads()
        return self._threads

    def thread_counts(self) -> tuple[int, ...]:
        """Every count ``thread_target`` may return while serving (the background compiler builds graphs for these
        only)."""
        return (self.thread_target(),)

    def fix_threads(self, threads: int) -> None:
        """Run every later step at ``threads`` (the cache-filling child, building one count's graphs at a time); on
        the thread that runs the forwards."""
        self._threads = threads
        torch.set_num_threads(threads)

    def time_step(self, batch_size: int, seconds: float) -> None:
        """A decode step of ``batch_size`` requests took ``seconds`` (wall): what the thread count adapts to."""

    def info(self) -> dict:
        """What the policy reports in the server info (the CPU thread count and its changes)."""
        return {}

    def release_thread_pool(self) -> bool:
        """Free the calling thread's idle OpenMP workers (``cpu/omp.py``). Torch runs its host-side ops on OpenMP
        whatever the device, so every policy does it. -> True when the runtime did (or had nothing to free)."""
        return release_thread_pool()

    # ------------------------------------------------------------------ weights
    @property
    def packs_weights(self) -> bool:
        """Whether ``pack_weights`` changes anything."""
        return False

    def pack_weights(self, module: nn.Module) -> int:
        """Give the module's linears a faster layout for this device, in place. -> how many were changed."""
        return 0

    def kv_store(self):
        """An operator (k_buf, v_buf, slots, k, v) -> None writing a layer's K and V into a KV pool in one call, or
        None: the pool's index writes (``KVPool.store``)."""
        return None

    # ------------------------------------------------------------------ draft models
    def draft_dtype(self, target_dtype: torch.dtype, num_params: int) -> torch.dtype:
        """The dtype a draft model of ``num_params`` parameters runs in under a ``target_dtype`` target when
        ``--speculative-draft-dtype`` is auto: the target's."""
        return target_dtype

    def mixed_linears(self, draft_dtype: torch.dtype, target_dtype: torch.dtype) -> bool:
        """Whether a draft in ``draft_dtype`` under a ``target_dtype`` target gets mixed-precision linears
        (``mix_linears``), which hold a second, half-precision copy of their weights."""
        return False

    def mix_linears(self, module: nn.Module) -> int:
        """Replace the module's linears by mixed-precision ones, in place. -> how many."""
        return 0

    def draft_kv_dtype(self, draft_dtype: torch.dtype, target_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the KV of a draft in ``draft_dtype`` under a ``target_dtype`` target whose large forwards may
        run in another dtype than its own (EAGLE heads): the draft's own."""
        return draft_dtype

    def decode_rows(self, model: nn.Module) -> int | None:
        """The most rows a decode forward of ``model`` (one per request, plus tokens a grammar forced) may have and
        keep the host's fastest kernels, or None where more rows cost little more (no such limit)."""
        return None

    def runs_half_precision(self, rows: int) -> bool:
        """Whether a draft forward over ``rows`` tokens through mixed-precision linears runs in half precision."""
        return False

    def head_ranker(self, norm: nn.Module, lm_head: nn.Module | None):
        """A draft head's ranking of its next tokens in one call, where the host has one: f(hidden [R, h], k, scale,
        to_target [V] or None, race, allowed) -> (softmax(lm_head(norm(hidden)) * scale).topk(k) probabilities [R, k],
        ids [R, k] through to_target; race and allowed as ``DraftModel.topk``'s), or None for a call it does not take
        (``draft_topk.HeadTopk`` on CPU). None: the head's modules rank."""
        return None

    def race_walk(self):
        """Sampled verification's tree walk in one call, where the host has one: f(probs [B, N, V], tokens, parents,
        depth [B, N], num_nodes [B], keys [B, D+1, 2]) -> ``verify.VerifyResult``'s fields, what ``verify_greedy`` over
        ``race_node_ids`` gives (``race_walk.race_walk`` on CPU). None: those."""
        return None

    def head_levels(self, layer_hook, ranker, embedding: nn.Module | None):
        """An EAGLE-3 head's draft levels after the root's children in one call, where the host has one: its layer's
        ``fused`` hook, its ``head_ranker`` and the target's token embedding module -> f(root_p, root_ids, hidden,
        positions, k_buf, v_buf, scratch, kv_slots, base, scale, to_target, race, keep, threshold) -> the levels'
        (scores, tokens, parents), with ``fits(rows, k, k_buf, v_buf)`` (``draft_levels.HeadLevels`` on CPU). None:
        level by level."""
        return None

    # ------------------------------------------------------------------ attention
    def folds_query_heads(self, qb: torch.Tensor, n_kv: int, masked: bool) -> bool:
        """Whether padded queries qb [B, Qmax, H, D] over ``n_kv`` KV heads, with a mask other than plain causal
        (``masked``), are attended as G = H / n_kv rows per KV head (attention's ``_attend_folded``)."""
        return False

    def few_query_attention(self, qb: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor):
        """The host's own kernel for padded queries qb [B, Qmax, H, D] over the pools k_buf / v_buf [S, Hkv, D]
        (decode rows, verify trees, draft levels), called as f(qb, k_buf, v_buf, kv_slots, mask, scale)
        -> [B * Qmax, H * D]; None: attention runs SDPA."""
        return None

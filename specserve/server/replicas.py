"""Data parallelism inside one server (``--dp-size``): which replica takes a request, and their states as one.

Each replica is a model worker process of its own (``WorkerProcess``: model copy, KV cache, scheduler), pinned to
its share of the CPUs. The request manager sends each new request to one replica (``Balancer``), all samples of a
request to the same one (they share its prompt's KV), and reports the replicas' runtime states merged
(``merge_states``) with each one's under ``internal_states``, as SGLang lists its data-parallel ranks.
"""

from __future__ import annotations

import itertools

from specserve.speculative.accept_stats import position_rates

# additive fields of a worker's runtime state (scheduler.server_info): the server's figure is the replicas' sum
SUMMED = frozenset({
    "max_total_tokens", "max_total_num_tokens", "max_running_requests", "num_running_reqs", "num_waiting_reqs",
    "num_chunked_reqs", "free_slots", "radix_cached_tokens", "kv_locked_tokens", "free_req_rows", "num_retractions",
    "num_prefill_steps", "num_decode_steps", "num_mixed_steps", "generated_tokens", "cpu_threads",
    "cpu_thread_switches", "cpu_thread_probes", "cpu_heap_trims", "spec_verify_ct", "spec_plain_steps",
    "spec_shrunk_steps", "spec_overlapped_steps", "spec_trimmed_finishes", "spec_forced_tokens", "spec_draft_trees",
    "spec_draft_forwards", "grammar_compiles", "grammar_compile_seconds", "grammar_mask_calls",
    "grammar_mask_seconds", "grammar_checked_tokens", "grammar_check_refusals", "grammar_jump_forward_tokens",
    "spec_accepted_per_position",
})
# averages: the replicas' values weighted by the count they average over
WEIGHTED = {"avg_spec_accept_length": "spec_verify_ct", "spec_accept_rate": "spec_verify_ct",
            "kv_usage": "max_total_tokens"}
MAXED = frozenset({"grammar_compile_seconds_max", "cpu_threads_max"})


def merge_states(states: list[dict]) -> dict:
    """The runtime states of the replicas -> the server's: counts summed (lists element by element), averages
    weighted by what they average over, maxima the largest, and every other field (the configuration, the same in
    every replica) as the first replica has it."""
    if len(states) == 1:
        return dict(states[0])
    merged = dict(states[0])
    for key in merged:
        if key in SUMMED:
            merged[key] = _sum([s[key] for s in states])
        elif key in MAXED:
            merged[key] = max(s[key] for s in states)
        elif key in WEIGHTED:
            weights = [s[WEIGHTED[key]] for s in states]
            total = sum(weights)
            merged[key] = (sum(s[key] * w for s, w in zip(states, weights, strict=True)) / total if total
                           else states[0][key])
    if "spec_accepted_per_position" in merged:  # recomputed from the summed counts, as the scheduler computes it
        merged["spec_accept_rate_per_position"] = position_rates(merged["spec_accepted_per_position"],
                                                                 merged["spec_verify_ct"])
    merged["dp_size"] = len(states)
    return merged


def _sum(values: list):
    if isinstance(values[0], list):
        width = max(len(v) for v in values)
        return [sum(v[k] for v in values if k < len(v)) for k in range(width)]
    return sum(values)


class Balancer:
    """Picks the replica of each new request: ``round_robin`` in turn, or ``shortest_queue``, the one with the
    fewest samples in flight (the lowest index among equals)."""

    def __init__(self, replicas: int, method: str) -> None:
        self.method = method
        self.inflight = [0] * replicas  # samples sent and not finished, per replica
        self._turn = itertools.cycle(range(replicas))

    def pick(self, samples: int) -> int:
        """The replica that takes a request of `samples` samples (counted in flight there)."""
        if self.method == "shortest_queue":
            replica = min(range(len(self.inflight)), key=lambda i: self.inflight[i])
        else:
            replica = next(self._turn)
        self.inflight[replica] += samples
        return replica

    def finished(self, replica: int) -> None:
        """One sample on `replica` has finished."""
        self.inflight[replica] -= 1

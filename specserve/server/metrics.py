"""Prometheus metrics (``--enable-metrics``, served at ``/metrics``), measured in the server process.

Per request: finished requests by finish reason, prompt / generation / cached tokens, time to first token,
inter-token latency, end-to-end latency. Runtime state (running and queued requests, KV usage, and any
other number the model worker reports, e.g. ``avg_spec_accept_length``) is read from the worker at scrape
time and exported as gauges named ``specserve:<field>``. With speculative decoding, the worker's cumulative
speculative counts are also exported as counters (read at scrape time too; they only grow while the worker
lives, and the worker lives as long as the server): ``specserve:spec_verify_steps_total`` (verify steps, one
per request per step) and ``specserve:spec_accepted_tokens_per_position_total{position="k"}`` (verify steps
that accepted at least k drafted tokens; divided by the verify steps: the acceptance rate at draft depth k).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specserve.request import ReqOutput

PREFIX = "specserve:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                   0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
# worker state fields exported under SGLang's metric names
STATE_NAMES = {"num_waiting_reqs": "num_queue_reqs", "kv_usage": "token_usage"}
STATE_SKIP = {"worker_pid"}


def spec_counter_families(state: dict) -> list[CounterMetricFamily]:
    """The speculative counters of a worker state (none without speculative decoding)."""
    if "spec_accepted_per_position" not in state:
        return []
    steps = CounterMetricFamily(PREFIX + "spec_verify_steps", "Speculative verify steps (one per request per step)",
                                value=float(state["spec_verify_ct"]))
    per_pos = CounterMetricFamily(PREFIX + "spec_accepted_tokens_per_position",
                                  "Verify steps that accepted at least `position` drafted tokens", labels=["position"])
    for k, count in enumerate(state["spec_accepted_per_position"], start=1):
        per_pos.add_metric([str(k)], float(count))
    return [steps, per_pos]


class RuntimeStateCollector:
    """Exports every numeric field of the latest worker state as a gauge, and the speculative counters (read at
    scrape time)."""

    def __init__(self) -> None:
        self.state: dict = {}

    def collect(self):
        for key, value in sorted(self.state.items()):
            if key in STATE_SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = PREFIX + STATE_NAMES.get(key, key)
            yield GaugeMetricFamily(name, f"model worker state: {key}", value=float(value))
        yield from spec_counter_families(self.state)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "num_requests", "Finished generation requests (one per sample)",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(PREFIX + "num_rejected_requests", "Requests refused with 503", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish", buckets=E2E_BUCKETS,
                             registry=r)
        self.state = RuntimeStateCollector()
        r.register(self.state)
        self._last_token: dict[str, float] = {}  # rid -> time its latest token arrived

    def on_output(self, out: ReqOutput, start: float, now: float) -> None:
        """One worker output of a request that arrived at `start` (monotonic seconds)."""
        n = len(out.new_token_ids)
        if n:
            last = self._last_token.get(out.rid)
            if last is None:
                self.ttft.observe(now - start)
                last, n = now, n - 1  # the first token's latency is the TTFT; the rest share the gap
            for _ in range(n):
                self.itl.observe((now - last) / n)
            self._last_token[out.rid] = now
        if out.finished_reason is not None:
            self._last_token.pop(out.rid, None)
            self.requests.labels(out.finished_reason.get("type", "unknown")).inc()
            self.prompt_tokens.inc(out.prompt_tokens)
            self.generation_tokens.inc(out.completion_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self.e2e.observe(now - start)

    def render(self, state: dict, extra: dict | None = None) -> bytes:
        self.state.state = {**state, **(extra or {})}
        return generate_latest(self.registry)

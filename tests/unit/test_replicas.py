"""--dp-size's parts: the balancer's choices and the replicas' states merged, on hand-made states."""

import pytest

from specserve.config import ConfigError, ServerArgs
from specserve.server.replicas import Balancer, merge_states


def test_round_robin_takes_replicas_in_turn():
    b = Balancer(3, "round_robin")
    assert [b.pick(1) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_takes_the_replica_with_fewest_in_flight():
    b = Balancer(3, "shortest_queue")
    b.inflight = [2, 0, 1]
    assert b.pick(1) == 1
    b.inflight = [1, 1, 1]
    assert b.pick(1) == 0  # the lowest index among equals


def test_the_balancer_counts_samples_in_and_out():
    b = Balancer(2, "shortest_queue")
    assert b.pick(3) == 0 and b.inflight == [3, 0]  # a request of 3 samples
    assert b.pick(1) == 1 and b.pick(1) == 1 and b.inflight == [3, 2]
    b.finished(0)
    b.finished(0)
    assert b.inflight == [1, 2] and b.pick(1) == 0


def test_merge_sums_counts_weighs_averages_and_keeps_configuration():
    a = {"status": "ready", "context_length": 2048, "num_running_reqs": 2, "generated_tokens": 100,
         "spec_verify_ct": 30, "avg_spec_accept_length": 2.0, "spec_accepted_per_position": [30, 20, 10],
         "spec_accept_rate_per_position": [1.0, 0.667, 0.333], "kv_usage": 0.5, "max_total_tokens": 1000,
         "grammar_compile_seconds_max": 0.2, "worker_pid": 11}
    b = {**a, "num_running_reqs": 1, "generated_tokens": 40, "spec_verify_ct": 10, "avg_spec_accept_length": 4.0,
         "spec_accepted_per_position": [10, 10], "kv_usage": 0.0, "max_total_tokens": 3000,
         "grammar_compile_seconds_max": 0.5, "worker_pid": 12}
    m = merge_states([a, b])
    assert m["num_running_reqs"] == 3 and m["generated_tokens"] == 140 and m["spec_verify_ct"] == 40
    assert m["avg_spec_accept_length"] == pytest.approx((2.0 * 30 + 4.0 * 10) / 40)
    assert m["spec_accepted_per_position"] == [40, 30, 10]
    assert m["spec_accept_rate_per_position"] == pytest.approx([1.0, 0.75, 0.25])
    assert m["kv_usage"] == pytest.approx(0.5 * 1000 / 4000) and m["max_total_tokens"] == 4000
    assert m["grammar_compile_seconds_max"] == 0.5
    assert m["context_length"] == 2048 and m["status"] == "ready" and m["worker_pid"] == 11 and m["dp_size"] == 2


def test_one_replica_state_is_left_as_it_is():
    state = {"num_running_reqs": 2, "avg_spec_accept_length": 3.0}
    assert merge_states([state]) == state


@pytest.mark.parametrize("flags, message", [
    (dict(dp_size=0), "--dp-size"),
    (dict(load_balance_method="fastest"), "--load-balance-method"),
    (dict(dp_size=2, nnodes=2, tp_size=2, dist_init_addr="127.0.0.1:1234"), "--dp-size"),
])
def test_bad_data_parallel_flags_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        ServerArgs(model_path="x", **flags).validate()


def test_the_offline_engine_refuses_replicas():
    from specserve import Engine

    with pytest.raises(ConfigError, match="--dp-size"):
        Engine(model_path="demo", dp_size=2)

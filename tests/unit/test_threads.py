"""CPU thread count: the CPUs a process may use (affinity, cgroup quota, from fake files) and the governor that
lowers the count under contention, on made-up step timings."""

from __future__ import annotations

import pytest
import torch

from specserve.config import ServerArgs
from specserve.platform import platform_policy
from specserve.platform.cpu import cpus
from specserve.platform.cpu.cpus import (
    cgroup_cpu_limit,
    cgroup_paths,
    parse_cfs_quota,
    parse_cpu_max,
    threads_for,
    usable_cpus,
)
from specserve.platform.cpu.governor import ThreadGovernor, batch_key, thread_levels

# ---------------------------------------------------------------------------------------------- usable CPUs


@pytest.mark.parametrize("text,want", [("max 100000\n", None), ("150000 100000\n", 1.5), ("200000 100000", 2.0),
                                       ("", None), ("garbage", None), ("0 100000", None)])
def test_parse_cpu_max(text, want):
    assert parse_cpu_max(text) == want


@pytest.mark.parametrize("quota,period,want", [("-1\n", "100000\n", None), ("50000\n", "100000\n", 0.5),
                                               ("300000", "100000", 3.0), ("x", "100000", None)])
def test_parse_cfs_quota(quota, period, want):
    assert parse_cfs_quota(quota, period) == want


def test_cgroup_paths_v1_v2_and_hybrid():
    assert cgroup_paths("0::/user.slice/a.scope\n") == ("/user.slice/a.scope", None)
    hybrid = "9:name=systemd:/\n4:memory:/x\n2:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_paths(hybrid) == ("/", "/docker/abc")
    assert cgroup_paths("") == (None, None)


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_smallest_limit_over_ancestors(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "kube" / "cpu.max", "250000 100000\n")  # a parent's limit applies to its children
    _write(root / "kube" / "pod" / "cpu.max", "max 100000\n")
    _write(tmp_path / "self", "0::/kube/pod\n")
    assert cgroup_cpu_limit(str(root), str(tmp_path / "self")) == 2.5
    _write(tmp_path / "self", "0::/\n")  # a namespaced container sees its own cgroup as the root
    assert cgroup_cpu_limit(str(root), str(tmp_path / "self")) is None


def test_cgroup_v1_container_without_namespace(tmp_path):
    """/proc/self/cgroup names the host's folder, which the container does not have: its own mount applies."""
    root = tmp_path / "cg"
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "150000\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "self", "3:cpu,cpuacct:/docker/0123abcd\n0::/\n")
    assert cgroup_cpu_limit(str(root), str(tmp_path / "self")) == 1.5


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "missing")) is None
    _write(tmp_path / "self", "0::/\n")  # v2 listed but no unified mount at root
    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "self")) is None


@pytest.mark.parametrize("cpus_,quota,want", [(8, None, 8), (8, 2.5, 2), (8, 0.5, 1), (2, 16.0, 2), (0, None, 1)])
def test_threads_for(cpus_, quota, want):
    assert threads_for(cpus_, quota) == want


def test_usable_cpus_caps_the_affinity_mask_by_the_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 6)
    _write(tmp_path / "cgroup.controllers", "cpu\n")
    _write(tmp_path / "cpu.max", "300000 100000\n")
    _write(tmp_path / "self", "0::/\n")
    assert usable_cpus(str(tmp_path), str(tmp_path / "self")) == 3
    assert usable_cpus(str(tmp_path / "none"), str(tmp_path / "none")) == 6


# ---------------------------------------------------------------------------------------------- the governor

QUIET = {2: 5e-3, 1: 6e-3}  # seconds per decode step at each count (1 thread a little slower)
BUSY = {2: 30e-3, 1: 6.2e-3}  # a neighbour on one core: the 2-thread barrier waits for its time slices


def drive(gov: ThreadGovernor, costs: dict[int, float], steps: int, key=1) -> list[int]:
    """Feed steps costing costs[count in force]; -> the count each step ran with."""
    seen = []
    for _ in range(steps):
        seen.append(gov.threads)
        gov.observe(key, costs[gov.threads])
    return seen


def test_thread_levels_and_batch_keys():
    assert thread_levels(8) == (8, 4, 2, 1) and thread_levels(6) == (6, 3, 1) and thread_levels(1) == (1,)
    assert [batch_key(b) for b in (1, 2, 3, 4, 5, 32, 33)] == [1, 2, 4, 4, 8, 32, 64]


def test_quiet_busy_quiet():
    gov = ThreadGovernor(2)
    quiet = drive(gov, QUIET, 400)
    assert gov.threads == 2 and gov.switches == 0 and quiet.count(1) <= 3 * gov.window  # a few down-probes only
    drive(gov, BUSY, 2 * gov.window + 1)  # a slow window, then a probe of 1 thread that wins at once
    assert gov.threads == 1 and gov.switches == 1
    busy = drive(gov, BUSY, 4000)
    assert gov.threads == 1 and gov.switches == 1
    assert busy.count(2) * BUSY[2] < 0.1 * busy.count(1) * BUSY[1]  # up-probes cost little time
    steps_to_return = drive(gov, QUIET, 20000).index(2) if gov.threads == 1 else 0
    assert gov.threads == 2 and gov.switches == 2
    assert steps_to_return * QUIET[1] <= gov.probe_max_s + 1  # back within the longest probe interval


def test_started_beside_a_busy_neighbour():
    """No quiet speed was ever seen: the periodic down-probe finds 1 thread faster."""
    gov = ThreadGovernor(2)
    drive(gov, BUSY, int(gov.probe_min_s / BUSY[2]) + 3 * gov.window)
    assert gov.threads == 1 and gov.switches == 1


def test_a_tie_keeps_all_threads_and_backs_off():
    gov = ThreadGovernor(2)
    drive(gov, {2: 5e-3, 1: 5e-3}, 20000)  # 100 busy seconds
    assert gov.threads == 2 and gov.switches == 0
    assert gov.probes <= 100 / gov.probe_max_s + 4 and gov.interval_s == gov.probe_max_s  # 1, 2, 4, 8, then the cap


def test_a_slow_probe_is_cut_short_and_paid_back():
    gov = ThreadGovernor(2)
    drive(gov, BUSY, 400)
    assert gov.threads == 1
    gov.next_probe_s = gov.busy_s  # probe at the next window
    drive(gov, {2: 1.0, 1: 6e-3}, gov.window + gov.window // 2 + 1)  # 1 s steps at 2 threads: heavy contention
    assert gov.threads == 1 and gov.probing is None  # lost after window // 2 + 1 steps
    assert gov.next_probe_s - gov.busy_s >= gov.probe_share * (gov.window // 2 + 1) * 0.9


def test_windows_are_per_key():
    """A key's window is compared with the same key's: batch 8 steps (slower) do not look like contention."""
    gov = ThreadGovernor(2)
    for _ in range(200):
        gov.observe(1, 5e-3)
        gov.observe(8, 20e-3)
    assert gov.threads == 2 and gov.switches == 0


def test_many_cores_step_down_a_level_at_a_time():
    gov = ThreadGovernor(8)
    costs = {8: 40e-3, 4: 10e-3, 2: 12e-3, 1: 20e-3}
    drive(gov, {8: 5e-3, 4: 8e-3, 2: 14e-3, 1: 25e-3}, 400)
    assert gov.threads == 8
    drive(gov, costs, 3000)
    assert gov.threads == 4


# ---------------------------------------------------------------------------------------------- the policy


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_num_threads_forces_the_count_and_turns_adaptation_off(keep_threads):
    policy = platform_policy(ServerArgs(num_threads=1), torch.device("cpu"))
    policy.configure_threads()
    assert torch.get_num_threads() == 1 and policy.governor is None
    policy.time_step(1, 10.0)  # ignored
    info = policy.info()
    info.pop("cpu_tree_attention", None)  # whether this host runs the attention kernel
    info.pop("cpu_ops_in_cpp", None)  # and whether the kernels' operators run in C++ there
    assert info == {"cpu_threads_adaptive": False, "cpu_threads": 1}


def test_torch_compile_up_front_turns_adaptation_off(keep_threads):
    policy = platform_policy(ServerArgs(enable_torch_compile=True), torch.device("cpu"))
    policy.configure_threads()
    assert policy.governor is None and torch.get_num_threads() == usable_cpus()
    assert policy.thread_counts() == (usable_cpus(),) == (policy.thread_target(),)


def test_background_compile_keeps_adapting_with_a_graph_per_count(keep_threads, monkeypatch):
    """--torch-compile-in-background builds a graph per thread count, so the count may still follow contention:
    the compiler is told every count the governor can pick, and the one in force."""
    monkeypatch.setattr("specserve.platform.cpu.policy.usable_cpus", lambda: 4)
    policy = platform_policy(ServerArgs(enable_torch_compile=True, torch_compile_in_background=True),
                             torch.device("cpu"))
    policy.configure_threads()
    assert policy.thread_counts() == (4, 2, 1) and policy.thread_target() == 4
    policy.governor.level = 2
    assert policy.thread_target() == 1
    policy.fix_threads(2)  # the cache-filling child, one count at a time
    assert policy.governor is None and policy.thread_target() == 2 and torch.get_num_threads() == 2


def test_default_adapts_from_the_usable_cpus(keep_threads, monkeypatch):
    monkeypatch.setattr("specserve.platform.cpu.policy.usable_cpus", lambda: 2)
    policy = platform_policy(ServerArgs(), torch.device("cpu"))
    policy.configure_threads()
    assert torch.get_num_threads() == 2 and policy.governor.max_threads == 2
    policy.governor.level = 1  # as after a switch
    policy.apply_threads()
    assert torch.get_num_threads() == 1
    assert policy.info()["cpu_threads"] == 1 and policy.info()["cpu_threads_adaptive"] is True


def test_plain_policy_has_no_thread_count():
    policy = platform_policy(ServerArgs(), torch.device("meta"))
    policy.apply_threads()
    policy.time_step(1, 1.0)
    assert policy.info() == {}

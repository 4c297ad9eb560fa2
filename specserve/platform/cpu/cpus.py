"""How many CPUs this process may actually use: its affinity mask and its cgroup's CPU quota (and, beside it,
how much memory the machine has: ``physical_ram_bytes``).

torch's default thread count is every CPU the OpenMP runtime sees, which ignores a container's quota: a process
limited to 2 CPUs' worth of time on a 64-core host would run 64 threads, each parallel op waiting at a barrier for
threads the kernel has throttled. The engine starts with ``usable_cpus()`` threads instead (``CpuPolicy``).

Read here:
- the affinity mask (``os.sched_getaffinity``: taskset, cpusets, docker ``--cpuset-cpus``);
- cgroup v2 ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD" for no limit; docker ``--cpus``, Kubernetes CPU limits);
- cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: no limit).
A quota of Q CPUs allows floor(Q) threads (at least 1): a thread beyond that is throttled for part of every
period, and every parallel op waits for its slowest thread. The limits of the process's cgroup and of each
ancestor up to the mount point apply; the smallest wins.
"""

from __future__ import annotations

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
V1_CPU_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")  # where distributions mount the v1 cpu controller


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` ("150000 100000") -> CPUs of quota (1.5); None for "max" (no limit) or bad text."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return _quota(parts[0], parts[1])


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` -> CPUs of quota; None for -1 (no limit)."""
    return _quota(quota_text.strip(), period_text.strip())


def _quota(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_paths(proc_cgroup_text: str) -> tuple[str | None, str | None]:
    """/proc/self/cgroup text -> (the v2 cgroup path, the v1 cpu controller's path); None where absent.
    Lines read "hierarchy-id:controllers:path"; v2's is "0::/path"."""
    v2 = v1 = None
    for line in proc_cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(mount: str, path: str) -> list[str]:
    """The cgroup folder for path under mount and each parent up to mount itself. In a container whose cgroup
    is not namespaced, path names the host's folder, absent here: only the existing ones are returned."""
    dirs, rel = [], path.strip("/")
    while True:
        d = os.path.join(mount, rel) if rel else mount
        if os.path.isdir(d):
            dirs.append(d)
        if not rel:
            return dirs
        rel = os.path.dirname(rel)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_cpu_limit(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> float | None:
    """The smallest CPU quota over this process's cgroup and its ancestors, in CPUs; None when unlimited or
    unknown (not Linux, no cgroup file system)."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    v2, v1 = cgroup_paths(text)
    limits = []
    if v2 is not None and os.path.isfile(os.path.join(root, "cgroup.controllers")):  # a v2 (unified) mount
        limits += [parse_cpu_max(_read(os.path.join(d, "cpu.max")) or "") for d in _ancestors(root, v2)]
    if v1 is not None:
        for mount in (os.path.join(root, m) for m in V1_CPU_MOUNTS):
            for d in _ancestors(mount, v1):
                quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
                if quota is not None and period is not None:
                    limits.append(parse_cfs_quota(quota, period))
    limits = [q for q in limits if q is not None]
    return min(limits) if limits else None


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (every CPU where the platform has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_for(cpus: int, quota: float | None) -> int:
    """Threads for ``cpus`` usable CPUs under a quota of ``quota`` CPUs (None: no quota): floor(quota), at least 1."""
    if quota is None:
        return max(1, cpus)
    return max(1, min(cpus, math.floor(quota)))


def usable_cpus(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int:
    """The thread count the forwards start with: the affinity mask, capped by the cgroup quota."""
    return threads_for(affinity_cpus(), cgroup_cpu_limit(root, proc_cgroup))


def physical_ram_bytes() -> int | None:
    """The machine's physical memory, or None where the OS does not tell (non-POSIX)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None

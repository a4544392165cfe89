"""Where this process's cgroup files are: its memory cgroup's OOM-kill count (the node agent) and its CPU quota
(the experiment runner's default parallel count).

A process sees its cgroup paths in ``/proc/self/cgroup``: ``0::/PATH`` on
cgroup v2, ``N:CONTROLLERS:/PATH`` on v1. Under a cgroup namespace (most
containers) those paths are ``/`` and the files sit at the mount's root; on a
host they sit at ``PATH`` below it. Both are tried, the process's own first.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
SELF = Path("/proc/self/cgroup")


def candidates(v2_name: str, v1_controller: str, v1_name: str) -> list[Path]:
    """The paths where this process's cgroup file may be, most specific first: v2 ``v2_name``, then v1
    ``v1_name`` of the hierarchy that holds ``v1_controller`` (``cpu`` may be mounted as ``cpu,cpuacct``)."""
    groups: dict[str, str] = {}
    try:
        for line in SELF.read_text().splitlines():
            _n, controllers, path = line.split(":", 2)
            for c in controllers.split(","):
                groups[c] = path
            if controllers:
                groups.setdefault(f"mount:{controllers}", path)
    except (OSError, ValueError):
        return []
    out = []
    if "" in groups:
        out += [ROOT / groups[""].lstrip("/") / v2_name, ROOT / v2_name]
    if v1_controller in groups:
        mounts = [k.removeprefix("mount:") for k in groups if k.startswith("mount:")
                  and v1_controller in k.removeprefix("mount:").split(",")]
        for mount in dict.fromkeys([*mounts, v1_controller]):
            out += [ROOT / mount / groups[v1_controller].lstrip("/") / v1_name, ROOT / mount / v1_name]
    return list(dict.fromkeys(out))


def read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cpu_quota() -> float | None:
    """The CPUs' worth of time this process's cgroup may use (its CFS quota over its period; v2 ``cpu.max``,
    v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``); None without a quota, or where none can be read."""
    for path in candidates("cpu.max", "cpu", "cpu.cfs_quota_us"):
        text = read(path)
        if text is None:
            continue
        if path.name == "cpu.max":
            quota, _sep, period = text.strip().partition(" ")
        else:
            quota, period = text.strip(), (read(path.with_name("cpu.cfs_period_us")) or "").strip()
        try:
            q, p = int(quota), int(period or 100_000)
        except ValueError:
            return None   # "max": no quota
        return q / p if q > 0 and p > 0 else None
    return None

"""CPU seconds of the processes a live run involves, found by their Ray process titles.

Ray names an actor's process ``ray::<class>...``; a Serve replica's is
``ray::ServeReplica:<app>:<deployment>...``. The node's metrics agent (which exports
``ray.util.metrics``) is the ``DashboardAgent`` process.
"""

from __future__ import annotations

from collections import defaultdict

import psutil


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return ""


def find_processes(apps: list[str]) -> dict[str, list[int]]:
    """role -> pids: ``<app>/<deployment>`` for each Serve replica of ``apps``, and ``metrics_agent``."""
    roles: dict[str, list[int]] = defaultdict(list)
    for p in psutil.process_iter():
        title = _title(p)
        if "DashboardAgent" in title or "dashboard/agent.py" in title:
            roles["metrics_agent"].append(p.pid)
            continue
        for app in apps:
            marker = f"ServeReplica:{app}:"
            if marker in title:
                deployment = title.split(marker, 1)[1].split()[0].split(".")[0]
                roles[f"{app}/{deployment}"].append(p.pid)
    return dict(roles)


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except (psutil.Error, OSError):
            pass
    return total


class CpuMeter:
    """Per-role CPU seconds between ``start()`` and ``stop()``."""

    def __init__(self, roles: dict[str, list[int]]):
        self.roles = roles
        self._before: dict[str, float] = {}

    def start(self) -> None:
        self._before = {role: cpu_seconds(pids) for role, pids in self.roles.items()}

    def stop(self) -> dict[str, float]:
        return {role: cpu_seconds(pids) - self._before.get(role, 0.0) for role, pids in self.roles.items()}


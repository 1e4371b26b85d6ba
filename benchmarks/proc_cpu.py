"""CPU time of this node's Serve processes per phase, from /proc (Linux; a local cluster only).

Why: on a small machine the ordinary requests' latency moves with the CPU that other work
takes from the cores they share. Reading each process's CPU time at a phase's start and
end says which process a phase's extra CPU went to (Serve's proxy, the ingress, a worker),
without a profiler's own cost in the measured run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of ``pid`` so far (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS   # utime, stime (fields 14 and 15 of stat)


def parent_of(pid: int) -> Optional[int]:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def descends_from(pid: int, root: int) -> bool:
    while pid not in (0, 1):
        if pid == root:
            return True
        pid = parent_of(pid) or 0
    return False


def machine_busy_seconds() -> float:
    """CPU seconds all of this machine's cores spent busy so far, every process and the kernel's interrupts
    (/proc/stat: user, nice, system, irq, softirq; not idle, I/O wait or steal)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / CLOCK_TICKS


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and every process descending from it, those that ended and were reaped included
    (their time is in their parent's ``cutime``/``cstime``), so the sum does not drop when a child exits."""
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
    parents = {pid: int(fields[1]) for pid, fields in stats.items()}
    total = 0
    for pid, fields in stats.items():
        ancestor = pid
        while ancestor not in (0, 1) and ancestor != root:
            ancestor = parents.get(ancestor, 0)
        if ancestor == root:
            total += sum(int(v) for v in fields[11:15])   # utime, stime, cutime, cstime
    return total / CLOCK_TICKS


def pids_named(fragment: str, under: Optional[int] = None) -> list[int]:
    """Processes whose command line (Ray sets it to ``ray::<actor>``) contains ``fragment``, and that descend
    from ``under`` (default: this process, whose local Ray cluster they belong to; the machine may run others)."""
    root = os.getpid() if under is None else under
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if fragment in command and descends_from(int(entry.name), root):
                found.append(int(entry.name))
    return found


class CpuMeter:
    """Named groups of processes; ``mark(phase)`` at a phase's ends, ``rows()`` the cores each group used."""

    def __init__(self, groups: dict[str, list[int]], clock=None):
        import time

        self.groups, self.clock = groups, clock or time.monotonic
        self.marks: list[tuple[str, float, dict[str, float]]] = []

    def _now(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(p) or 0.0 for p in pids) for name, pids in self.groups.items()}

    def mark(self, label: str) -> None:
        self.marks.append((label, self.clock(), self._now()))

    def cores(self, start: str, end: str) -> dict[str, float]:
        """Cores each group used on average between two marks."""
        (_, t0, c0), (_, t1, c1) = (next(m for m in self.marks if m[0] == label) for label in (start, end))
        return {name: (c1[name] - c0[name]) / max(t1 - t0, 1e-9) for name in self.groups}

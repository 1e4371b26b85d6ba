"""How fast this machine's CPU is during each phase of a benchmark: a fixed unit of work, timed in CPU time.

Why: on the 2-core VM the benchmarks run on, the same work costs different CPU time at different
moments, with nothing else running in the VM. A probe timing one fixed unit of pure-Python work
every 0.1 s read a median of 0.82 ms in some 5 s windows and 1.07-1.35 ms in others while the VM's
other processes used 0.02 cores and /proc/stat counted no steal (2026-12-04); during a rollout run
every Serve process's CPU per request (and the benchmark client's, whose work per request is fixed)
rose and fell with it in the same windows, and so did the p50. A phase's p99 over 10-30 s therefore
moves with the host's speed as well as with the code, and comparing two phases is only fair when
both ran at the same speed. Each phase row carries the probe's median (``probe_us``) and the share of
its readings in the host's slow mode (``probe_slow_pct``), so a run says whether that held.

The other way a phase gets slower without the code changing is CPU taken inside the VM by processes
that are not the benchmark's (another session's test run or profiler; a rollout run read 0.9 of the
2 cores taken so in its last three phases and 0.0 in its steady phase, 2026-12-04). Once a second the
probe also reads the machine's busy CPU time (/proc/stat) and the benchmark's own process tree's
(``proc_cpu.tree_cpu_seconds``: its Ray cluster, clients and this probe); ``others_core_pct`` is the
difference over a phase, in percent of one core, so "quiet" is a number in the table rather than a note.

The probe is a process of its own (``python -m benchmarks.machine_speed``), so its timing is not the
benchmark's threads' and it costs one unit per interval (about 1 % of a core at the defaults). It
reads CPU time (``time.thread_time``): time the probe waited for a core does not count, only how long
the core took to do the work. Times are ``time.monotonic()``, the system-wide monotonic clock on
Linux, so they compare with the benchmark's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy

from benchmarks.proc_cpu import machine_busy_seconds, tree_cpu_seconds


@dataclass(frozen=True)
class ProbeSettings:
    """The probe's tunables."""

    interval_s: float = 0.1
    """seconds between the starts of two units"""
    unit_iterations: int = 20_000
    """loop iterations in one unit: about 0.8 ms of CPU on the 2-core VM in its fast mode"""
    slow_factor: float = 1.25
    """a reading this many times the run's fast mode (its 10th percentile) or more counts as slow"""
    cpu_interval_s: float = 1.0
    """seconds between two readings of the machine's and the benchmark's CPU time (a walk of /proc: ~4 ms)"""


def unit_cpu_ms(iterations: int) -> float:
    """CPU milliseconds this thread spent on one fixed unit of integer arithmetic."""
    started = time.thread_time()
    total = 0
    for i in range(iterations):
        total += i * i
    return (time.thread_time() - started) * 1000


def run_probe(out: Path, settings: ProbeSettings, parent: int) -> None:
    """Until ``parent`` is gone (the child's loop), append to ``out`` a line ``U<TAB>time<TAB>cpu_ms`` per unit and,
    every ``cpu_interval_s``, ``C<TAB>time<TAB>machine busy s<TAB>parent's tree s`` (times: ``time.monotonic()``)."""
    cpu_due = 0.0
    with open(out, "a", buffering=1) as f:
        while os.getppid() == parent:
            started = time.monotonic()
            f.write(f"U\t{started:.4f}\t{unit_cpu_ms(settings.unit_iterations):.4f}\n")
            if started >= cpu_due:
                cpu_due = started + settings.cpu_interval_s
                f.write(f"C\t{time.monotonic():.4f}\t{machine_busy_seconds():.3f}\t{tree_cpu_seconds(parent):.3f}\n")
            time.sleep(max(0.0, settings.interval_s - (time.monotonic() - started)))


class SpeedProbe:
    """``start()`` before the phases, ``stop()`` after them, then ``phase(start, end)`` for each phase's window."""

    def __init__(self, settings: Optional[ProbeSettings] = None):
        self.settings = settings or ProbeSettings()
        self._dir = Path(tempfile.mkdtemp(prefix="lorafleet-speed-"))
        self.path = self._dir / "readings.tsv"
        self._process: Optional[subprocess.Popen] = None
        self._readings: Optional[list[tuple[float, float]]] = None
        self._cpu: Optional[list[tuple[float, float, float]]] = None

    def start(self) -> "SpeedProbe":
        s = self.settings
        self._process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.machine_speed", str(self.path), str(s.interval_s),
             str(s.unit_iterations), str(os.getpid())],
            cwd=Path(__file__).resolve().parent.parent)
        return self

    def stop(self) -> None:
        """End the probe process (this one started it) and keep its readings."""
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=30)
            self._process = None
        self._readings, self._cpu = self.readings(), self.cpu_readings()

    def _lines(self, kind: str, fields: int) -> list[tuple[float, ...]]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            parts = line.split("\t")
            if parts[0] == kind and len(parts) == fields + 1:   # (a line cut short by the stop is left out)
                out.append(tuple(float(v) for v in parts[1:]))
        return out

    def readings(self) -> list[tuple[float, float]]:
        """(monotonic time, CPU ms of one unit) so far; after ``stop()``, the ones it kept."""
        return self._readings if self._readings is not None else self._lines("U", 2)  # type: ignore[return-value]

    def cpu_readings(self) -> list[tuple[float, float, float]]:
        """(monotonic time, machine busy CPU s, the benchmark's tree's CPU s) so far; after ``stop()``, those kept."""
        return self._cpu if self._cpu is not None else self._lines("C", 3)  # type: ignore[return-value]

    def others_core_pct(self, start: float, end: float) -> Optional[float]:
        """Percent of one core that processes outside the benchmark's tree used between the first and the last CPU
        reading in [start, end] (None with fewer than two there)."""
        inside = [r for r in self.cpu_readings() if start <= r[0] <= end]
        if len(inside) < 2:
            return None
        (t0, busy0, tree0), (t1, busy1, tree1) = inside[0], inside[-1]
        return 100.0 * max(0.0, (busy1 - busy0) - (tree1 - tree0)) / (t1 - t0)

    def fast_ms(self) -> float:
        """The run's fast mode: the 10th percentile of all its readings (nan without any)."""
        values = [ms for _, ms in self.readings()]
        return float(numpy.percentile(values, 10)) if values else float("nan")

    def phase(self, start: float, end: float) -> dict:
        """``probe_us`` (median CPU microseconds of a unit), ``probe_slow_pct`` (readings at ``slow_factor`` times
        the run's fast mode or more) and ``others_core_pct`` between two ``time.monotonic()`` times; None without
        readings."""
        values = [ms for when, ms in self.readings() if start <= when <= end]
        others = {"others_core_pct": self.others_core_pct(start, end)}
        if not values:
            return {"probe_us": None, "probe_slow_pct": None, **others}
        slow = self.fast_ms() * self.settings.slow_factor
        return {"probe_us": 1000 * float(numpy.median(values)),
                "probe_slow_pct": 100.0 * sum(v >= slow for v in values) / len(values), **others}

    def legend(self) -> str:
        """What the three columns mean, for under a table."""
        return (f"probe_us: CPU microseconds of one fixed unit of work while the phase ran (median; the run's fast "
                f"mode {1000 * self.fast_ms():.0f} us); probe_slow_pct: its readings in the host's slow mode (>= "
                f"{self.settings.slow_factor:g}x the fast mode), in %; others_core_pct: CPU of processes outside "
                f"this benchmark's, in % of one core (near 0 on a quiet machine)")

    def close(self) -> None:
        if self._process is not None:
            self.stop()
        for child in self._dir.iterdir():
            child.unlink()
        self._dir.rmdir()


def span(starts: Sequence[float], ends: Sequence[float]) -> tuple[float, float]:
    """The window from the first start to the last end (monotonic times)."""
    return (min(starts), max(ends)) if starts else (0.0, -1.0)


if __name__ == "__main__":
    out_path, interval, iterations, parent_pid = sys.argv[1:5]
    run_probe(Path(out_path), ProbeSettings(interval_s=float(interval), unit_iterations=int(iterations)),
              int(parent_pid))

"""``benchmarks.machine_speed``: the probe process that says how fast the machine was during each phase."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.machine_speed import ProbeSettings, SpeedProbe, span, unit_cpu_ms
from benchmarks.proc_cpu import machine_busy_seconds, tree_cpu_seconds
from tests.waiting import wait_until


def probe_with(readings: list[tuple[float, float]], cpu: tuple = (), slow_factor: float = 1.25) -> SpeedProbe:
    """A probe that never ran, holding ``readings`` (and ``cpu`` readings) as a stopped one would."""
    probe = SpeedProbe(ProbeSettings(slow_factor=slow_factor))
    probe._readings, probe._cpu = readings, list(cpu)
    return probe


def test_a_phase_reads_the_median_and_the_share_of_readings_in_the_slow_mode():
    # the run's fast mode is its 10th percentile (1.0 ms); 1.25x that or more is slow
    probe = probe_with([(float(t), ms) for t, ms in enumerate([1.0] * 10 + [1.2] * 5 + [1.3] * 5)])
    try:
        assert probe.fast_ms() == 1.0
        assert probe.phase(0, 9.5) == {"probe_us": 1000.0, "probe_slow_pct": 0.0, "others_core_pct": None}
        whole = probe.phase(0, 19)
        assert whole["probe_slow_pct"] == 25.0 and abs(whole["probe_us"] - 1100.0) < 1e-6
        assert probe.phase(15, 19) == {"probe_us": 1300.0, "probe_slow_pct": 100.0, "others_core_pct": None}
        assert "fast mode 1000 us" in probe.legend() and ">= 1.25x" in probe.legend()
    finally:
        probe.close()


def test_a_phase_without_readings_reads_none():
    probe = probe_with([(1.0, 1.0)])
    try:
        empty = {"probe_us": None, "probe_slow_pct": None, "others_core_pct": None}
        assert probe.phase(2.0, 3.0) == empty and probe.phase(*span([], [])) == empty
    finally:
        probe.close()


def test_others_are_the_machine_busy_time_the_benchmark_tree_did_not_use():
    # (time, machine busy s, tree s): from 0 to 10 s the machine did 12 s of work and the tree 8 s
    probe = probe_with([], cpu=[(0.0, 100.0, 50.0), (5.0, 106.0, 54.0), (10.0, 112.0, 58.0), (20.0, 122.0, 68.0)])
    try:
        assert probe.others_core_pct(0.0, 10.0) == 40.0    # 4 s over 10 s
        assert probe.others_core_pct(10.0, 20.0) == 0.0    # all of it the tree's
        assert probe.others_core_pct(1.0, 9.0) is None      # one reading in the window says nothing
    finally:
        probe.close()


def test_the_tree_counts_a_child_that_ended_and_the_machine_counts_every_process():
    before_tree, before_machine = tree_cpu_seconds(os.getpid()), machine_busy_seconds()
    code = "s = 0\nfor i in range(3_000_000):\n    s += i"
    subprocess.run([sys.executable, "-c", code], check=True)   # reaped: its time is now in our cutime
    spent_tree = tree_cpu_seconds(os.getpid()) - before_tree
    assert spent_tree > 0.05
    assert machine_busy_seconds() - before_machine >= spent_tree - 0.02   # (clock-tick rounding)


def test_the_probe_process_times_units_until_stopped():
    started = time.monotonic()
    probe = SpeedProbe(ProbeSettings(interval_s=0.01, unit_iterations=1000)).start()
    process = probe._process
    try:
        wait_until(lambda: len(probe.readings()) >= 3, 60, "three readings from the probe process")
        probe.stop()
        ended = time.monotonic()
        assert process.poll() is not None   # it is gone
        readings = probe.readings()
        assert len(readings) >= 3
        times = [when for when, _ in readings]
        assert times == sorted(times) and started <= times[0] and times[-1] <= ended   # the same clock as ours
        assert all(ms > 0 for _, ms in readings)
        phase = probe.phase(started, ended)
        assert phase["probe_us"] > 0 and 0 <= phase["probe_slow_pct"] <= 100
        assert len(probe.cpu_readings()) >= 1   # one at the start; one a second after
    finally:
        probe.close()
    assert not probe.path.parent.exists()


def test_a_unit_costs_cpu_time_that_grows_with_its_iterations():
    assert unit_cpu_ms(1_000) >= 0
    assert sum(unit_cpu_ms(2_000_000) for _ in range(3)) > sum(unit_cpu_ms(2_000) for _ in range(3))

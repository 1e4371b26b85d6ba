"""``cluster_sim``'s elastic-fleet part: scale events (cold vs warm start) and autoscaling policies.

Runs the experiments of ``scale_scenario`` and ``autoscale_scenario`` (one task per simulator run,
so ``cluster_sim`` can spread them over its worker processes), prints their tables and gives
their goals: ``sim_scale_out_p99_ratio`` and ``sim_autoscale_replica_seconds``.
"""

from __future__ import annotations

from typing import Any

from .. import common
from .autoscale_scenario import AutoscaleScenario, compare, plan, quick, run_autoscale
from .scale_scenario import ScaleScenario, run_scale

Task = tuple[str, Any, Any, Any]


def elastic_tasks(quick_run: bool, seed: int) -> list[Task]:
    scale = ScaleScenario(seed=seed) if quick_run else ScaleScenario(replicas=32, adapters=400, added=8, cycles=4,
                                                                      seed=seed)
    auto = AutoscaleScenario(seed=seed)
    auto = quick(auto) if quick_run else auto
    tasks: list[Task] = [("scale", scale, warm, None) for warm in (False, True)]
    tasks += [("autoscale", s, rule, share) for s, rule, share in plan(auto)]
    return tasks


def run_elastic(task: Task) -> dict:
    kind, scenario, a, b = task
    if kind == "scale":
        row = run_scale(scenario, a)
        row.pop("scenario")
        return {"kind": kind, **row}
    return {"kind": kind, **run_autoscale(scenario, a, b)}


def report(rows: list[dict], tasks: list[Task]) -> tuple[list[dict], dict]:
    """Print both tables; the two goals and what goes into the JSON."""
    scale = [r for r in rows if r["kind"] == "scale"]
    auto = [r for r in rows if r["kind"] == "autoscale"]
    goals: list[dict] = []
    if scale:
        s = next(t[1] for t in tasks if t[0] == "scale")
        print()
        common.print_table(scale, ["start", "replicas", "added", "steady_p99", "out_p99", "out_ratio", "in_p99",
                                   "in_ratio", "new_replica_loads", "new_replica_requests", "steady_loads",
                                   "out_loads", "in_loads", "warm_slots", "join_delay_s", "wall_seconds"],
                           floatfmt=".3g",
                           title=f"== scale events (affinity): {s.replicas} -> {s.replicas + s.added} -> {s.replicas} "
                                 f"replicas x {s.cycles} cycles, {s.adapters} adapters, alpha {s.alpha}, CV {s.cv}, "
                                 f"load {s.load} per replica (the rate steps with the fleet); p99 TTFT (s) over the "
                                 f"{s.window_s:g} s before each scale-out (steady) and after each scale-out / scale-in, "
                                 f"pooled; loads by requests in those windows; warm = routing.warm_start plan "
                                 f"(slots <= slots-1, host tier <= slots) read from disk before taking traffic")
        warm = next(r for r in scale if r["start"] == "warm")
        goals.append(common.goal("sim_scale_out_p99_ratio", round(warm["out_ratio"], 3),
                                 "<= 1.2 (p99 TTFT after scale-out / steady, warm start)", warm["out_ratio"] <= 1.2))
    comparison: dict = {}
    if auto:
        a = next(t[1] for t in tasks if t[0] == "autoscale")
        d = a.shape
        print()
        common.print_table(auto, ["policy", "target_ongoing", "replica_seconds", "mean_replicas", "peak_replicas",
                                  "ttft_p50", "ttft_p99", "e2e_p99", "loads", "decisions", "requests",
                                  "wall_seconds"], floatfmt=".4g",
                           title=f"== autoscaling (affinity router, warm start): {a.days:g} compressed day(s) of "
                                 f"{d.day_s:g} s, {d.trough:g} -> {d.peak:g} req/s, bursts x{1 + d.burst_factor:g} "
                                 f"for {d.burst_s:g} s every ~{d.burst_gap_s:g} s on {d.burst_adapters} adapters; "
                                 f"{a.adapters} adapters alpha {a.alpha}; replicas {a.min_replicas}-{a.max_replicas}, "
                                 f"start-up {a.loop.startup_s:g} s, delays up {a.upscale_delay_s:g} s / down "
                                 f"{a.downscale_delay_s:g} s, {a.max_loads_per_s_per_replica:g} loads/s per replica, "
                                 f"working-set headroom {a.working_set_headroom:g}")
        comparison = compare(auto)
        c = comparison
        print(f"adapter-aware vs the queue-only run (target {c['queue_target']:g}) that spends the most with p99 "
              f"TTFT no better: replica-seconds x{c['ratio']:.3f}, p99 TTFT {c['aware_p99']:.3g} s vs "
              f"{c['queue_p99']:.3g} s; at the same target: x{c['same_target_ratio']:.3f}, p99 "
              f"{c['same_target_p99']:.3g} s; "
              + (f"the cheapest queue-only run with p99 no worse (target {c['matching_target']:g}, p99 "
                 f"{c['matching_p99']:.3g} s): x{c['ratio_to_matching']:.3f}"
                 if c["matching_target"] is not None else "no queue-only run reaches adapter-aware's p99"))
        goals.append(common.goal("sim_autoscale_replica_seconds", round(comparison["ratio"], 3),
                                 "<= 0.8 (adapter-aware / queue-only replica-seconds, p99 TTFT no worse)",
                                 comparison["passed"]))
    return goals, {"scale_events": scale, "autoscale": auto, "autoscale_comparison": comparison}

"""Does the simulator reproduce the live fleet? ``routing_live``'s cells, simulated, ranked alike.

Inputs from a ``routing_live --json`` run: its settings (replicas, slots, batch, traces,
concurrency levels, load costs) and each variant's control-plane CPU per request (the
median over its rows of the router's process, the directory and the metrics agent; the
workers' per-request work besides engine steps from its concurrency-1 rows). The engine's
step cost is measured here (``cpu_fleet.measure_engine_steps``), not taken from the run.
Throughput and latency are what the model predicts; they are then compared with the run:
for every cell (setting, load cost, concurrency) and every pair of variants whose live
req/s differ by more than ``margin``, the simulation must order the pair the same way.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

import numpy as np

from ..routing_live import Setting, build_requests, requests_per_row
from .cpu_fleet import ControlPlaneCpu, CpuFleetConfig, StepCost, run_cpu_fleet
from .serve_cache import ServeTimes

VARIANTS = ("affinity", "multiplexed", "pow2")
SEEDS = 5  # one seed's pow2 at concurrency 64 moves by a third between seeds (Serve's refusals and backoffs)


def _median(rows: Sequence[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) / 1000.0 if values else 0.0


def _solo(live_rows: Sequence[dict], variant: Optional[str] = None) -> list[dict]:
    """The one-router rows at concurrency 1 (all of a variant's one-router rows if it has none at 1)."""
    rows = [r for r in live_rows if r["routers"] == 1 and (variant is None or r["variant"] == variant)]
    return [r for r in rows if r["concurrency"] == 1] or rows


def _engine_measured(row: dict) -> bool:
    return bool(row.get("engine_cpu_ms")) and bool(row.get("steps_per_request")) and \
        row.get("rows_per_step") is not None and not math.isnan(row["rows_per_step"])


def step_scale(live_rows: Sequence[dict], step: StepCost) -> float:
    """A live step's engine-thread CPU over the step this process measures at the same batch, the median over
    the concurrency-1 rows (1.0 for a run that did not record its engines: the measured step as it is).

    Why: ``measure_engine_steps`` times steps back to back in one quiet process; a worker's step runs between
    other processes' work on shared cores (caches cold) and the run's rows show it costs more. Only the
    concurrency-1 rows calibrate it; the other concurrencies are what the check then predicts."""
    ratios = []
    for r in _solo(live_rows):
        if not _engine_measured(r):
            continue
        live_step_s = r["engine_cpu_ms"] / 1000.0 / r["steps_per_request"]
        ratios.append(live_step_s / step.seconds(r["rows_per_step"]))
    return statistics.median(ratios) if ratios else 1.0


def calibrate(live_rows: Sequence[dict], step: StepCost, mean_tokens: float) -> dict[str, ControlPlaneCpu]:
    """Each variant's control-plane CPU seconds per request, from its live rows (one router).

    The workers' per-request work besides engine steps (``replica_s``) comes from the concurrency-1 rows: their
    CPU less their engine threads' where the run recorded them; else less ``mean_tokens`` steps at batch 1 as
    measured here (which charged every step's fixed part to one request: at a full batch it is shared)."""
    out = {}
    for variant in VARIANTS:
        rows = [r for r in live_rows if r["variant"] == variant and r["routers"] == 1]
        if not rows:
            continue
        solo = _solo(live_rows, variant)
        if all(_engine_measured(r) for r in solo):
            replica_s = statistics.median(r["workers_cpu_ms"] - r["engine_cpu_ms"] for r in solo) / 1000.0
        else:
            replica_s = _median(solo, "workers_cpu_ms") - mean_tokens * step.seconds(1)
        out[variant] = ControlPlaneCpu(router_s=_median(rows, "router_cpu_ms"),
                                       directory_s=_median(rows, "directory_cpu_ms"),
                                       metrics_agent_s=_median(rows, "metrics_agent_cpu_ms"),
                                       replica_s=max(0.0, replica_s))
    return out


def simulate_live(live: dict, step: StepCost, seeds: int = SEEDS) -> list[dict]:
    """The live run's one-router cells, simulated with its settings and calibration: each cell's figures are
    the mean over ``seeds`` runs (the routers' random draws and Serve's message times differ per seed)."""
    meta = live["metadata"]["settings"]
    rows = [r for r in live["rows"] if r["routers"] == 1]
    chosen = meta["settings_run"]
    settings = {"fits": Setting("fits", min(meta["fits_adapters"], meta["replicas"] * meta["slots"]), meta["alpha"]),
                "skew": Setting("skew", meta["skew_adapters"], meta["alpha"])}
    order = [s for s in ("fits", "skew") if s in chosen]
    args = type("Args", (), {"requests": meta.get("requests"), "quick": meta.get("quick", False)})()
    mean_tokens = 12.0  # routing_live draws 8-16 new tokens
    control = calibrate(rows, step, mean_tokens)
    scale = step_scale(rows, step)
    step = step.scaled(scale)
    costs = meta["costs"]
    out = []
    for (setting_name, cost, c) in sorted({(r["setting"], r["cost"], r["concurrency"]) for r in rows}):
        i = order.index(setting_name)
        setting = settings[setting_name]
        requests = build_requests(setting, requests_per_row(c, args), meta["seed"] + 100 * i)
        warmup = build_requests(setting, max(48, requests_per_row(1, args) // 2), meta["seed"] + 100 * i + 1)
        for variant in VARIANTS:
            if variant not in control:
                continue
            runs = []
            for k in range(seeds):
                cfg = CpuFleetConfig(variant=variant, replicas=meta["replicas"], slots=meta["slots"],
                                     max_batch=meta["max_batch_size"], step_base_s=step.base_s,
                                     step_per_seq_s=step.per_seq_s, step_per_adapter_s=step.per_adapter_s,
                                     host_load_s=max(costs[cost]["host_s"], 1e-4),
                                     disk_load_s=max(costs[cost]["disk_s"], 2e-3), control=control[variant],
                                     load_bound_epsilon=meta["load_bound_epsilon"], seed=meta["seed"] + k,
                                     serve_times=ServeTimes())
                runs.append(run_cpu_fleet(requests, c, cfg, warmup=warmup))
            mean = (lambda key: float(np.mean([getattr(r, key) for r in runs])))
            out.append({"setting": setting_name, "cost": cost, "concurrency": c, "variant": variant,
                        "sim_req_per_s": mean("req_per_s"), "sim_p50_ms": mean("p50_ms"), "sim_p99_ms": mean("p99_ms"),
                        "sim_loads_per_1k": 1000.0 * mean("loads") / (len(requests) + len(warmup)),
                        "engine_share": mean("engine_share"), "sim_workers_cpu_ms": mean("workers_cpu_ms"),
                        "sim_refusals_per_request": mean("refusals_per_request"), "sim_idle_share": mean("idle_share"),
                        "step_scale": scale})
    live_by = {(r["setting"], r["cost"], r["concurrency"], r["variant"]): r for r in rows}
    for r in out:
        lr = live_by[(r["setting"], r["cost"], r["concurrency"], r["variant"])]
        r.update(live_req_per_s=lr["req_per_s"], live_p50_ms=lr["p50_ms"], live_p99_ms=lr["p99_ms"],
                 live_workers_cpu_ms=lr.get("workers_cpu_ms"))
    return out


def ranking_agreement(rows: Sequence[dict], margin: float = 0.10) -> tuple[int, int, list[str]]:
    """(pairs ordered alike, pairs the live run orders, disagreements): by req/s, per cell, only
    pairs whose live req/s differ by more than ``margin`` (closer ones are ties at this noise)."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["setting"], r["cost"], r["concurrency"]), {})[r["variant"]] = r
    agreed, ordered, wrong = 0, 0, []
    for cell, by in sorted(cells.items()):
        names = sorted(by)
        for k, a in enumerate(names):
            for b in names[k + 1:]:
                la, lb = by[a]["live_req_per_s"], by[b]["live_req_per_s"]
                if max(la, lb) <= (1 + margin) * min(la, lb):
                    continue
                ordered += 1
                if (la > lb) == (by[a]["sim_req_per_s"] > by[b]["sim_req_per_s"]):
                    agreed += 1
                else:
                    wrong.append(f"{cell[0]}/{cell[1]}/c={cell[2]}: live {a} {la:.1f} vs {b} {lb:.1f} req/s, "
                                 f"sim {by[a]['sim_req_per_s']:.1f} vs {by[b]['sim_req_per_s']:.1f}")
    return agreed, ordered, wrong

"""The scale-event experiment: a steady trace, replicas added then removed, cold vs warm start.

Why: it isolates what a join or a departure costs the requests around it. The arrival rate
steps up with the fleet at the scale-out (by ``(replicas + added) / replicas``: traffic grew
and the fleet followed it) and back down at the scale-in, so the load per replica is the
same before and after each event and any rise in p99 TTFT after one is the event's own
cost: a cold replica taking requests for adapters it must read from disk, or survivors
reloading a departed replica's adapters. Windows are by arrival time: steady = after the
warm-up until the scale-out; "out" and "in" = the ``window_s`` after each decision.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from ..traces import Popularity, Trace, make_profile_trace
from .config import SimConfig
from .fleet import Simulator
from .scale_events import ScaleEvent, schedule


@dataclass(frozen=True)
class ScaleScenario:
    """``cycles`` rounds of five windows after a warm-up: settle, steady, [scale-out] out, grown,
    [scale-in] in. Each minute-long window is pooled over the cycles (one p99 over all of them)."""

    replicas: int = 16
    adapters: int = 200
    added: int = 4
    alpha: float = 0.3
    cv: float = 2.0
    load: float = 0.4          # offered load per replica (cluster_sim's definition and default)
    warmup_s: float = 120.0
    cycles: int = 3
    window_s: float = 60.0
    seed: int = 0

    def starts(self) -> list[float]:
        return [self.warmup_s + 5 * self.window_s * c for c in range(self.cycles)]

    @property
    def end_s(self) -> float:
        return self.warmup_s + 5 * self.window_s * self.cycles

    def trace(self, config: SimConfig) -> Trace:
        rate = self.load * self.replicas * config.max_batch / config.costs.service_seconds(259.5, 259.5)
        grown = rate * (self.replicas + self.added) / self.replicas
        w, first = self.window_s, self.warmup_s

        def rate_at(t: np.ndarray) -> np.ndarray:
            phase = np.mod(t - first, 5 * w)
            return np.where((t >= first) & (phase >= 2 * w) & (phase < 4 * w), grown, rate)

        return make_profile_trace(self.end_s, self.adapters, Popularity("power", self.alpha), rate_at,
                                  cv=self.cv, seed=self.seed)


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def run_scale(scenario: ScaleScenario, warm: bool, router: str = "affinity") -> dict:
    """One run; the row: p99 TTFT per window, their ratios, and the loads the new replicas paid."""
    started = time.perf_counter()
    config = SimConfig(replicas=scenario.replicas, router=router, seed=scenario.seed)
    sim = Simulator(scenario.trace(config), config)
    w = scenario.window_s
    events = [e for c in scenario.starts() for e in (ScaleEvent(c + 2 * w, scenario.added),
                                                     ScaleEvent(c + 4 * w, -scenario.added))]
    joins = schedule(sim, events, warm)
    sim.run()
    reqs = sim.requests

    def window(k: int) -> list:
        return [r for c in scenario.starts() for r in reqs if c + k * w <= r.arrival < c + (k + 1) * w]

    def p99(rs: list) -> float:
        return _p99([r.t_first - r.arrival for r in rs])

    new = {j.replica for j in joins}
    steady_w, out_w, in_w = window(1), window(2), window(4)
    steady, out, back = p99(steady_w), p99(out_w), p99(in_w)
    return {"router": router, "start": "warm" if warm else "cold", "replicas": scenario.replicas,
            "added": scenario.added, "cycles": scenario.cycles, "steady_p99": steady, "out_p99": out,
            "out_ratio": out / steady, "in_p99": back, "in_ratio": back / steady,
            "new_replica_loads": sum(1 for r in out_w if r.loaded and r.replica in new),
            "new_replica_requests": sum(1 for r in out_w if r.replica in new),
            "steady_loads": sum(1 for r in steady_w if r.loaded), "out_loads": sum(1 for r in out_w if r.loaded),
            "in_loads": sum(1 for r in in_w if r.loaded),
            "warm_slots": sum(j.warm_slots for j in joins) / max(1, len(joins)),
            "join_delay_s": max((j.joined - j.decided for j in joins), default=0.0),
            "requests": len(reqs), "wall_seconds": time.perf_counter() - started, "scenario": asdict(scenario)}

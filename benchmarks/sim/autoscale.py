"""Autoscaling the simulated fleet with ``routing.autoscale``'s rules, as the live Serve policy does.

Why: the live policy (``deployments/autoscaling.py``) can only be tried at 2-3 replicas here;
this drives the same rules (``queue_only_replicas`` / ``adapter_aware_replicas`` and
``ReplicaScaler``'s hysteresis) over a fleet of tens of replicas and a whole compressed day.

Every ``tick_s`` the controller reads what Serve's context and the replicas' custom metrics
would give it:

- ongoing requests: arrived and not finished (running plus queued at the router), averaged
  over ``look_back_s`` like Serve's ``look_back_period_s``;
- loads per second and the working set: a ``routing.autoscale.DemandWindow`` over the last
  ``window_s`` fed with every arrival's adapter and the pools' load counters, the working set
  through the same k-minimum-values sketch the replicas export.

A decision to grow starts replicas that take traffic ``startup_s`` later (model start-up),
then warm-start (``scale_events.add_replica``); a decision to shrink drains the newest
replica. Replica-seconds count every replica from its start decision to its removal.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from routing.autoscale import (
    AutoscaleSettings,
    DemandWindow,
    FleetSignals,
    ReplicaScaler,
    working_set_size,
    working_set_sketch,
)

from .fleet import Simulator
from .scale_events import Join, add_replica, remove_replica

Rule = Callable[[FleetSignals, AutoscaleSettings], int]


@dataclass(frozen=True)
class ControlLoop:
    tick_s: float = 2.0
    look_back_s: float = 30.0   # Serve's default look_back_period_s
    window_s: float = 60.0      # the replicas' demand window (loads/s, working set)
    startup_s: float = 30.0     # decision -> a new replica can load adapters (model start-up)
    warm_start: bool = True


class FleetAutoscaler:
    """Drives ``sim``'s replica count with ``rule`` + ``ReplicaScaler`` on the simulated clock."""

    def __init__(self, sim: Simulator, rule: Rule, settings: AutoscaleSettings, loop: ControlLoop = ControlLoop()):
        if len(sim.routable) < settings.min_replicas:
            raise ValueError(f"the fleet starts with {len(sim.routable)} replicas, below min_replicas "
                             f"{settings.min_replicas}")
        self.sim, self.rule, self.settings, self.loop = sim, rule, settings, loop
        self.scaler = ReplicaScaler(settings)
        self.demand = DemandWindow(loop.window_s)
        self.samples: deque[tuple[float, float]] = deque()
        self.target = len(sim.routable)
        self.started = {i: 0.0 for i in sim.routable}  # replica -> when it was asked for
        self.stopped: dict[int, float] = {}
        self.joins: list[Join] = []
        self.history: list[tuple[float, int, int]] = []  # (time, desired, decision) at each change
        self.pending: dict[object, float] = {}  # start decisions not yet joined -> when decided
        self.cancelled_seconds = 0.0
        self._seen = 0

    def start(self) -> None:
        self.sim.at(0.0, self.tick)

    def signals(self, now: float) -> FleetSignals:
        sim = self.sim
        arrivals = sim.requests
        while self._seen < len(arrivals) and arrivals[self._seen].arrival <= now:
            self.demand.requested(arrivals[self._seen].uid, now)
            self._seen += 1
        self.demand.observe_loads(sum(r.pool.counters.loads for r in sim.replicas), now)
        self.samples.append((now, float(self._seen - sim.done)))
        while self.samples[0][0] < now - self.loop.look_back_s:
            self.samples.popleft()
        ongoing = sum(v for _, v in self.samples) / len(self.samples)
        working_set = working_set_size([working_set_sketch(self.demand.names(now))])
        return FleetSignals(len(sim.routable), ongoing, self.demand.loads_per_s(now), working_set)

    def tick(self) -> None:
        sim, now = self.sim, self.sim.now
        desired = self.rule(self.signals(now), self.settings)
        decision = self.scaler.decide(desired, self.target, now)
        if decision != self.target:
            self.history.append((now, desired, decision))
        while self.target < decision:
            self.target += 1
            token = object()
            self.pending[token] = now
            sim.at(now + self.loop.startup_s, lambda token=token: self._join(token))
        while self.target > decision:
            self.target -= 1
            self._leave(now)
        if self._seen < len(sim.requests) or sim.done < len(sim.requests):
            sim.at(now + self.loop.tick_s, self.tick)

    def _join(self, token: object) -> None:
        decided = self.pending.pop(token, None)
        if decided is None:
            return  # cancelled while starting
        replica = add_replica(self.sim, self.loop.warm_start, self.joins)
        self.started[replica.idx] = decided

    def _leave(self, now: float) -> None:
        """Serve stops a replica that is still starting first, else the newest running one drains."""
        if self.pending:
            _, decided = self.pending.popitem()
            self.cancelled_seconds += now - decided
            return
        if len(self.sim.routable) < 2:  # the others are still reading their warm start
            self.target += 1
            return
        self.stopped[remove_replica(self.sim, self.loop.warm_start).idx] = now

    def replica_seconds(self, end: float) -> float:
        return self.cancelled_seconds + sum(self.stopped.get(i, end) - t for i, t in self.started.items())

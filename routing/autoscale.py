"""How many LoRAWorker replicas the fleet wants: queue length and adapter pressure, with hysteresis.

Pure and deterministic (time is passed in), so the live Serve policy
(``deployments/autoscaling.py``) and the fleet simulator run the same rules.

- ``queue_only_replicas`` is Serve's default idea: enough replicas that each holds about
  ``target_ongoing_per_replica`` requests.
- ``adapter_aware_replicas`` also sizes the fleet's slots to the working set of adapters in
  demand (``working_set × headroom`` slots besides those pins hold) and adds a replica while the fleet pays more than
  ``max_loads_per_s_per_replica`` loads per second per replica. It lets the fleet shrink only
  when the working set still fits and the load rate would stay under that bound.
- ``ReplicaScaler`` turns a momentary wish into a decision: up only after the wish persisted
  ``upscale_delay_s``, down one replica at a time after ``downscale_delay_s``, never below
  ``min_replicas`` nor above ``max_replicas``.

The working set is counted across replicas with a k-minimum-values sketch
(``working_set_sketch`` / ``working_set_size``): each replica exports the k smallest hashes
of the adapter names it was asked for, as plain numbers (Serve's custom metrics are
``str -> float``); the union's k smallest give the exact count up to k and an estimate
(standard error about 1/sqrt(k)) beyond.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .hashing import stable_hash

SKETCH_SIZE = 64
SKETCH_EMPTY = 2.0  # above every hash in [0, 1): an unused sketch entry


@dataclass(frozen=True)
class AutoscaleSettings:
    """The scaling rule's knobs; bad values are a ``ValueError`` naming the field."""

    min_replicas: int
    max_replicas: int
    target_ongoing_per_replica: float
    slots_per_replica: int
    max_loads_per_s_per_replica: float
    working_set_headroom: float = 1.0
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= max(1, min_replicas "
                             f"({self.min_replicas}))")
        if not self.target_ongoing_per_replica > 0:
            raise ValueError(f"target_ongoing_per_replica must be > 0, got {self.target_ongoing_per_replica}")
        if self.slots_per_replica < 1:
            raise ValueError(f"slots_per_replica must be >= 1, got {self.slots_per_replica}")
        if not self.max_loads_per_s_per_replica > 0:
            raise ValueError(f"max_loads_per_s_per_replica must be > 0, got {self.max_loads_per_s_per_replica}")
        if not self.working_set_headroom >= 1.0:
            raise ValueError(f"working_set_headroom must be >= 1, got {self.working_set_headroom}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class FleetSignals:
    """What the fleet reports: its size, requests in it (queued included), loads/s, working set, and the
    slots its pins hold (those slots cannot take the working set)."""

    replicas: int
    ongoing_requests: float
    loads_per_s: float
    working_set: int
    pinned_slots: int = 0

    def __post_init__(self) -> None:
        for name in ("replicas", "ongoing_requests", "loads_per_s", "working_set", "pinned_slots"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def queue_need(signals: FleetSignals, settings: AutoscaleSettings) -> int:
    """Replicas that keep each near ``target_ongoing_per_replica`` requests (unclamped)."""
    return math.ceil(signals.ongoing_requests / settings.target_ongoing_per_replica - 1e-9)


def slot_need(signals: FleetSignals, settings: AutoscaleSettings) -> int:
    """Replicas whose slots hold the pins plus the working set with headroom (unclamped)."""
    wanted = signals.working_set * settings.working_set_headroom + signals.pinned_slots
    return math.ceil(wanted / settings.slots_per_replica - 1e-9)


def load_need(signals: FleetSignals, settings: AutoscaleSettings) -> int:
    """One more replica while loads/s exceed the bound for this fleet; otherwise the fewest replicas
    that keep the load rate under it (so the fleet never shrinks into load pressure)."""
    bound = settings.max_loads_per_s_per_replica
    if signals.loads_per_s > bound * signals.replicas:
        return signals.replicas + 1
    return math.ceil(signals.loads_per_s / bound - 1e-9)


def queue_only_replicas(signals: FleetSignals, settings: AutoscaleSettings) -> int:
    """Serve's default rule: ceil(ongoing / target), clamped to [min, max]."""
    return settings.clamp(queue_need(signals, settings))


def adapter_aware_replicas(signals: FleetSignals, settings: AutoscaleSettings) -> int:
    """The larger of the queue's need and the adapters' need (slots for the working set, load rate)."""
    return settings.clamp(max(queue_need(signals, settings), slot_need(signals, settings),
                              load_need(signals, settings)))


class ReplicaScaler:
    """Hysteresis over a stream of wishes: ``decide(desired_now, current, now)`` -> replicas to run.

    A wish to grow must persist ``upscale_delay_s`` (then the fleet jumps to it); a wish to shrink
    must persist ``downscale_delay_s`` and then removes one replica, and the next step down waits
    another full delay. A wish that changes direction or goes away restarts the clock.
    """

    def __init__(self, settings: AutoscaleSettings):
        self.settings = settings
        self._direction = 0  # +1 wanting more, -1 wanting fewer, 0 content
        self._since: float | None = None

    def decide(self, desired_now: int, current: int, now: float) -> int:
        settings = self.settings
        desired = settings.clamp(desired_now)
        if current < settings.min_replicas or current > settings.max_replicas:
            self._reset()
            return settings.clamp(current)  # outside the bounds: back inside at once
        direction = (desired > current) - (desired < current)
        if direction == 0:
            self._reset()
            return current
        if direction != self._direction or self._since is None:
            self._direction, self._since = direction, now
        delay = settings.upscale_delay_s if direction > 0 else settings.downscale_delay_s
        if now - self._since + 1e-9 < delay:
            return current
        if direction > 0:
            self._reset()
            return desired
        self._since = now  # one step down; the next one waits a whole delay again
        return max(desired, current - 1, settings.min_replicas)

    def with_settings(self, settings: AutoscaleSettings) -> ReplicaScaler:
        """The same wish and clock under new settings (bounds or slots changed between calls)."""
        scaler = ReplicaScaler(settings)
        scaler._direction, scaler._since = self._direction, self._since
        return scaler

    def _reset(self) -> None:
        self._direction, self._since = 0, None


def _unit_hash(name: str) -> float:
    """``name``'s stable hash as a float in [0, 1) (53 bits: distinct names never collide in practice)."""
    return (stable_hash(name) >> 11) / float(1 << 53)


def working_set_sketch(names: Iterable[str], k: int = SKETCH_SIZE) -> list[float]:
    """The k smallest unit hashes of the distinct ``names``, padded with ``SKETCH_EMPTY`` to k entries."""
    smallest = sorted({_unit_hash(n) for n in names})[:k]
    return smallest + [SKETCH_EMPTY] * (k - len(smallest))


def working_set_size(sketches: Iterable[Iterable[float]], k: int = SKETCH_SIZE) -> int:
    """Distinct names across replicas' sketches: exact up to k, the KMV estimate (k-1)/h_k beyond."""
    union = sorted({v for sketch in sketches for v in sketch if 0.0 <= v < 1.0})
    if len(union) < k:
        return len(union)
    return max(k, round((k - 1) / union[k - 1]))


class DemandWindow:
    """One replica's recent demand: adapter names requested and pool loads over the last ``window_s``.

    What ``LoRAWorker.record_autoscaling_stats`` exports; times are passed in (monotonic seconds).
    """

    def __init__(self, window_s: float):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._last_requested: dict[str, float] = {}
        self._loads: deque[tuple[float, int]] = deque()

    def requested(self, name: str, now: float) -> None:
        self._last_requested[name] = now

    def observe_loads(self, total_loads: int, now: float) -> None:
        """The pool's cumulative load count at ``now``."""
        self._loads.append((now, total_loads))
        while len(self._loads) > 2 and self._loads[1][0] <= now - self.window_s:
            self._loads.popleft()  # keep one sample at or before the window's start

    def loads_per_s(self, now: float) -> float:
        """Loads in the window over the whole window: a young replica's first loads do not read as a storm."""
        if len(self._loads) < 2:
            return 0.0
        (_, n0), (_, n1) = self._loads[0], self._loads[-1]
        return (n1 - n0) / self.window_s

    def names(self, now: float) -> list[str]:
        """Adapters requested within the window (older ones are forgotten here)."""
        cutoff = now - self.window_s
        for name in [n for n, t in self._last_requested.items() if t < cutoff]:
            del self._last_requested[name]
        return sorted(self._last_requested)

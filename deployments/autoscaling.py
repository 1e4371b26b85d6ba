"""The LoRAWorker autoscaling policy for Ray Serve (``autoscaling_config.policy``).

Serve instantiates a class-valued ``policy_function`` once per deployment config with
``policy_kwargs`` and calls it every control-loop tick with an ``AutoscalingContext``, so the
instance keeps the ``ReplicaScaler``'s hysteresis between calls. The rules are
``routing/autoscale.py``'s; this file only reads the context:

- ongoing requests: ``ctx.total_num_requests`` (running plus queued at handles, Serve's own);
- per replica, its latest custom metrics from ``LoRAWorker.record_autoscaling_stats``:
  ``lorafleet_slots``, ``lorafleet_pinned_slots``, ``lorafleet_loads_per_s`` and the working-set sketch
  ``lorafleet_ws_<i>`` (the fleet's working set is the sketches' union).

Serve applies its own ``upscale_delay_s`` / ``downscale_delay_s`` to what a policy returns; the
delays here replace them, so set both to 0 in ``autoscaling_config`` (a non-zero one is
warned about once: the two delays would add up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from routing.autoscale import (
    SKETCH_SIZE,
    AutoscaleSettings,
    FleetSignals,
    ReplicaScaler,
    adapter_aware_replicas,
    queue_only_replicas,
    working_set_size,
)

log = logging.getLogger("ray.serve")
SLOTS_METRIC = "lorafleet_slots"
LOADS_METRIC = "lorafleet_loads_per_s"
PINNED_METRIC = "lorafleet_pinned_slots"
SKETCH_PREFIX = "lorafleet_ws_"
RULES = {"adapter_aware": adapter_aware_replicas, "queue_only": queue_only_replicas}


def sketch_metric(index: int) -> str:
    return f"{SKETCH_PREFIX}{index}"


def _latest(series: Any) -> float | None:
    """The newest value of a replica's metric time series (a list of ``TimeStampedValue``)."""
    if not series:
        return None
    return float(max(series, key=lambda point: point.timestamp).value)


def fleet_signals(ctx) -> tuple[FleetSignals, int | None]:
    """The fleet's signals from an ``AutoscalingContext``, and the slots per replica its replicas report."""
    raw: Mapping[str, Mapping[Any, Any]] = ctx.raw_metrics or {}
    latest = {name: {replica: _latest(series) for replica, series in per_replica.items()}
              for name, per_replica in raw.items()}
    loads = sum(v for v in latest.get(LOADS_METRIC, {}).values() if v is not None)
    pinned = sum(int(v) for v in latest.get(PINNED_METRIC, {}).values() if v is not None)
    replicas_with_sketch = set().union(*(latest.get(sketch_metric(i), {}).keys() for i in range(SKETCH_SIZE)))
    sketches = [[latest.get(sketch_metric(i), {}).get(replica) for i in range(SKETCH_SIZE)]
                for replica in replicas_with_sketch]
    working_set = working_set_size([[v for v in sketch if v is not None] for sketch in sketches])
    slots = [int(v) for v in latest.get(SLOTS_METRIC, {}).values() if v is not None]
    signals = FleetSignals(replicas=ctx.current_num_replicas, ongoing_requests=max(0.0, float(ctx.total_num_requests)),
                           loads_per_s=max(0.0, loads), working_set=working_set, pinned_slots=max(0, pinned))
    return signals, (min(slots) if slots else None)


class AdapterAwarePolicy:
    """``policy_function: deployments.autoscaling:AdapterAwarePolicy``; ``policy_kwargs`` are the knobs
    ``AutoscaleSettings`` has beyond Serve's own (min/max replicas and target_ongoing_requests come
    from ``autoscaling_config``; slots per replica from the replicas' reports)."""

    def __init__(self, max_loads_per_s_per_replica: float = 0.5, working_set_headroom: float = 1.0,
                 upscale_delay_s: float = 10.0, downscale_delay_s: float = 60.0,
                 slots_per_replica: int = 1, rule: str = "adapter_aware"):
        if rule not in RULES:
            raise ValueError(f"rule {rule!r} is unknown; use one of {sorted(RULES)}")
        self.rule = RULES[rule]
        self.knobs = {"max_loads_per_s_per_replica": max_loads_per_s_per_replica,
                          "working_set_headroom": working_set_headroom, "upscale_delay_s": upscale_delay_s,
                          "downscale_delay_s": downscale_delay_s}
        self.default_slots = slots_per_replica
        AutoscaleSettings(min_replicas=0, max_replicas=1, target_ongoing_per_replica=1.0,
                          slots_per_replica=slots_per_replica, **self.knobs)  # bad knobs fail the deploy here
        self._scaler: ReplicaScaler | None = None
        self._warned_delays = False

    def settings(self, ctx, slots: int | None) -> AutoscaleSettings:
        config = ctx.config
        return AutoscaleSettings(min_replicas=ctx.capacity_adjusted_min_replicas,
                                 max_replicas=max(1, ctx.capacity_adjusted_max_replicas),
                                 target_ongoing_per_replica=float(config.get_target_ongoing_requests()),
                                 slots_per_replica=slots or self.default_slots, **self.knobs)

    def __call__(self, ctx) -> tuple[int, dict]:
        signals, slots = fleet_signals(ctx)
        settings = self.settings(ctx, slots)
        if self._scaler is None or self._scaler.settings != settings:
            self._scaler = ReplicaScaler(settings) if self._scaler is None else self._scaler.with_settings(settings)
        if not self._warned_delays and (ctx.config.upscale_delay_s or ctx.config.downscale_delay_s):
            self._warned_delays = True
            log.warning("lorafleet autoscaling: autoscaling_config's upscale_delay_s/downscale_delay_s are not 0; "
                        "Serve applies them after this policy's own delays (set them to 0)")
        desired = self.rule(signals, settings)
        now = ctx.current_time if ctx.current_time is not None else time.time()
        decision = self._scaler.decide(desired, ctx.target_num_replicas, now)
        state = dict(ctx.policy_state or {})
        state["lorafleet"] = {"desired": desired, "decision": decision, "ongoing": signals.ongoing_requests,
                              "loads_per_s": signals.loads_per_s, "working_set": signals.working_set,
                              "pinned_slots": signals.pinned_slots,
                              "slots_per_replica": settings.slots_per_replica}
        if decision != ctx.target_num_replicas:
            log.info("lorafleet autoscaling: %d -> %d replicas (wanted %d; ongoing %.1f, loads/s %.2f, "
                     "working set %d, %d pinned slots, %d slots each)", ctx.target_num_replicas, decision, desired,
                     signals.ongoing_requests, signals.loads_per_s, signals.working_set, signals.pinned_slots,
                     settings.slots_per_replica)
        return decision, state

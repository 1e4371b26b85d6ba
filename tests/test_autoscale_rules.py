"""The autoscaling rules (routing/autoscale.py) and the Serve policy that wraps them, on real
``AutoscalingContext`` values (no cluster: the context is a plain object)."""

from __future__ import annotations

import pytest

from routing.autoscale import (
    SKETCH_EMPTY,
    AutoscaleSettings,
    FleetSignals,
    ReplicaScaler,
    adapter_aware_replicas,
    queue_only_replicas,
    working_set_size,
    working_set_sketch,
)

pytestmark = pytest.mark.unit

SETTINGS = AutoscaleSettings(min_replicas=2, max_replicas=6, target_ongoing_per_replica=4.0, slots_per_replica=3,
                             max_loads_per_s_per_replica=0.5, working_set_headroom=1.0)


def signals(replicas=2, ongoing=0.0, loads=0.0, working_set=0) -> FleetSignals:
    return FleetSignals(replicas=replicas, ongoing_requests=ongoing, loads_per_s=loads, working_set=working_set)


# ---------------------------------------------------------------------- the two rules

def test_queue_only_is_ceil_of_ongoing_over_target_clamped():
    assert queue_only_replicas(signals(ongoing=0), SETTINGS) == 2  # min
    assert queue_only_replicas(signals(ongoing=12), SETTINGS) == 3
    assert queue_only_replicas(signals(ongoing=12.5), SETTINGS) == 4
    assert queue_only_replicas(signals(ongoing=1000), SETTINGS) == 6  # max


def test_queue_only_ignores_adapters():
    assert queue_only_replicas(signals(ongoing=4, loads=10.0, working_set=15), SETTINGS) == 2


def test_a_working_set_beyond_the_slots_asks_for_replicas_that_hold_it():
    # 2 replicas x 3 slots = 6 slots; 9 adapters in demand need 3 replicas, with a short queue
    assert adapter_aware_replicas(signals(ongoing=1, working_set=9), SETTINGS) == 3
    roomy = AutoscaleSettings(**{**SETTINGS.__dict__, "working_set_headroom": 1.5})
    assert adapter_aware_replicas(signals(ongoing=1, working_set=9), roomy) == 5  # ceil(13.5 / 3)


def test_loads_above_the_bound_add_one_replica():
    assert adapter_aware_replicas(signals(replicas=3, loads=1.6, working_set=3), SETTINGS) == 4  # 1.6 > 0.5 * 3
    assert adapter_aware_replicas(signals(replicas=3, loads=1.5, working_set=3), SETTINGS) == 3  # at the bound: hold


def test_adapter_aware_shrinks_when_the_working_set_fits_and_queues_are_short():
    assert adapter_aware_replicas(signals(replicas=4, ongoing=2, loads=0.0, working_set=5), SETTINGS) == 2
    # the load rate would exceed the bound on fewer replicas: keep enough for it
    assert adapter_aware_replicas(signals(replicas=4, ongoing=2, loads=1.2, working_set=5), SETTINGS) == 3


def test_adapter_aware_is_never_below_queue_only():
    for ongoing in (0, 3, 9, 17, 40):
        for ws in (0, 4, 12):
            s = signals(replicas=3, ongoing=ongoing, working_set=ws)
            assert adapter_aware_replicas(s, SETTINGS) >= queue_only_replicas(s, SETTINGS)


def test_bad_settings_and_signals_are_refused_by_name():
    with pytest.raises(ValueError, match="max_replicas"):
        AutoscaleSettings(min_replicas=3, max_replicas=2, target_ongoing_per_replica=1, slots_per_replica=1,
                          max_loads_per_s_per_replica=1)
    with pytest.raises(ValueError, match="working_set_headroom"):
        AutoscaleSettings(min_replicas=1, max_replicas=2, target_ongoing_per_replica=1, slots_per_replica=1,
                          max_loads_per_s_per_replica=1, working_set_headroom=0.5)
    with pytest.raises(ValueError, match="loads_per_s"):
        signals(loads=float("nan"))


# ---------------------------------------------------------------------- hysteresis

DELAYED = AutoscaleSettings(**{**SETTINGS.__dict__, "upscale_delay_s": 5.0, "downscale_delay_s": 20.0})


def test_scale_up_waits_for_the_wish_to_persist():
    scaler = ReplicaScaler(DELAYED)
    assert scaler.decide(4, 2, now=0.0) == 2
    assert scaler.decide(4, 2, now=4.9) == 2
    assert scaler.decide(4, 2, now=5.0) == 4


def test_a_wish_that_goes_away_restarts_the_clock():
    scaler = ReplicaScaler(DELAYED)
    scaler.decide(4, 2, now=0.0)
    assert scaler.decide(2, 2, now=3.0) == 2
    assert scaler.decide(4, 2, now=4.0) == 2
    assert scaler.decide(4, 2, now=8.9) == 2
    assert scaler.decide(4, 2, now=9.0) == 4


def test_scale_down_goes_one_step_per_delay_and_stops_at_min():
    scaler = ReplicaScaler(DELAYED)
    current, decisions = 5, []
    for t in range(0, 100, 5):
        current = scaler.decide(0, current, now=float(t))
        decisions.append(current)
    assert decisions[:4] == [5, 5, 5, 5] and decisions[4] == 4  # 20 s later: one step
    assert decisions[8] == 3 and decisions[12] == 2
    assert min(decisions) == 2  # never below min_replicas


def test_outside_the_bounds_comes_back_at_once():
    scaler = ReplicaScaler(DELAYED)
    assert scaler.decide(2, 1, now=0.0) == 2
    assert scaler.decide(6, 9, now=0.0) == 6


def test_the_scaler_is_deterministic():
    wishes = [(3, 0.0), (3, 2.0), (5, 6.0), (2, 7.0), (2, 30.0), (2, 55.0), (4, 56.0), (4, 70.0)]

    def run() -> list[int]:
        scaler, current, out = ReplicaScaler(DELAYED), 2, []
        for desired, now in wishes:
            current = scaler.decide(desired, current, now)
            out.append(current)
        return out

    assert run() == run()


# ---------------------------------------------------------------------- working-set sketch

def test_the_sketch_counts_distinct_names_across_replicas_exactly_up_to_k():
    a = working_set_sketch([f"ad-{i}" for i in range(10)])
    b = working_set_sketch([f"ad-{i}" for i in range(5, 20)])
    assert working_set_size([a, b]) == 20
    assert working_set_size([working_set_sketch([])]) == 0
    assert a.count(SKETCH_EMPTY) == len(a) - 10


def test_the_sketch_estimates_large_working_sets_within_a_few_tenths():
    names = [f"adapter-{i}" for i in range(2000)]
    sketches = [working_set_sketch(names[i::4]) for i in range(4)]
    assert abs(working_set_size(sketches) - 2000) / 2000 < 0.3

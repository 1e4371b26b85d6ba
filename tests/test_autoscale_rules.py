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


def signals(replicas=2, ongoing=0.0, loads=0.0, working_set=0, pinned=0) -> FleetSignals:
    return FleetSignals(replicas=replicas, ongoing_requests=ongoing, loads_per_s=loads, working_set=working_set,
                        pinned_slots=pinned)


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


def test_slots_held_by_pins_do_not_count_for_the_working_set():
    assert adapter_aware_replicas(signals(working_set=4), SETTINGS) == 2  # 4 of 6 slots
    assert adapter_aware_replicas(signals(working_set=4, pinned=3), SETTINGS) == 3  # 3 pinned + 4 > 6


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


# ---------------------------------------------------------------------- the Serve policy on AutoscalingContext

def context(policy_state=None, *, ongoing=0.0, replicas=2, target=None, now=0.0, per_replica=None,
            min_replicas=2, max_replicas=4, target_ongoing=4.0):
    """A real ``AutoscalingContext`` whose raw custom metrics are what ``per_replica`` maps to each replica:
    {"r0": {"slots": 3, "loads_per_s": 0.1, "adapters": [...]}}."""
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from deployments.autoscaling import (
        LOADS_METRIC,
        PINNED_METRIC,
        SLOTS_METRIC,
        sketch_metric,
    )

    dep = DeploymentID(name="LoRAWorker", app_name="lorafleet")
    ids = {r: ReplicaID(unique_id=r, deployment_id=dep) for r in (per_replica or {})}
    raw: dict = {}
    for r, m in (per_replica or {}).items():
        values = {SLOTS_METRIC: m["slots"], LOADS_METRIC: m["loads_per_s"], PINNED_METRIC: m.get("pinned", 0)}
        values.update({sketch_metric(i): v for i, v in enumerate(working_set_sketch(m["adapters"]))})
        for name, value in values.items():  # an older sample first: the policy reads the newest
            raw.setdefault(name, {})[ids[r]] = [TimeStampedValue(now - 5, -1.0), TimeStampedValue(now, float(value))]
    config = AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                               target_ongoing_requests=target_ongoing, upscale_delay_s=0, downscale_delay_s=0)
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=replicas,
        target_num_replicas=replicas if target is None else target, running_replicas=list(ids.values()),
        total_num_requests=ongoing, total_queued_requests=0.0, aggregated_metrics={}, raw_metrics=raw,
        capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state=policy_state or {}, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=config)


def fleet(adapters_per_replica, loads=0.0):
    return {f"r{i}": {"slots": 3, "loads_per_s": loads, "adapters": a} for i, a in enumerate(adapters_per_replica)}


def test_the_policy_reads_the_working_set_across_replicas_from_the_context():
    from deployments.autoscaling import fleet_signals

    per_replica = fleet([["a", "b", "c"], ["c", "d"]], 0.25)
    per_replica["r1"]["pinned"] = 2
    signals, slots = fleet_signals(context(ongoing=3.0, per_replica=per_replica))
    assert (signals.working_set, signals.loads_per_s, signals.ongoing_requests, signals.pinned_slots, slots) == \
        (4, 0.5, 3.0, 2, 3)


def test_the_policy_scales_out_for_a_working_set_beyond_the_slots_after_its_delay():
    from deployments.autoscaling import AdapterAwarePolicy

    policy = AdapterAwarePolicy(upscale_delay_s=5.0, downscale_delay_s=30.0)
    seven = fleet([["a", "b", "c", "d"], ["e", "f", "g"]])  # 7 adapters > 6 slots; short queues
    decision, state = policy(context(ongoing=1.0, per_replica=seven, now=100.0))
    assert decision == 2 and state["lorafleet"]["desired"] == 3
    decision, _ = policy(context(ongoing=1.0, per_replica=seven, now=105.0))
    assert decision == 3
    queue_only = AdapterAwarePolicy(upscale_delay_s=0.0, rule="queue_only")
    assert queue_only(context(ongoing=1.0, per_replica=seven, now=0.0))[0] == 2  # blind to the adapters


def test_the_policy_scales_in_one_step_after_its_delay_and_never_below_min():
    from deployments.autoscaling import AdapterAwarePolicy

    policy = AdapterAwarePolicy(upscale_delay_s=0.0, downscale_delay_s=30.0)
    idle = fleet([["a"], ["a"], ["b"], []])
    assert policy(context(replicas=4, per_replica=idle, now=0.0))[0] == 4
    assert policy(context(replicas=4, per_replica=idle, now=29.0))[0] == 4
    assert policy(context(replicas=4, per_replica=idle, now=30.0))[0] == 3
    assert policy(context(replicas=3, per_replica=idle, now=31.0))[0] == 3  # the next step waits a whole delay
    assert policy(context(replicas=3, per_replica=idle, now=60.0))[0] == 2
    assert policy(context(replicas=2, per_replica=idle, now=200.0))[0] == 2


def test_the_policy_goes_through_serves_own_wrapper_unchanged():
    """Serve wraps the policy (scaling factors, its delays, bounds): with its delays at 0 the decision passes."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    from deployments.autoscaling import AdapterAwarePolicy

    wrapped = _apply_autoscaling_config(AdapterAwarePolicy(upscale_delay_s=0.0, max_loads_per_s_per_replica=0.5))
    churning = fleet([["a"], ["b"]], loads=0.75)  # 1.5 loads/s > 0.5 x 2 replicas
    decision, state = wrapped(context(ongoing=2.0, per_replica=churning, now=10.0))
    assert decision == 3 and state["lorafleet"]["loads_per_s"] == 1.5


def test_bad_policy_kwargs_fail_the_deploy_by_name():
    from deployments.autoscaling import AdapterAwarePolicy

    with pytest.raises(ValueError, match="rule"):
        AdapterAwarePolicy(rule="fastest")
    with pytest.raises(ValueError, match="working_set_headroom"):
        AdapterAwarePolicy(working_set_headroom=0.2)


# ---------------------------------------------------------------------- one replica's demand window

def test_the_demand_window_counts_loads_per_second_and_forgets_old_names():
    from routing.autoscale import DemandWindow

    window = DemandWindow(window_s=10.0)
    for t in range(21):
        window.observe_loads(total_loads=t // 2, now=float(t))  # one load every 2 s
    assert window.loads_per_s(20.0) == pytest.approx(0.5, abs=0.06)
    window.requested("a", 1.0)
    window.requested("b", 15.0)
    assert window.names(20.0) == ["b"]
    assert DemandWindow(5.0).loads_per_s(0.0) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        DemandWindow(0)

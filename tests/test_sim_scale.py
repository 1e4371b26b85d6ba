"""Scale events, warm start and autoscaling in the fleet simulator; the time-varying traces."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.sim import SimConfig, Simulator, run_sim
from benchmarks.sim.autoscale import ControlLoop, FleetAutoscaler
from benchmarks.sim.autoscale_scenario import AutoscaleScenario, compare, run_autoscale
from benchmarks.sim.scale_events import (
    ScaleEvent,
    add_replica,
    remove_replica,
    schedule,
)
from benchmarks.sim.scale_scenario import ScaleScenario, run_scale
from benchmarks.traces import (
    Diurnal,
    Popularity,
    make_diurnal_trace,
    make_profile_trace,
    make_trace,
    profile_arrivals,
)
from routing.autoscale import (
    AutoscaleSettings,
    adapter_aware_replicas,
    queue_only_replicas,
)
from routing.hashing import rendezvous_order


def trace(n: int = 1200, adapters: int = 40, replicas: int = 4, seed: int = 3):
    return make_trace(n, adapters, Popularity("power", 0.3), rate=replicas * 16 * 0.4 / 6.5, cv=2.0, seed=seed)


def comparable(result) -> dict:
    d = dataclasses.asdict(result)
    d.pop("wall_seconds")
    return d


@pytest.mark.parametrize("router", ["affinity", "multiplex", "hash", "least_loaded"])
def test_a_run_with_no_events_is_the_plain_run(router: str) -> None:
    t = trace()
    sim = Simulator(t, SimConfig(replicas=4, router=router))
    assert schedule(sim, [], warm=True) == []
    assert comparable(sim.run()) == comparable(run_sim(t, SimConfig(replicas=4, router=router)))


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("router", ["affinity", "multiplex", "hash", "least_loaded"])
def test_joined_replicas_take_traffic_only_after_joining_and_removed_ones_drain(router: str, warm: bool) -> None:
    t = trace()
    sim = Simulator(t, SimConfig(replicas=4, router=router))
    out_at, in_at = float(t.arrivals[400]), float(t.arrivals[800])
    joins = schedule(sim, [ScaleEvent(out_at, 2), ScaleEvent(in_at, -3)], warm)
    result = sim.run()
    assert len(joins) == 2 and len(sim.replicas) == 6
    assert sim.routable == [0, 1, 2] and sim.ids == ("replica-0000", "replica-0001", "replica-0002")
    assert sum(r.served for r in sim.replicas) == len(t) == sim.done
    assert all(r.ongoing == 0 for r in sim.replicas) and not sim.ongoing.any()
    for join in joins:
        sent = [r.t_dispatch for r in sim.requests if r.replica == join.replica]
        assert sent and min(sent) >= join.joined >= join.decided == out_at
        assert join.warm_slots <= sim.config.slots - 1
        assert warm or join.warm_slots == 0
    for idx in (3, 4, 5):  # the newest three left at in_at: nothing was sent to them afterwards
        assert all(r.t_dispatch <= in_at for r in sim.requests if r.replica == idx)
    assert result.requests == len(t) - int(len(t) * sim.config.warmup_fraction)


def test_warm_start_loads_the_plan_before_traffic_and_saves_loads_there() -> None:
    """Over three traces: never more loads on the new replica warm than cold, and fewer in all (one trace
    alone can tie: demand reaches the plan once a second, as the workers' heartbeats carry it)."""
    saved = 0
    for seed in (3, 4, 5):
        t = trace(n=1500, adapters=30, seed=seed)
        out_at = float(t.arrivals[600])
        loads = {}
        for warm in (False, True):
            sim = Simulator(t, SimConfig(replicas=4, router="affinity"))
            joins = schedule(sim, [ScaleEvent(out_at, 1)], warm)
            sim.run()
            new = sim.replicas[joins[0].replica]
            loads[warm] = sum(1 for r in sim.requests if r.replica == new.idx and r.loaded)
            if warm:
                assert 0 < joins[0].warm_slots <= sim.config.slots - 1
                assert joins[0].joined > joins[0].decided  # the reads took time
                assert new.pool.counters.loads >= joins[0].warm_slots
        assert loads[True] <= loads[False]
        saved += loads[False] - loads[True]
    assert saved > 0


def test_warm_adapters_are_what_the_placement_plan_would_give_the_new_replica() -> None:
    t = trace(n=800, adapters=30)
    sim = Simulator(t, SimConfig(replicas=3, router="affinity"))
    stop = float(t.arrivals[700])
    grabbed: dict = {}

    def join() -> None:
        # the directory's trial re-plan with the newcomer, as add_replica asks it (before the join)
        grabbed["planned"] = sim.directory.planned_for(f"replica-{len(sim.replicas):04d}", sim.config.slots,
                                                       sim.config.max_batch)
        replica = add_replica(sim, True, [])
        grabbed.update(replica=replica, slots=set(replica.pool.uid_to_slot))

    sim.at(stop, join)
    sim.run()
    slots, planned = grabbed["slots"], grabbed["planned"]
    assert slots and len(slots) <= sim.config.slots - 1
    # it warmed what the plan would send it (of the adapters some replica holds: known to be in use)
    assert slots <= set(planned)


def test_bad_scale_events_are_refused() -> None:
    sim = Simulator(trace(n=50), SimConfig(replicas=1, router="affinity"))
    with pytest.raises(ValueError, match="last routable"):
        remove_replica(sim, warm=True)
    with pytest.raises(ValueError, match="non-zero delta"):
        schedule(sim, [ScaleEvent(1.0, 0)], warm=False)
    with pytest.raises(ValueError, match="non-empty subset"):
        sim.set_routable([0, 5])
    assert sim.routable == [0] and sim.ids == ("replica-0000",)


def test_the_scale_scenario_reports_its_windows() -> None:
    scenario = ScaleScenario(replicas=4, adapters=40, added=2, cycles=1, warmup_s=60.0, window_s=30.0)
    cold, warm = run_scale(scenario, False), run_scale(scenario, True)
    for row in (cold, warm):
        assert row["steady_p99"] > 0 and row["out_ratio"] == pytest.approx(row["out_p99"] / row["steady_p99"])
        assert 0 <= row["new_replica_loads"] <= row["new_replica_requests"] > 0
    assert cold["join_delay_s"] == 0 < warm["join_delay_s"] and cold["requests"] == warm["requests"]


# ---------------------------------------------------------------------------- autoscaling


def step_trace(adapters: int = 60, seed: int = 0):
    # 60 s quiet, 120 s at about 8 replicas' worth of requests, quiet again
    return make_profile_trace(300.0, adapters, Popularity("power", 0.3),
                              lambda t: np.where((t >= 60) & (t < 180), 8 * 16 * 0.6 / 6.5, 1.0), cv=1.0, seed=seed)


def settings(**kw) -> AutoscaleSettings:
    return dataclasses.replace(AutoscaleSettings(min_replicas=1, max_replicas=12, target_ongoing_per_replica=12.0,
                                                 slots_per_replica=8, max_loads_per_s_per_replica=0.5,
                                                 upscale_delay_s=4.0, downscale_delay_s=20.0), **kw)


@pytest.mark.parametrize("rule", [queue_only_replicas, adapter_aware_replicas])
def test_the_autoscaler_follows_the_load_within_its_bounds(rule) -> None:
    t = step_trace()
    sim = Simulator(t, SimConfig(replicas=1, router="affinity"))
    scaler = FleetAutoscaler(sim, rule, settings(), ControlLoop(startup_s=5.0))
    scaler.start()
    sim.run()
    decisions = [d for _, _, d in scaler.history]
    assert max(decisions) >= 4 and all(1 <= d <= 12 for d in decisions)
    assert decisions[-1] < max(decisions)  # it came back down after the step
    assert sim.done == len(t) and len(sim.routable) >= 1
    assert all(j.joined >= j.decided for j in scaler.joins)
    if rule is queue_only_replicas:  # one replica holds the quiet minute's queue
        assert all(t >= 60 for t, _, _ in scaler.history)
    end = sim.now
    assert end <= scaler.replica_seconds(end) <= 12 * end


def test_adapter_aware_adds_replicas_for_a_working_set_queue_only_ignores() -> None:
    """400 adapters: even the quiet minute's working set (~1 request/s) outgrows one replica's 8 slots."""
    t = step_trace(adapters=400)
    runs = {}
    for name, rule in (("queue", queue_only_replicas), ("aware", adapter_aware_replicas)):
        sim = Simulator(t, SimConfig(replicas=1, router="affinity"))
        scaler = FleetAutoscaler(sim, rule, settings(max_replicas=30), ControlLoop(startup_s=5.0))
        scaler.start()
        sim.run()
        runs[name] = (scaler.history[0][0], scaler.replica_seconds(sim.now))
    assert runs["aware"][0] < 60 <= runs["queue"][0]
    assert runs["aware"][1] > runs["queue"][1]


def test_the_autoscaler_refuses_a_fleet_below_its_minimum() -> None:
    sim = Simulator(step_trace(), SimConfig(replicas=1, router="affinity"))
    with pytest.raises(ValueError, match="below min_replicas"):
        FleetAutoscaler(sim, queue_only_replicas, settings(min_replicas=2))


def test_compare_needs_an_equal_or_better_p99() -> None:
    def row(policy, rs, p99, target=12.0):
        return {"policy": policy, "replica_seconds": rs, "ttft_p99": p99, "target_ongoing": target}

    # beats the target-12 and target-8 runs on p99; the target-8 one spent more: the reference
    c = compare([row("adapter_aware", 70.0, 1.0), row("queue_only", 60.0, 3.0), row("queue_only", 100.0, 1.2, 8.0),
                 row("queue_only", 200.0, 0.5, 6.0)])
    assert c["queue_target"] == 8.0 and c["ratio"] == pytest.approx(0.7) and c["passed"]
    assert c["same_target_ratio"] == pytest.approx(70 / 60) and c["same_target_p99"] == 3.0
    assert c["matching_target"] == 6.0 and c["ratio_to_matching"] == pytest.approx(0.35)
    worse = compare([row("adapter_aware", 50.0, 2.0), row("queue_only", 100.0, 1.5)])
    assert worse["ratio"] == 0.5 and not worse["p99_no_worse"] and not worse["passed"]
    dearer = compare([row("adapter_aware", 90.0, 1.0), row("queue_only", 100.0, 3.0)])
    assert dearer["p99_no_worse"] and not dearer["passed"] and dearer["matching_target"] is None


def test_a_tiny_autoscale_run() -> None:
    shape = Diurnal(trough=1.0, peak=6.0, day_s=240.0, burst_gap_s=60.0, burst_s=10.0, burst_factor=1.0,
                    burst_adapters=4)
    scenario = AutoscaleScenario(adapters=40, shape=shape, min_replicas=1, max_replicas=8,
                                 loop=ControlLoop(startup_s=5.0))
    row = run_autoscale(scenario, "adapter_aware", 0.75)
    assert row["requests"] > 0 and 1 <= row["mean_replicas"] <= row["peak_replicas"] <= 8
    assert row["ttft_p99"] >= row["ttft_p50"] > 0


# ---------------------------------------------------------------------------- traces


def test_profile_arrivals_follow_the_rate_and_are_deterministic() -> None:
    def rate(t):
        return np.where(t < 500, 10.0, 30.0)

    a = profile_arrivals(1000.0, rate, 2.0, np.random.default_rng(1))
    b = profile_arrivals(1000.0, rate, 2.0, np.random.default_rng(1))
    assert np.array_equal(a, b) and np.all(np.diff(a) >= 0) and a[0] >= 0 and a[-1] < 1000
    assert (a < 500).sum() == pytest.approx(5000, rel=0.1) and (a >= 500).sum() == pytest.approx(15000, rel=0.1)
    with pytest.raises(ValueError, match="one finite rate"):
        profile_arrivals(10.0, lambda t: -np.ones_like(t), 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="must be > 0"):
        profile_arrivals(0.0, rate, 1.0, np.random.default_rng(0))


def test_the_diurnal_trace_swings_and_bursts() -> None:
    shape = Diurnal(trough=2.0, peak=20.0, day_s=600.0, burst_gap_s=120.0, burst_s=20.0, burst_factor=1.0,
                    burst_adapters=5)
    t = make_diurnal_trace(1.0, 300, Popularity("power", 0.3), shape, seed=4)
    again = make_diurnal_trace(1.0, 300, Popularity("power", 0.3), shape, seed=4)
    assert np.array_equal(t.arrivals, again.arrivals) and np.array_equal(t.adapters, again.adapters)
    assert np.all(np.diff(t.arrivals) >= 0) and len(t.input_lens) == len(t)
    noon = ((t.arrivals > 250) & (t.arrivals < 350)).sum()
    night = (t.arrivals < 50).sum() + (t.arrivals > 550).sum()
    assert noon > 3 * night
    assert t.meta["bursts"], "a 600 s day with a burst every 120 s on average has bursts"
    start, end = t.meta["bursts"][0]
    inside = t.adapters[(t.arrivals >= start) & (t.arrivals < end)]
    outside = ((t.arrivals >= start - 20) & (t.arrivals < start)).sum()
    assert len(inside) > 1.5 * outside  # the burst doubles the rate
    with pytest.raises(ValueError, match="burst_adapters"):
        make_diurnal_trace(1.0, 300, Popularity("power", 0.3), dataclasses.replace(shape, burst_adapters=0))

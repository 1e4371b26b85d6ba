"""The fleet placement plan: holder counts from demand, budgets, pins, hysteresis, stability, determinism."""

from collections import Counter

from hypothesis import given, settings, strategies as st

from routing.directory import AdapterDirectory
from routing.plan import FleetPlanner, PlacementPlan, ReplicaSlots
from routing.settings import RoutingSettings

DEMO = [f"demo-{i}" for i in range(6)]


def replicas(n=2, slots=3, per=None):
    return [ReplicaSlots(f"r{i}", slots, rows=8, **(per or {}).get(i, {})) for i in range(n)]


def per_replica(plan: PlacementPlan) -> Counter:
    return Counter(r for rs in plan.holders.values() for r in rs)


def test_the_demo_working_set_is_partitioned_over_the_slots():
    """Six adapters, two replicas of three slots, uniform demand: one holder each, three per replica."""
    plan = FleetPlanner().update(0.0, {a: 0.5 for a in DEMO}, replicas())
    assert all(len(rs) == 1 for rs in plan.holders.values()) and set(plan.holders) == set(DEMO)
    assert per_replica(plan) == {"r0": 3, "r1": 3}


def test_pins_are_planned_where_they_are_pinned_and_use_the_budget():
    reps = replicas(per={1: {"pinned": frozenset({"demo-0"}), "resident": frozenset({"demo-0"})}})
    plan = FleetPlanner().update(0.0, {a: 0.5 for a in DEMO}, reps)
    assert plan.holders["demo-0"] == ("r1",) and per_replica(plan) == {"r0": 3, "r1": 3}
    idle_pin = FleetPlanner().update(0.0, {}, reps)  # a pin is planned without demand
    assert idle_pin.holders == {"demo-0": ("r1",)}
    assert "demo-0" in plan.slotted["r1"] and "demo-0" in idle_pin.slotted["r1"]  # and holds its slot


def test_residency_is_kept_when_loads_are_alike():
    reps = replicas(per={0: {"resident": frozenset({"demo-3", "demo-4", "demo-5"})},
                         1: {"resident": frozenset({"demo-0", "demo-1", "demo-2"})}})
    plan = FleetPlanner().update(0.0, {a: 0.5 for a in DEMO}, reps)
    assert {a: rs[0] for a, rs in plan.holders.items()} == {
        "demo-0": "r1", "demo-1": "r1", "demo-2": "r1", "demo-3": "r0", "demo-4": "r0", "demo-5": "r0"}


def test_a_hot_adapter_gets_holders_in_proportion_after_its_grow_delay():
    cfg = RoutingSettings(grow_after_s=5.0, target_utilization=0.75)
    planner = FleetPlanner(cfg)
    reps = replicas(n=4, slots=4)
    demand = {"hot": 0.5, "cold": 0.5}
    assert len(planner.update(0.0, demand, reps).holders["hot"]) == 1
    demand["hot"] = 8 * 2.5  # 2.5 replicas' worth of rows: ceil(2.5 / 0.75) = 4 holders
    assert len(planner.update(1.0, demand, reps).holders["hot"]) == 1  # a blip moves nothing
    assert len(planner.update(5.5, demand, reps).holders["hot"]) == 1
    assert len(planner.update(6.5, demand, reps).holders["hot"]) == 4  # sustained past grow_after_s


def test_a_blip_that_ends_before_the_delay_resets_the_timer():
    planner = FleetPlanner(RoutingSettings(grow_after_s=5.0))
    reps = replicas(n=4, slots=4)
    planner.update(0.0, {"a": 1.0}, reps)
    planner.update(1.0, {"a": 30.0}, reps)
    planner.update(3.0, {"a": 1.0}, reps)  # back to normal: the wish to grow is forgotten
    planner.update(4.0, {"a": 30.0}, reps)
    assert len(planner.update(8.0, {"a": 30.0}, reps).holders["a"]) == 1  # 4 s of the second wish only
    assert len(planner.update(9.5, {"a": 30.0}, reps).holders["a"]) > 1


def test_holders_go_after_the_cool_down_and_idle_adapters_leave_the_plan():
    cfg = RoutingSettings(grow_after_s=0.0, shrink_after_s=30.0)
    planner = FleetPlanner(cfg)
    reps = replicas(n=4, slots=4)
    planner.update(0.0, {"a": 24.0, "b": 1.0}, reps)
    assert len(planner.update(0.1, {"a": 24.0, "b": 1.0}, reps).holders["a"]) == 4
    assert len(planner.update(10.0, {"a": 1.0, "b": 1.0}, reps).holders["a"]) == 4
    assert len(planner.update(41.0, {"a": 1.0, "b": 1.0}, reps).holders["a"]) == 1
    planner.update(50.0, {"a": 1.0}, reps)  # b idle from now on
    assert "b" in planner.update(160.0, {"a": 1.0}, reps).holders
    assert "b" not in planner.update(171.0, {"a": 1.0}, reps).holders


def test_a_demand_shift_within_the_tolerance_moves_no_placement_and_a_lasting_overload_moves_one():
    planner = FleetPlanner()
    reps = replicas(n=3, slots=3)
    first = planner.update(0.0, {a: 0.5 for a in DEMO}, reps)
    on_r0 = [a for a, rs in first.holders.items() if rs == ("r0",)]
    assert len(on_r0) == 2
    shifted = {a: (0.6 if a in on_r0 else 0.45) for a in DEMO}  # r0 a little above the mean
    later = planner.update(100.0, shifted, reps)
    assert later.holders == first.holders and later.version == first.version
    overloaded = {a: (4.0 if a in on_r0 else 0.5) for a in DEMO}  # r0: 1 replica of load, the others 0.125
    planner.update(200.0, overloaded, reps)
    assert planner.update(229.0, overloaded, reps).holders == first.holders  # not for long enough yet
    moved = planner.update(231.0, overloaded, reps)
    assert sum(moved.holders[a] != first.holders[a] for a in on_r0) == 1
    assert max(per_replica(moved).values()) <= 3


def test_after_a_join_overloaded_replicas_hand_placements_in_use_to_it_after_the_join_delay():
    """Traffic grew, a third replica joined: the two old ones (1.5 replicas of load each, the new mean 1.0) hand
    over placements in use after ``join_shed_after_s``, not ``overload_after_s``; none moves at the join."""
    demand = {a: 4.0 for a in DEMO}  # 0.5 replicas each: 1.5 per old replica
    for shed_after, moved_by in ((10.0, 111.0), (30.0, None)):
        planner = FleetPlanner(RoutingSettings(overload_share=0.2, join_shed_after_s=shed_after))
        first = planner.update(0.0, demand, replicas(n=2, slots=4))
        three = replicas(n=3, slots=4)
        assert planner.update(100.0, demand, three).holders == first.holders
        assert planner.update(109.0, demand, three).holders == first.holders
        later = planner.update(111.0, demand, three)
        assert (per_replica(later)["r2"] > 0) == (moved_by is not None)


def test_copies_that_do_not_fit_keep_a_spare_slot_per_replica():
    """Twelve adapters on 2 x 4 slots: the plan places 2 x 3 and keeps one slot per replica for the rest."""
    demand = {f"a{i:02d}": 1.0 / (i + 1) for i in range(12)}
    plan = FleetPlanner().update(0.0, demand, replicas(slots=4))
    hottest = sorted(demand, key=demand.get, reverse=True)[:6]
    assert per_replica(PlacementPlan(0, {a: plan.holders[a] for a in hottest})) == {"r0": 3, "r1": 3}
    assert set(plan.holders) == set(demand)  # the rest are planned too, without budget (load on demand)


def test_placements_without_budget_go_to_their_standby_replica_not_all_to_one():
    """48 registered adapters on 4 x 4 slots: the 36 beyond the budget (4 x 3: one slot each is spare) are
    each planned on the first replica of their rendezvous order, where its standby copy waits
    (``routing.warm_start.standby_names``). Before, every one went to the same least-loaded replica: with their
    first requests all there, long prompts for cold adapters queued behind each other on one replica (fleet_live,
    gamma@0.4) while the others had rows."""
    from routing.warm_start import standby_names

    names = [f"a{k:02d}" for k in range(48)]
    reps = replicas(n=4, slots=4)
    ids = [r.replica_id for r in reps]
    plan = FleetPlanner().update(0.0, {}, reps, registered=names)
    slotted = {a for kept in plan.slotted.values() for a in kept}
    on_demand = [a for a in names if a not in slotted]
    assert len(slotted) == 4 * 3 and len(on_demand) == 36
    for a in on_demand:
        (holder,) = plan.holders[a]
        assert a in standby_names(holder, ids, names)
    assert len({plan.holders[a] for a in on_demand}) == 4  # spread over the fleet
    again = FleetPlanner().update(0.0, {}, list(reversed(reps)), registered=list(reversed(names)))
    assert again.holders == plan.holders


def test_the_plan_does_not_depend_on_input_order():
    demand = {f"a{i}": float(i % 5) + 0.1 for i in range(20)}
    reps = replicas(n=5, slots=3)
    one = FleetPlanner().update(0.0, demand, reps)
    two = FleetPlanner().update(0.0, dict(reversed(list(demand.items()))), list(reversed(reps)))
    assert one.holders == two.holders


def test_plan_round_trips_through_a_dict():
    plan = FleetPlanner().update(0.0, {a: 0.5 for a in DEMO}, replicas())
    assert PlacementPlan.from_dict(plan.to_dict()) == plan


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 40.0), min_size=1, max_size=30), st.integers(1, 6), st.integers(1, 5),
       st.lists(st.floats(0.0, 100.0), min_size=1, max_size=4))
def test_plans_respect_replicas_budgets_and_counts(needs, n, slots, times):
    planner = FleetPlanner(RoutingSettings(grow_after_s=1.0, shrink_after_s=2.0))
    reps = replicas(n=n, slots=slots)
    demand = {f"a{i}": x for i, x in enumerate(needs)}
    ids = {r.replica_id for r in reps}
    now = 0.0
    for dt in times:
        now += dt
        plan = planner.update(now, demand, reps)
        for name, holders in plan.holders.items():
            assert holders and set(holders) <= ids and len(set(holders)) == len(holders) <= n
        budgeted = Counter()
        for name in sorted(plan.holders, key=lambda a: -demand.get(a, 0.0)):
            if len(plan.holders[name]) > 1:
                budgeted.update(plan.holders[name])
        assert all(c <= slots for c in budgeted.values())  # replicated adapters always had budget


def test_the_directory_plans_from_the_workers_busy_seconds():
    now = [0.0]
    d = AdapterDirectory(clock=lambda: now[0])
    for rid in ("r0", "r1"):
        d.apply_snapshot({"replica_id": rid, "seq": 0, "slots": 3, "resident": {}, "pinned": []}, rows=8)
    now[0] = 1.0
    d.heartbeat("r0", busy_s={f"demo-{i}": 0.5 for i in range(3)})
    d.heartbeat("r1", busy_s={f"demo-{i}": 0.5 for i in range(3, 6)})
    plan = d.update_plan()
    assert set(plan.holders) == set(DEMO) and per_replica(plan) == {"r0": 3, "r1": 3}
    assert d.update_plan().version == plan.version  # nothing changed: the same version


def test_registered_adapters_are_planned_before_their_first_request():
    plan = FleetPlanner().update(0.0, {}, replicas(), registered=DEMO)
    assert set(plan.holders) == set(DEMO) and per_replica(plan) == {"r0": 3, "r1": 3}
    warmed = FleetPlanner()
    warmed.update(0.0, {}, replicas(), registered=DEMO)
    assert warmed.update(5.0, {a: 0.5 for a in DEMO}, replicas(), registered=DEMO).holders == plan.holders


def test_registered_placements_made_before_any_demand_give_up_their_budget_to_hot_adapters():
    # 256 registered adapters fill every slot budget at start-up (no demand yet). Then Zipf demand arrives: the
    # hot adapters must get the holders their load needs, and the neediest adapters the slots, instead of the
    # start-up (alphabetical) placements keeping their budget for good
    n, slots, count = 16, 8, 256
    names = [f"a{k:03d}" for k in range(count)]
    harmonic = sum(1 / (k + 1) for k in range(count))
    demand = {names[k]: 0.8 * n * 8 / ((k + 1) * harmonic) for k in range(count)}  # a000 hottest
    reps = [ReplicaSlots(f"r{i:02d}", slots, 8) for i in range(n)]
    planner = FleetPlanner(RoutingSettings(grow_after_s=5.0))
    planner.update(0.0, {}, reps, registered=names)
    for t in range(1, 60):
        plan = planner.update(float(t), demand, reps, registered=names)
    assert len(plan.holders["a000"]) == 3   # needs 2.1 replicas at 75% utilisation
    assert len(plan.holders["a001"]) == 2
    assert all(len(plan.holders[a]) == 1 for a in names[2:])
    # slots are short (259 copies wanted, 128 slots): each replica keeps one spare and gives the other seven to
    # planned adapters, and the 100 neediest all have one (what the pools keep); the rest load on demand
    assert all(len(kept) == slots - 1 for kept in plan.slotted.values()) and len(plan.slotted) == n
    slotted = {a for kept in plan.slotted.values() for a in kept}
    assert set(names[:100]) <= slotted
    for rid, kept in plan.slotted.items():
        assert set(kept) <= {a for a, h in plan.holders.items() if rid in h}
    again = planner.update(61.0, demand, reps, registered=names)
    assert again.version == plan.version, "steady demand moves nothing"


def test_noisy_tail_demand_moves_few_placements_and_slots_go_to_the_popular():
    # Poisson requests over Zipf-popular adapters, each a few request-seconds of demand, re-planned every second
    # as the directory does: a tail adapter's 10 s demand is mostly noise. Placements must stay put (each move is
    # a load somewhere), and the adapters with slots must be the popular ones (85% of requests; static top-112
    # of 256 under Zipf 1 is 87%). Before, shedding on the noisy demand moved ~1 placement a second.
    import numpy as np

    from routing.plan import holder_moves
    from routing.router_state import DemandRates

    n, slots, count = 16, 8, 256
    names = [f"a{k:03d}" for k in range(count)]
    rng = np.random.default_rng(0)
    p = 1 / np.arange(1, count + 1)
    p /= p.sum()
    now = [0.0]
    settings = RoutingSettings()
    demand = DemandRates(settings.demand_tau_s, lambda: now[0])
    popularity = DemandRates(settings.popularity_tau_s, lambda: now[0])
    reps = [ReplicaSlots(f"r{i:02d}", slots, 8) for i in range(n)]
    planner = FleetPlanner(settings)
    plan = planner.update(0.0, {}, reps, registered=names)
    moves, hits, asked = 0, 0, 0
    for second in range(1, 600):
        now[0] = float(second)
        for k in rng.choice(count, size=rng.poisson(16), p=p):
            demand.add(names[k], 2.5)
            popularity.add(names[k], 2.5)
            if second > 300:
                asked += 1
                hits += any(names[k] in kept for kept in plan.slotted.values())
        new = planner.update(now[0], {a: demand.get(a) for a in demand.names()}, reps, registered=names,
                             popularity={a: popularity.get(a) for a in popularity.names()})
        if second > 300:
            moves += sum(holder_moves(plan, new).values())
        plan = new
    assert moves < 0.5 * 300, f"{moves} placements moved in 300 s of steady (if noisy) demand"
    assert hits / asked > 0.8
    assert len(plan.holders["a000"]) == 2  # 16 req/s x 2.5 s / 8 rows x 16% = 0.8 replicas at 75%: two


def test_a_new_version_is_planned_where_its_adapter_is_and_stays_there():
    """A rollout's new version (``name@label``) serves the same traffic as the version it replaces: planned on
    that version's replica, not on the least loaded one, so a traffic flip moves no request to another worker
    (where it would run in a batch of its own on cores the first worker shares; rollout p99 1.3x steady)."""
    v2_everywhere = frozenset({"support@v2"})
    reps = replicas(per={0: {"resident": frozenset({"support"}) | v2_everywhere},
                         1: {"resident": frozenset({"other"}) | v2_everywhere}})
    planner = FleetPlanner()
    plan = planner.update(0.0, {"support": 1.0}, reps, registered=["support", "other", "support@v2"])
    assert plan.holders["support"] == ("r0",) and plan.holders["other"] == ("r1",)
    assert plan.holders["support@v2"] == ("r0",)
    for now, demand in ((1.0, {"support": 0.5, "support@v2": 0.5}), (2.0, {"support@v2": 1.0})):
        registered = ["other", "support@v2"] + (["support"] if "support" in demand else [])
        assert planner.update(now, demand, reps, registered=registered).holders["support@v2"] == ("r0",)


def test_a_version_planned_before_its_adapter_takes_the_adapter_along():
    """Whichever version is placed first, the others follow it (a version may outgrow the first one mid-rollout)."""
    plan = FleetPlanner().update(0.0, {"support@v2": 1.0}, replicas(n=4),
                                 registered=["support", "support@v2", "a", "b", "c"])
    assert plan.holders["support"] == plan.holders["support@v2"]


def test_a_resumed_planner_carries_on_from_a_recorded_plan_without_moving_it():
    """``FleetPlanner.resume``: a replay that starts from the plan a live deploy recorded keeps its holders, their
    counts and its version under the same demand (a planner handed only the plan would drop demo-0's second
    holder at once), and a hot adapter still grows only after the grow delay, timed from the resume."""
    cfg = RoutingSettings(grow_after_s=5.0)
    reps = replicas(n=4, slots=4)
    demand = {a: 0.5 for a in DEMO}
    recorded = PlacementPlan(9, {"demo-0": ("r2", "r3"), "demo-1": ("r3",), "demo-2": ("r2",), "demo-3": ("r2",),
                                 "demo-4": ("r1",), "demo-5": ("r0",)}, frozenset(),
                             {"r3": ("demo-0", "demo-1"), "r2": ("demo-0", "demo-2", "demo-3"), "r1": ("demo-4",),
                              "r0": ("demo-5",)})
    planner = FleetPlanner(cfg)
    planner.resume(PlacementPlan.from_dict(recorded.to_dict()))
    again = planner.update(1.0, demand, reps)
    assert again.version == 9 and again.holders == recorded.holders
    handed = FleetPlanner(cfg)
    handed.plan = recorded
    assert handed.update(1.0, demand, reps).holders["demo-0"] == ("r2",)
    demand["demo-5"] = 8 * 2.5
    assert len(planner.update(2.0, demand, reps).holders["demo-5"]) == 1  # the timer starts now, not at resume
    assert len(planner.update(7.5, demand, reps).holders["demo-5"]) > 1

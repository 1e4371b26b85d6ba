"""Warm start and scale-down placement rules (routing/warm_start.py): what a joining replica loads,
and which survivor takes each adapter of a departed one."""

from __future__ import annotations

import pytest

from routing.hashing import rendezvous_order
from routing.pins import pin_holders
from routing.warm_start import AdapterPlacement, rehome_targets, warm_start_plan

pytestmark = pytest.mark.unit
OLD = ["r0", "r1"]
NEW = "r2"
NAMES = [f"ad-{i}" for i in range(40)]


def test_a_new_replica_takes_the_pins_the_rule_now_gives_it():
    adapters = [AdapterPlacement(n, pin_count=1) for n in NAMES[:6]]
    plan = warm_start_plan(NEW, OLD, adapters, slots=8, host_limit=4)
    expected = sorted(n for n in NAMES[:6] if pin_holders(n, OLD + [NEW], 1) == [NEW])
    assert list(plan.pins) == expected and list(plan.slots[:len(expected)]) == expected
    assert not plan.host


def test_hot_adapters_whose_next_copy_belongs_here_fill_slots_then_the_host_tier():
    adapters = [AdapterPlacement(n, holders=1 + i % 2) for i, n in enumerate(NAMES)]
    plan = warm_start_plan(NEW, OLD, adapters, slots=4, host_limit=3)
    mine = [a for a in adapters if NEW in rendezvous_order(a.name, OLD + [NEW])[:a.holders + 1]]
    ranked = [a.name for a in sorted(mine, key=lambda a: (-a.holders, a.name))]
    assert list(plan.slots) == ranked[:3]  # slots - 1: one slot stays free for traffic
    assert list(plan.host) == ranked[3:6]
    assert not set(plan.slots) & set(plan.host)


def test_cold_adapters_are_left_alone():
    plan = warm_start_plan(NEW, OLD, [AdapterPlacement(n) for n in NAMES], slots=4, host_limit=4)
    assert plan.slots == () and plan.host == ()


def test_pins_beyond_slots_minus_one_are_skipped_not_loaded():
    mine = [n for n in NAMES if pin_holders(n, OLD + [NEW], 1) == [NEW]][:4]
    plan = warm_start_plan(NEW, OLD, [AdapterPlacement(n, pin_count=1) for n in mine], slots=3, host_limit=0)
    assert list(plan.pins) == sorted(mine)[:2] and list(plan.skipped_pins) == sorted(mine)[2:]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="slots"):
        warm_start_plan(NEW, OLD, [], slots=0, host_limit=1)


def test_a_departed_replicas_adapters_go_to_the_first_survivor_not_holding_them():
    survivors = ["r0", "r1", "r3"]
    holders = {"ad-1": ["r0"], "ad-2": []}
    targets = rehome_targets(["ad-1", "ad-2", "ad-2"], survivors, holders)
    first_free = next(r for r in rendezvous_order("ad-1", survivors) if r != "r0")
    assert "ad-1" in targets[first_free]
    assert "ad-2" in targets[rendezvous_order("ad-2", survivors)[0]]
    assert sum(len(v) for v in targets.values()) == 2


def test_standby_names_split_the_registered_adapters_by_their_rendezvous_first_replica():
    """Each registered adapter is staged on exactly one replica: the one routers send it to while nothing holds
    or plans it (its rendezvous-first replica, as ``FleetView.order`` ranks it)."""
    from routing.fleet_view import FleetView
    from routing.warm_start import standby_names

    replicas = [f"replica-{i}" for i in range(5)]
    names = [f"adapter-{i}" for i in range(200)]
    by_replica = {r: standby_names(r, replicas, reversed(names)) for r in replicas}
    assert sorted(n for got in by_replica.values() for n in got) == sorted(names)  # a partition
    assert all(got == sorted(got) for got in by_replica.values())
    assert min(len(got) for got in by_replica.values()) > 0
    view = FleetView(replicas)
    for r, got in by_replica.items():
        assert all(view.replica_ids[view.order(n, 1)[0]] == r for n in got)
        assert all(rendezvous_order(n, replicas)[0] == r for n in got)
    assert standby_names("replica-0", [], names[:3]) == names[:3]  # alone: everything comes here
    assert standby_names("replica-9", replicas, names) == standby_names("replica-9", replicas + ["replica-9"], names)


def test_every_version_of_an_adapter_shares_its_rendezvous_order():
    """Placement hashes the adapter's name, not the version's entry name (``name@label``): a version's standby
    copy, its fallback replica and its rendezvous-first replica are its adapter's, where the adapter is warm."""
    from routing.fleet_view import FleetView
    from routing.warm_start import standby_names

    replicas = [f"replica-{i}" for i in range(8)]
    names = [f"adapter-{i}" for i in range(20)]
    view = FleetView(tuple(replicas))
    for name in names:
        for version in (f"{name}@v2", f"{name}@canary.3"):
            assert rendezvous_order(version, replicas) == rendezvous_order(name, replicas)
            assert view.order(version, 3) == view.order(name, 3)
            assert rehome_targets([version], replicas, {}).keys() == rehome_targets([name], replicas, {}).keys()
    for r in replicas:
        assert set(standby_names(r, replicas, [f"{n}@v2" for n in names])) == \
            {f"{n}@v2" for n in standby_names(r, replicas, names)}

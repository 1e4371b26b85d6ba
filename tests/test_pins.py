"""Pin placement: one rule (first N replicas in rendezvous order), and the slots - 1 guard per replica."""

from __future__ import annotations

import pytest

from routing.hashing import rendezvous_order
from routing.pins import overfull_pin_replica, pin_holders, pins_per_replica

pytestmark = pytest.mark.unit
REPLICAS = [f"r{i}" for i in range(5)]


def test_holders_are_the_first_replicas_in_rendezvous_order():
    assert pin_holders("a", REPLICAS, 2) == rendezvous_order("a", REPLICAS)[:2]
    assert pin_holders("a", list(reversed(REPLICAS)), 2) == pin_holders("a", REPLICAS, 2)  # order-free


def test_pins_per_replica_counts_every_holder():
    load = pins_per_replica([("a", 2), ("b", 5)], REPLICAS)
    assert sum(load.values()) == 7 and all(load[r] >= 1 for r in REPLICAS)


def test_a_pin_that_fits_is_allowed():
    assert overfull_pin_replica("a", 1, [], REPLICAS, slots=2) is None


def test_the_last_unpinned_slot_is_refused_naming_the_replica():
    holder = pin_holders("a", REPLICAS, 1)[0]
    others = [(name, 1) for name in (f"x{i}" for i in range(200)) if pin_holders(name, REPLICAS, 1)[0] == holder][:2]
    full = overfull_pin_replica("a", 1, others, REPLICAS, slots=3)
    assert full == (holder, 2)


def test_no_replicas_known_yet_means_no_refusal():
    assert overfull_pin_replica("a", 3, [("b", 3)], [], slots=2) is None

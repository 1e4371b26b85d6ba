"""Which replicas hold a pinned adapter, and whether the fleet can hold one more pin.

One rule, used by the ingress (to refuse a pin), the workers (to apply it) and the view:
a pinned adapter is pinned on the first ``count`` replicas of its rendezvous order, and no
replica may pin more than ``slots - 1`` adapters (each pool's starvation guard).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from .hashing import rendezvous_order


def pin_holders(name: str, replica_ids: Sequence[str], count: int) -> list[str]:
    """The replicas that pin ``name``: the first ``count`` in its rendezvous order."""
    return rendezvous_order(name, list(replica_ids))[:count]


def pins_per_replica(pins: Iterable[tuple[str, int]], replica_ids: Sequence[str]) -> Counter:
    """How many adapters each replica pins, for ``pins`` = (name, count) pairs."""
    load: Counter = Counter({r: 0 for r in replica_ids})
    for name, count in pins:
        load.update(pin_holders(name, replica_ids, count))
    return load


def overfull_pin_replica(name: str, count: int, others: Iterable[tuple[str, int]], replica_ids: Sequence[str],
                         slots: int) -> tuple[str, int] | None:
    """The first replica that pinning ``name`` on ``count`` replicas would push past ``slots - 1`` pins,
    with the pins it already holds; None when the fleet can hold the pin."""
    if not replica_ids:
        return None
    load = pins_per_replica(others, replica_ids)
    for replica in pin_holders(name, replica_ids, count):
        if load[replica] + 1 > slots - 1:
            return replica, load[replica]
    return None

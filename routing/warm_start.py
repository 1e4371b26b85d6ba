"""What a replica should hold before traffic reaches it, and who takes a departed replica's adapters.

Pure rules over names and replica ids (the directory runs them; the simulator can too):

- ``warm_start_plan``: a replica joining the fleet loads into its slots the pinned adapters whose
  ``pin_holders`` over the new replica set include it, then the adapters in use whose rendezvous
  order over the new set puts it among their first ``holders + 1`` replicas, hottest first, at
  most ``slots - 1`` in slots; the rest of those go to its host tier, up to ``host_limit``. With
  a placement plan (the directory's), the unpinned adapters are instead those the plan would
  place on the new replica (``AdapterDirectory.planned_for``): the same rule routing follows.
- ``rehome_targets``: the adapters a departed replica held go, each, to the first survivor in
  their rendezvous order that does not hold them already (that survivor prefetches it into its
  host tier, so the next request there is a copy, not a file read).
- ``standby_names``: the registered adapters whose first replica in rendezvous order is this one.
  A request for an adapter that no replica holds and the plan places nowhere goes there
  (``routing.policy``), so that replica keeps them in its host tier: the first request is a copy
  into a slot (milliseconds), not a file read (a tenth of a second to a second for an 8B model's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .hashing import placement_hash, rendezvous_order, rendezvous_scores, stable_hash
from .pins import pin_holders


@dataclass(frozen=True)
class AdapterPlacement:
    """One registered adapter as the directory sees it: its pin replication (0: unpinned) and how
    many replicas hold it in a slot now."""

    name: str
    pin_count: int = 0
    holders: int = 0


@dataclass(frozen=True)
class WarmStartPlan:
    slots: tuple[str, ...]  # load into slots, pins first
    pins: tuple[str, ...]  # of those, the ones this replica pins
    host: tuple[str, ...]  # read into the host tier only
    skipped_pins: tuple[str, ...] = ()  # pins beyond slots - 1 (the pool would refuse them)

    def to_dict(self) -> dict:
        return {"slots": list(self.slots), "pins": list(self.pins), "host": list(self.host),
                "skipped_pins": list(self.skipped_pins)}


def warm_start_plan(replica_id: str, replica_ids: Sequence[str], adapters: Iterable[AdapterPlacement],
                    slots: int, host_limit: int, planned: Optional[Sequence[str]] = None) -> WarmStartPlan:
    """The adapters ``replica_id`` should hold when it joins ``replica_ids`` (see the module's rule).

    ``planned``: what the fleet's placement plan would place on it (``AdapterDirectory.planned_for``,
    neediest first); when given it replaces the rendezvous rule for the unpinned adapters, so a
    replica warms exactly what routers will send it."""
    if slots < 1 or host_limit < 0:
        raise ValueError(f"slots must be >= 1 and host_limit >= 0, got slots={slots} host_limit={host_limit}")
    replicas = sorted(set(replica_ids) | {replica_id})
    adapters = sorted(adapters, key=lambda a: a.name)
    pins = [a.name for a in adapters if a.pin_count > 0 and replica_id in pin_holders(a.name, replicas, a.pin_count)]
    kept_pins, skipped = pins[:slots - 1], pins[slots - 1:]
    if planned is not None:
        known = {a.name for a in adapters}
        hot_names = [name for name in planned if name in known and name not in pins]
    else:
        hot_names = [a.name for a in sorted((a for a in adapters if a.holders > 0 and a.name not in pins
                                             and replica_id in rendezvous_order(a.name, replicas)[:a.holders + 1]),
                                            key=lambda a: (-a.holders, a.name))]
    room = max(0, slots - 1 - len(kept_pins))
    in_slots = hot_names[:room]
    host = hot_names[room:][:host_limit]
    return WarmStartPlan(slots=tuple(kept_pins + in_slots), pins=tuple(kept_pins), host=tuple(host),
                         skipped_pins=tuple(skipped))


def standby_names(replica_id: str, replica_ids: Sequence[str], names: Iterable[str]) -> list[str]:
    """The ``names`` (sorted) whose rendezvous order over ``replica_ids`` (and ``replica_id``) starts with
    ``replica_id``: where routers send an adapter's first request while nothing holds or plans it."""
    replicas = sorted(set(replica_ids) | {replica_id})
    if len(replicas) == 1:
        return sorted(names)
    hashes = np.array([stable_hash(r) for r in replicas], dtype=np.uint64)
    me = replicas.index(replica_id)
    out = []
    for name in sorted(names):
        scores = rendezvous_scores(placement_hash(name), hashes)
        if int(np.argmax(scores)) == me:
            out.append(name)
    return out


def rehome_targets(departed: Iterable[str], survivors: Sequence[str],
                   holders: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """survivor -> the departed replica's adapters it should prefetch (sorted); ``holders`` maps a
    name to the replicas that hold it now."""
    targets: dict[str, list[str]] = {}
    for name in sorted(set(departed)):
        held = set(holders.get(name, ()))
        for replica in rendezvous_order(name, sorted(survivors)):
            if replica not in held:
                targets.setdefault(replica, []).append(name)
                break
    return targets

"""Pool events and snapshots: what a replica tells the router about its slots.

These types cross folders (routing reads them), so they are plain dataclasses with no
torch inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field, asdict
from typing import Optional

@dataclass(frozen=True)
class PoolEvent:
    """One change to a replica's slots. ``seq`` starts at 1 per replica, with no gaps.

    ``kind`` is one of load, evict, pin, unpin, unload.
    """

    kind: str
    uid: str
    slot: int
    replica_id: str
    seq: int
    time: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PoolCounters:
    """Monotonic counters; ``load_seconds`` is the sum of slot-load wall times."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    unloads: int = 0
    load_seconds: float = 0.0


@dataclass(frozen=True)
class PoolSnapshot:
    """The whole pool at one ``seq``; routers reconcile their view with it."""

    replica_id: str
    seq: int
    slots: int
    resident: dict[str, int]  # adapter uid -> slot (the base model is not listed)
    pinned: frozenset[str]
    free_slots: int
    eviction_policy: str
    counters: PoolCounters = field(default_factory=PoolCounters)
    base_slot: Optional[int] = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pinned"] = sorted(self.pinned)
        return d

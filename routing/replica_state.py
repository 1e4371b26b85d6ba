"""``ReplicaState``: one replica's state as the fleet sees it, in one typed form.

Why its own file: the directory stores it, the worker reports it as its routing stats, and
routers read its ``to_dict`` form, so one definition keeps the three saying the same thing.
``ReplicaState.from_snapshot`` builds it from a pool snapshot plus the heartbeat's extras.
One definition of a free slot, the pool's: a slot that holds nothing (the base model's slot,
once it has run, is used: the pool evicts every idle adapter before it). No Ray here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping, Union

from pool.events import PoolSnapshot

from .identity import name_of
from .plan import ReplicaSlots


@dataclass
class ReplicaState:
    replica_id: str
    seq: int = 0
    slots: int = 0
    resident: dict[str, int] = field(default_factory=dict)  # uid -> slot
    pinned: set[str] = field(default_factory=set)
    loading: set[str] = field(default_factory=set)
    host_cached: set[str] = field(default_factory=set)
    queue_len: int = 0
    load_s: dict = field(default_factory=dict)  # measured {"host": s, "disk": s} load times (routers price loads)
    base_resident: bool = False  # the base model's slot is in use (the pool evicts it last)
    rows: int = 0                # requests the replica runs at once (its max batch)
    needs_resync: bool = False
    last_report: float = 0.0
    removed: bool = False

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - len(self.resident) - int(self.base_resident))

    @classmethod
    def from_snapshot(cls, snapshot: Union[PoolSnapshot, Mapping], **extras) -> "ReplicaState":
        """A replica's state from its own pool snapshot plus heartbeat extras (``queue_len``,
        ``host_cached``, ``loading``, ``load_s``, ``rows``): what the directory stores on a resync and
        what the worker's routing stats report, so both say the same thing."""
        snap = snapshot if isinstance(snapshot, Mapping) else snapshot.to_dict()
        state = cls(snap["replica_id"], seq=snap["seq"], slots=snap["slots"], resident=dict(snap["resident"]),
                    pinned=set(snap["pinned"]), base_resident=snap.get("base_slot") is not None)
        state.set_extras(**{k: v for k, v in extras.items() if k in STATE_EXTRAS})
        return state

    def set_extras(self, queue_len=None, host_cached=None, loading=None, load_s=None, rows=None,
                   base_resident=None) -> bool:
        """The heartbeat's parts of the state; whether anything routers price changed (the queue
        length is stored, not counted: routers take it from Serve's own cache)."""
        before = (self.host_cached, self.loading, self.load_s, self.rows, self.base_resident)
        if queue_len is not None:
            self.queue_len = queue_len
        if host_cached is not None:
            self.host_cached = set(host_cached)
        if loading is not None:
            self.loading = set(loading)
        if load_s is not None:
            self.load_s = dict(load_s)
        if rows is not None:
            self.rows = int(rows)
        if base_resident is not None:
            self.base_resident = bool(base_resident)
        return before != (self.host_cached, self.loading, self.load_s, self.rows, self.base_resident)

    def slots_for_plan(self) -> ReplicaSlots:
        return ReplicaSlots(self.replica_id, self.slots, self.rows, resident=frozenset(map(name_of, self.resident)),
                            pinned=frozenset(map(name_of, self.pinned)),
                            warm=frozenset(map(name_of, (*self.host_cached, *self.loading))))

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("pinned", "loading", "host_cached"):
            d[key] = sorted(d[key])
        d["free_slots"] = self.free_slots
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "ReplicaState":
        return cls(
            replica_id=d["replica_id"], seq=d.get("seq", 0), slots=d.get("slots", 0),
            resident=dict(d.get("resident", {})), pinned=set(d.get("pinned", ())),
            loading=set(d.get("loading", ())), host_cached=set(d.get("host_cached", ())),
            queue_len=d.get("queue_len", 0), load_s=dict(d.get("load_s") or {}),
            base_resident=d.get("base_resident", False), rows=d.get("rows", 0),
            needs_resync=d.get("needs_resync", False),
            last_report=d.get("last_report", 0.0), removed=d.get("removed", False),
        )


STATE_EXTRAS = (  # the heartbeat's parts of a replica's state
    "queue_len", "host_cached", "loading", "load_s", "rows", "base_resident")

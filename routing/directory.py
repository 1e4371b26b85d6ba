"""AdapterDirectory: the fleet's global view, rebuilt from the replicas' own reports.

Soft state, no Ray inside: replica -> resident / loading / pinned / host-cached adapters,
free slots and queue; adapter uid -> replicas holding it. Events are applied in order per
replica and idempotently (an old ``seq`` is ignored); a gap marks the replica for a
snapshot resync. Routers pull versioned deltas at replica granularity: "these replicas
changed since version v" with their current state, which is small and idempotent.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Union

from pool.events import PoolEvent, PoolSnapshot


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
    needs_resync: bool = False
    last_report: float = 0.0
    removed: bool = False

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - len(self.resident))

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
            needs_resync=d.get("needs_resync", False),
            last_report=d.get("last_report", 0.0), removed=d.get("removed", False),
        )


EventLike = Union[PoolEvent, Mapping]


def _event(e: EventLike) -> PoolEvent:
    return e if isinstance(e, PoolEvent) else PoolEvent(**e)


class AdapterDirectory:
    def __init__(self, *, replica_timeout_s: float = 15.0, max_log: int = 100_000,
                 clock: Callable[[], float] = time.monotonic):
        self.replicas: dict[str, ReplicaState] = {}
        self.holders: dict[str, set[str]] = {}  # uid -> replica ids
        self.adapter_counts: dict[str, dict[str, int]] = {}  # uid -> {"load": n, "evict": n}
        self.version = 0
        self.events_applied = 0
        self.replica_timeout_s = replica_timeout_s
        self._log: deque[tuple[int, str]] = deque(maxlen=max_log)
        self._clock = clock

    # ------------------------------------------------------------------ updates

    def apply_events(self, replica_id: str, events: Iterable[EventLike]) -> bool:
        """Apply events in ``seq`` order; returns False if a gap needs a snapshot resync."""
        events = sorted((_event(e) for e in events), key=lambda e: e.seq)
        state = self._state(replica_id, first_seq=events[0].seq if events else None)
        changed = False
        for event in events:
            if event.seq <= state.seq:
                continue  # already applied (a retry or an overlap with a snapshot)
            if event.seq != state.seq + 1 or state.needs_resync:
                state.needs_resync = True
                break
            self._apply_one(state, event)
            state.seq = event.seq
            self.events_applied += 1
            changed = True
        state.last_report = self._clock()
        if changed:
            self._bump(replica_id)
        return not state.needs_resync

    def apply_snapshot(self, snapshot: Union[PoolSnapshot, Mapping], *, queue_len: Optional[int] = None,
                       host_cached: Optional[Iterable[str]] = None, loading: Optional[Iterable[str]] = None,
                       load_s: Optional[Mapping] = None) -> None:
        """Replace a replica's state with its own full report (resync, or first contact)."""
        snap = snapshot if isinstance(snapshot, Mapping) else snapshot.to_dict()
        state = self._state(snap["replica_id"], first_seq=None)
        if snap["seq"] < state.seq and not state.needs_resync:
            return  # older than what events already told us
        for uid in list(state.resident):
            self._unindex(uid, state.replica_id)
        state.resident = dict(snap["resident"])
        for uid in state.resident:
            self.holders.setdefault(uid, set()).add(state.replica_id)
        state.pinned = set(snap["pinned"])
        state.slots = snap["slots"]
        state.seq = snap["seq"]
        state.needs_resync = False
        self._set_extras(state, queue_len, host_cached, loading, load_s)
        state.last_report = self._clock()
        self._bump(state.replica_id)

    def heartbeat(self, replica_id: str, *, queue_len: Optional[int] = None,
                  host_cached: Optional[Iterable[str]] = None, loading: Optional[Iterable[str]] = None,
                  load_s: Optional[Mapping] = None) -> bool:
        """Liveness plus the parts of a replica's state that are not pool events.

        A queue length alone does not make a new version: routers take queue lengths from
        Serve's own cache, and waking every router's long poll once a second per replica for
        a number they do not use would cost each of them a round trip."""
        state = self._state(replica_id, first_seq=None)
        state.last_report = self._clock()
        if self._set_extras(state, queue_len, host_cached, loading, load_s):
            self._bump(replica_id)
        return not state.needs_resync

    def forget_replica(self, replica_id: str) -> bool:
        state = self.replicas.pop(replica_id, None)
        if state is None:
            return False
        for uid in state.resident:
            self._unindex(uid, replica_id)
        self._bump(replica_id)
        return True

    def expire(self) -> list[str]:
        """Forget replicas that have not reported for ``replica_timeout_s`` (dead or gone)."""
        now = self._clock()
        dead = [r for r, s in self.replicas.items() if now - s.last_report > self.replica_timeout_s]
        for replica_id in dead:
            self.forget_replica(replica_id)
        return dead

    # ------------------------------------------------------------------ queries

    def replicas_holding(self, uid: str) -> set[str]:
        return set(self.holders.get(uid, ()))

    def needs_resync(self, replica_id: str) -> bool:
        state = self.replicas.get(replica_id)
        return state is None or state.needs_resync

    def full_view(self) -> dict[str, dict]:
        return {r: s.to_dict() for r, s in self.replicas.items()}

    def changes_since(self, version: int) -> tuple[int, Optional[dict[str, dict]]]:
        """(current version, {replica_id: state dict, or {"removed": True}}) changed after ``version``.

        ``None`` instead of a dict means the log no longer reaches back that far: take a full view.
        """
        if version > self.version:
            return self.version, None  # a version from before a restart
        if version == self.version:
            return self.version, {}
        if version < 0 or (self._log and self._log[0][0] > version + 1) or (not self._log and version < self.version):
            return self.version, None
        changed: dict[str, dict] = {}
        for v, replica_id in reversed(self._log):
            if v <= version:
                break
            if replica_id not in changed:
                state = self.replicas.get(replica_id)
                changed[replica_id] = state.to_dict() if state else {"replica_id": replica_id, "removed": True}
        return self.version, changed

    # ------------------------------------------------------------------ internals

    def _state(self, replica_id: str, first_seq: Optional[int] = 1) -> ReplicaState:
        """The replica's state; one first heard of mid-stream (a directory restart, a lost first
        report) is marked for a snapshot, since its events so far are unknown."""
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(replica_id, last_report=self._clock(),
                                                             needs_resync=first_seq != 1)
            self._bump(replica_id)
        return state

    def _apply_one(self, state: ReplicaState, event: PoolEvent) -> None:
        counts = self.adapter_counts.setdefault(event.uid, {})
        counts[event.kind] = counts.get(event.kind, 0) + 1
        if event.kind == "load":
            state.resident[event.uid] = event.slot
            state.loading.discard(event.uid)
            self.holders.setdefault(event.uid, set()).add(state.replica_id)
        elif event.kind in ("evict", "unload"):
            state.resident.pop(event.uid, None)
            state.pinned.discard(event.uid)
            self._unindex(event.uid, state.replica_id)
        elif event.kind == "pin":
            state.pinned.add(event.uid)
        elif event.kind == "unpin":
            state.pinned.discard(event.uid)

    def _set_extras(self, state: ReplicaState, queue_len, host_cached, loading, load_s=None) -> bool:
        """Whether anything routers price changed (the queue length is stored, not counted)."""
        before = (state.host_cached, state.loading, state.load_s)
        if queue_len is not None:
            state.queue_len = queue_len
        if host_cached is not None:
            state.host_cached = set(host_cached)
        if loading is not None:
            state.loading = set(loading)
        if load_s is not None:
            state.load_s = dict(load_s)
        return before != (state.host_cached, state.loading, state.load_s)

    def _unindex(self, uid: str, replica_id: str) -> None:
        holders = self.holders.get(uid)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self.holders[uid]

    def _bump(self, replica_id: str) -> None:
        self.version += 1
        self._log.append((self.version, replica_id))

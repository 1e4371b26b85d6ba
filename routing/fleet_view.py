"""What a router believes of the replicas it may choose from: the policy's input (``routing.policy``).

``routing.view.RouterView`` builds one from the directory's feed and the replicas' routing stats;
the simulator and the tests build them directly. No Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

import numpy as np

from .hashing import placement_hash, rendezvous_scores, stable_hash

SMALL_FLEET = 16  # up to this many replicas every one is scored; beyond, a bounded candidate set


@dataclass
class FleetView:
    """The replicas a router may choose from and what it believes each holds.

    ``holders`` / ``warm`` map an adapter name to replica indexes: resident, or in the
    host tier / being read (a cheap place to load it). Per-replica lists are indexed
    like ``replica_ids``; a missing list means "not reported" and the config's priors apply.
    """

    replica_ids: tuple[str, ...]
    holders: Mapping[str, Collection[int]] = field(default_factory=dict)
    warm: Mapping[str, Collection[int]] = field(default_factory=dict)
    free_slots: Optional[np.ndarray] = None          # free slot count per replica
    slots: Optional[Sequence[int]] = None             # slot count per replica (0: unknown)
    residents: Optional[Sequence[tuple[str, ...]]] = None  # adapter names resident per replica
    pinned: Optional[Sequence[frozenset]] = None       # pinned adapter names per replica
    host_load_s: Optional[Sequence[Optional[float]]] = None  # measured host-tier copy seconds
    disk_load_s: Optional[Sequence[Optional[float]]] = None  # measured disk read seconds
    score_cache: Optional[dict] = None  # adapter -> rendezvous scores and order for these replica_ids (shareable)
    planned: Optional[Mapping[str, tuple[int, ...]]] = None  # the fleet plan: adapter -> planned replica indexes
    planned_on: Optional[Sequence[tuple[str, ...]]] = None   # per replica: the adapters planned there
    busy: frozenset = frozenset()  # replica indexes the plan keeps busy (no spill target)
    slotted_on: Optional[Sequence[frozenset]] = None  # per replica: planned adapters given a slot there (kept)

    def __post_init__(self) -> None:
        n = len(self.replica_ids)
        self.hashes = np.fromiter((stable_hash(r) for r in self.replica_ids), dtype=np.uint64, count=n)
        self.index = {r: i for i, r in enumerate(self.replica_ids)}
        if self.free_slots is None:
            self.free_slots = np.zeros(n, dtype=np.int64)
        self.free = [int(x) for x in self.free_slots]
        self._scores: dict = self.score_cache if self.score_cache is not None else {}

    def scores(self, adapter: str):
        """Rendezvous scores of ``adapter`` per replica (higher = earlier in its order), cached: a list
        for small fleets, the numpy array for large ones (compare them as ``int``)."""
        s = self._scores.get(adapter)
        if s is None:
            arr = rendezvous_scores(placement_hash(adapter), self.hashes)
            s = self._scores[adapter] = arr.tolist() if len(arr) <= SMALL_FLEET else arr
        return s

    def tie_scores(self, adapter: str, indexes: Sequence[int]) -> dict[int, int]:
        """Rendezvous scores of ``adapter`` at a few replicas (a large fleet computes just these)."""
        if len(self.replica_ids) <= SMALL_FLEET:
            s = self.scores(adapter)
            return {i: int(s[i]) for i in indexes}
        arr = rendezvous_scores(placement_hash(adapter), self.hashes[np.asarray(indexes, dtype=np.int64)])
        return dict(zip(indexes, arr.tolist()))

    def order(self, adapter: str, k: int) -> list[int]:
        """The first ``k`` replicas in ``adapter``'s rendezvous order, cached."""
        key = (adapter, k)
        o = self._scores.get(key)
        if o is None:
            s = np.asarray(self.scores(adapter), dtype=np.uint64)
            k = min(k, len(s))
            top = np.argpartition(s, len(s) - k)[-k:] if k < len(s) else np.arange(len(s))
            o = self._scores[key] = sorted((int(i) for i in top), key=lambda i: -int(s[i]))
        return o

"""Eviction policies: which resident adapter gives up its slot.

A uid of ``None`` is the base model. It is never tracked, and it is chosen only when no
adapter is a candidate: evicting the base slot first makes every base-model request in
the next batch reload it (SGLang issue 14795).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import AbstractSet, Optional

Uid = Optional[str]


class NoVictimError(RuntimeError):
    """No candidate can be evicted; raised instead of an assert."""


class EvictionPolicy(ABC):
    """Orders resident uids so ``select_victim`` can pick one to evict."""

    name: str = "abstract"

    def __init__(self) -> None:
        self.total_accesses = 0
        self.eviction_count = 0

    @abstractmethod
    def mark_used(self, uid: Uid) -> None:
        """Record that ``uid`` is part of the batch being prepared."""

    @abstractmethod
    def select_victim(self, candidates: AbstractSet[Uid]) -> Uid:
        """Return the candidate to evict; adapters before the base model (``None``)."""

    @abstractmethod
    def remove(self, uid: Uid) -> None:
        """Forget ``uid`` (it was evicted or unloaded); a reload starts it afresh."""

    def _fallback_to_base(self, candidates: AbstractSet[Uid]) -> Uid:
        if None in candidates:
            self.eviction_count += 1
            return None
        raise NoVictimError(f"no evictable uid among candidates {sorted(map(str, candidates))}")


class _OrderedPolicy(EvictionPolicy):
    """Shared victim scan: oldest tracked uid that is a candidate."""

    def __init__(self) -> None:
        super().__init__()
        self._order: "OrderedDict[str, float]" = OrderedDict()

    def select_victim(self, candidates: AbstractSet[Uid]) -> Uid:
        for uid in self._order:
            if uid in candidates:
                self.eviction_count += 1
                return uid
        return self._fallback_to_base(candidates)

    def remove(self, uid: Uid) -> None:
        if uid is not None:
            self._order.pop(uid, None)

    def order(self) -> list[str]:
        """Tracked uids, next victim first (for tests and snapshots)."""
        return list(self._order)


class LRUEvictionPolicy(_OrderedPolicy):
    """Least recently used: every use moves the uid to the newest end."""

    name = "lru"

    def mark_used(self, uid: Uid) -> None:
        if uid is None:
            return
        self._order.pop(uid, None)
        self._order[uid] = time.monotonic()
        self.total_accesses += 1


class FIFOEvictionPolicy(_OrderedPolicy):
    """First in, first out: only the first insertion counts; use does not refresh it."""

    name = "fifo"

    def mark_used(self, uid: Uid) -> None:
        if uid is None:
            return
        self.total_accesses += 1
        if uid not in self._order:
            self._order[uid] = time.monotonic()


class SIEVEEvictionPolicy(EvictionPolicy):
    """SIEVE (Zhang et al., NSDI '24): FIFO order plus one "visited" bit per uid.

    A hand walks from the oldest entry towards the newest; a visited candidate keeps its
    place and loses its bit, the first unvisited candidate is the victim. Use costs one
    bit flip (cheaper than LRU's reordering) and hot adapters survive scans.
    Non-candidates (running or pinned) are passed over without touching their bit.
    """

    name = "sieve"

    def __init__(self) -> None:
        super().__init__()
        self._queue: list[str] = []  # oldest first
        self._visited: dict[str, bool] = {}
        self._hand = 0

    def mark_used(self, uid: Uid) -> None:
        if uid is None:
            return
        self.total_accesses += 1
        if uid in self._visited:
            self._visited[uid] = True
        else:
            self._queue.append(uid)
            self._visited[uid] = False

    def select_victim(self, candidates: AbstractSet[Uid]) -> Uid:
        n = len(self._queue)
        if n and any(uid in candidates for uid in self._queue):
            pos = self._hand % n
            # Two passes suffice: the first clears every candidate's bit.
            for _ in range(2 * n):
                uid = self._queue[pos]
                if uid in candidates:
                    if not self._visited[uid]:
                        self._hand = pos
                        self.eviction_count += 1
                        return uid
                    self._visited[uid] = False
                pos = (pos + 1) % n
        return self._fallback_to_base(candidates)

    def remove(self, uid: Uid) -> None:
        if uid is None or uid not in self._visited:
            return
        idx = self._queue.index(uid)
        del self._queue[idx]
        del self._visited[uid]
        if idx < self._hand:
            self._hand -= 1
        if self._queue:
            self._hand %= len(self._queue)
        else:
            self._hand = 0

    def order(self) -> list[str]:
        """Tracked uids, oldest first."""
        return list(self._queue)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUEvictionPolicy,
    "fifo": FIFOEvictionPolicy,
    "sieve": SIEVEEvictionPolicy,
}


def get_eviction_policy(name: str = "lru") -> EvictionPolicy:
    """A fresh policy by name; ``"lru"`` is the default."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None

"""Host-memory tier between disk/hub and the pool's slots.

Holds loaded adapters (already in the pool's dtype, in pinned memory when CUDA is
present) under a byte budget with LRU replacement, so bringing an evicted adapter back
into a slot is a host-to-device copy instead of a file read and a parse.

The cache only needs each entry's ``nbytes``: the fleet simulator keeps entries that are
sizes without tensors in this same class, so its host tier evicts exactly as a replica's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Optional, Protocol, TypeVar

import torch

from .adapter import LoRAAdapterWeights


class SizedEntry(Protocol):
    """What the cache keeps: anything that knows its size (``LoRAAdapterWeights``, or a simulated one)."""

    @property
    def nbytes(self) -> int: ...


Entry = TypeVar("Entry", bound=SizedEntry)


@dataclass
class HostCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_used: int = 0
    entries: int = 0


class HostAdapterCache(Generic[Entry]):
    """LRU by bytes. Thread-safe: replicas load unrelated adapters concurrently."""

    def __init__(self, budget_bytes: int, pin_memory: Optional[bool] = None):
        if budget_bytes < 0:
            raise ValueError(f"host cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._entries: "OrderedDict[str, Entry]" = OrderedDict()
        self._lock = threading.Lock()
        self.stats = HostCacheStats()

    def get(self, uid: str) -> Optional[Entry]:
        with self._lock:
            weights = self._entries.get(uid)
            if weights is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(uid)
            self.stats.hits += 1
            return weights

    def put(self, uid: str, weights: Entry) -> Entry:
        """Cache ``weights`` (pinned if configured and they are tensors); returns the cached copy.

        An adapter larger than the whole budget is returned uncached.
        """
        size = weights.nbytes
        if size > self.budget_bytes:
            return weights
        if self.pin_memory and isinstance(weights, LoRAAdapterWeights):
            weights = weights.to(pin_memory=True)
        with self._lock:
            old = self._entries.pop(uid, None)
            if old is not None:
                self.stats.bytes_used -= old.nbytes
            while self._entries and self.stats.bytes_used + size > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.stats.bytes_used -= evicted.nbytes
                self.stats.evictions += 1
            self._entries[uid] = weights
            self.stats.bytes_used += size
            self.stats.entries = len(self._entries)
        return weights

    def remove(self, uid: str) -> None:
        with self._lock:
            old = self._entries.pop(uid, None)
            if old is not None:
                self.stats.bytes_used -= old.nbytes
                self.stats.entries = len(self._entries)

    def __contains__(self, uid: str) -> bool:
        with self._lock:
            return uid in self._entries

    def uids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

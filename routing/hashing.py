"""Stable 64-bit hashes for rendezvous placement: every router, in every process, agrees."""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from .identity import family_of

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@lru_cache(maxsize=1 << 16)
def stable_hash(key: str) -> int:
    """A 64-bit hash independent of PYTHONHASHSEED (Python's ``hash(str)`` is per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def placement_hash(name: str) -> int:
    """The key an adapter's rendezvous order is computed from: its family's name (``routing.identity.family_of``),
    so ``support@v2`` is ranked like ``support`` and a new version's fallback and standby replica are where
    the adapter already runs (hashing the entry name sent a flip's traffic to another worker)."""
    return stable_hash(family_of(name))


def rendezvous_scores(key_hash: int, replica_hashes: np.ndarray) -> np.ndarray:
    """splitmix64(key ^ replica) for every replica at once: higher score = earlier in key's order."""
    with np.errstate(over="ignore"):
        z = (replica_hashes ^ np.uint64(key_hash)) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """Replicas in ``key``'s rendezvous order, an adapter's versions alike (pin placement, rehoming, tests)."""
    hashes = np.array([stable_hash(r) for r in replica_ids], dtype=np.uint64)
    scores = rendezvous_scores(placement_hash(key), hashes)
    return [replica_ids[i] for i in np.argsort(scores, kind="stable")[::-1]]

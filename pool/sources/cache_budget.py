"""Least-recently-used eviction to a byte budget, shared by the node's download caches.

Both caches that hold downloaded adapters on a node's disk (the object-store cache in
``node_cache.py``, hub snapshots in ``hub_budget.py``) grow with every source anyone names,
so each is held to a budget the same way: oldest use first out, never the item just fetched,
never one used within a grace period (a replica that just found it is about to read it). The
choice is a pure function; the removal renames first, so a reader sees a folder whole or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

EVICTING = ".evicting-"   # a folder being deleted (renamed out of its cache first)


@dataclass(frozen=True)
class CacheItem:
    """One evictable thing in a cache: where it is, its bytes on disk, and its last use (epoch seconds)."""

    path: Path
    nbytes: int
    used_at: float


def prune_lru(items: Sequence[CacheItem], max_bytes: int, used_before: float,
              keep: Iterable[Path] = ()) -> list[CacheItem]:
    """The items to evict, oldest use first, until the rest fit in ``max_bytes``; items in ``keep`` and items
    used at or after ``used_before`` are never chosen (so the rest may stay above the budget until they age)."""
    kept = set(keep)
    total = sum(item.nbytes for item in items)
    evicted = []
    for item in sorted(items, key=lambda i: i.used_at):
        if total <= max_bytes:
            break
        if item.path in kept or item.used_at >= used_before:
            continue
        evicted.append(item)
        total -= item.nbytes
    return evicted


def remove_folder(folder: Path) -> None:
    """Take ``folder`` out of its cache at once (a rename), then delete it; gone already is fine."""
    doomed = folder.parent / f"{folder.name}{EVICTING}{uuid.uuid4().hex[:8]}"
    try:
        os.rename(folder, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


@contextlib.contextmanager
def held_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` for the block (one pruner per cache on the node at a time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)

"""A node-local download cache that every replica on the node shares, held to a byte budget.

Each entry is a folder keyed by source and version. The first process to want an entry
takes an exclusive ``flock`` on the entry's lock file, downloads into a private temporary
folder and renames it into place; the others wait on the lock and then find the entry, so
N replicas on a node download once. Rename is atomic, so an entry that exists is whole,
and a crashed downloader leaves only a temporary folder (removed by the next one) and a
lock the kernel has already released.

Bounded, because a registration (or a resolver lookup anyone can trigger) can name any
number of sources: lock files are ``LOCK_STRIPES`` stripes that entries share by hash (never
one file per entry), and after each download the least recently used entries go until the
cache is within ``max_bytes`` (``cache_budget.prune_lru``). An entry used within
``evict_grace_s`` stays (a replica that just found it is about to read it); one that went is
downloaded again by the next process that needs it (``AdapterStore.fetch`` re-resolves a
folder that is gone).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from ..errors import SourceUnavailableError
from .cache_budget import EVICTING, CacheItem, held_lock, prune_lru, remove_folder

LOCK_STRIPES = 64          # lock files at most, shared by entries by hash (downloads of two entries may serialise)
LOCKS_DIR = ".locks"
PARTIAL = ".partial-"      # a download in progress (or left by a crashed downloader)
KEY_PARTS = 4              # scheme, bucket, key hash, content version (object_store.resolve_object_source)


@dataclass(frozen=True)
class CacheFetch:
    """What one ``NodeDownloadCache.get`` did: where the files are and whether this call downloaded them."""

    folder: Path
    downloaded: bool
    waited_s: float     # time spent waiting for another process's download
    seconds: float      # total time of the call


class NodeDownloadCache:
    def __init__(self, root: str | os.PathLike, lock_timeout_s: float = 600.0, max_bytes: Optional[int] = None,
                 evict_grace_s: float = 60.0, key_parts: int = KEY_PARTS):
        """``max_bytes``: the cache's disk budget (None: unbounded); ``evict_grace_s``: an entry used this
        recently is never evicted, so the bound is ``max_bytes`` plus what the node used in that window;
        ``key_parts``: every key's length (entries are folders that deep, found without a full walk)."""
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"node cache budget must be >= 0 bytes, got {max_bytes}")
        if evict_grace_s < 0:
            raise ValueError(f"node cache eviction grace must be >= 0 s, got {evict_grace_s}")
        self.root = Path(root)
        self.lock_timeout_s = lock_timeout_s
        self.max_bytes = max_bytes
        self.evict_grace_s = evict_grace_s
        self.key_parts = key_parts

    def entry(self, *key: str) -> Path:
        if len(key) != self.key_parts or not all(key) or any(part.startswith(".") or "/" in part for part in key):
            raise ValueError(f"a node cache key is {self.key_parts} plain folder names, got {key!r}")
        return self.root.joinpath(*key)

    def get(self, key: tuple[str, ...], download: Callable[[Path], None]) -> CacheFetch:
        """The folder for ``key``; ``download(tmp_folder)`` fills it if no process on this node has yet."""
        start = time.monotonic()
        entry = self.entry(*key)
        if entry.is_dir():
            _touch(entry)
            return CacheFetch(entry, False, 0.0, time.monotonic() - start)
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.lock_path(key)
        with open(lock_path, "a+b") as lock_file:
            self._acquire(lock_file, lock_path)
            waited = time.monotonic() - start
            try:
                if entry.is_dir():
                    _touch(entry)
                    return CacheFetch(entry, False, waited, time.monotonic() - start)
                self._remove_stale_partials(entry)
                tmp = entry.parent / f"{entry.name}{PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}"
                tmp.mkdir(parents=True)   # (an eviction may have removed the empty parent)
                try:
                    download(tmp)
                    os.rename(tmp, entry)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        self.prune(keep=entry)
        return CacheFetch(entry, True, waited, time.monotonic() - start)

    def prune(self, keep: Optional[Path] = None) -> list[Path]:
        """Evict least recently used entries until the cache is within ``max_bytes``; returns those evicted."""
        if self.max_bytes is None or not self.root.is_dir():
            return []
        with held_lock(self._locks_dir() / "prune.lock"):
            items = [CacheItem(folder, _folder_bytes(folder), folder.stat().st_mtime) for folder in self.entries()]
            evicted = prune_lru(items, self.max_bytes, time.time() - self.evict_grace_s,
                                keep={keep} if keep is not None else set())
            for item in evicted:
                remove_folder(item.path)
                _remove_empty_parents(item.path.parent, self.root)
        return [item.path for item in evicted]

    def entries(self) -> Iterator[Path]:
        """Every whole entry: a folder ``key_parts`` deep, not a download in progress or an eviction."""
        level = [self.root]
        for _ in range(self.key_parts):
            below = []
            for folder in level:
                try:
                    with os.scandir(folder) as found:
                        below += [Path(d.path) for d in found if d.is_dir(follow_symlinks=False)
                                  and not d.name.startswith(".") and PARTIAL not in d.name and EVICTING not in d.name]
                except FileNotFoundError:   # evicted meanwhile by another process's pruner
                    continue
            level = below
        return iter(level)

    def total_bytes(self) -> int:
        return sum(_folder_bytes(folder) for folder in self.entries())

    def _locks_dir(self) -> Path:
        locks = self.root / LOCKS_DIR
        locks.mkdir(parents=True, exist_ok=True)
        return locks

    def lock_path(self, key: tuple[str, ...]) -> Path:
        """The lock stripe that serialises downloads of ``key`` on this node."""
        stripe = int(hashlib.sha256("/".join(key).encode()).hexdigest(), 16) % LOCK_STRIPES
        return self._locks_dir() / f"{stripe:02d}.lock"

    def _acquire(self, lock_file, lock_path: Path) -> None:
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.01
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise SourceUnavailableError(
                        f"another process on this node has held the download lock {lock_path} for over "
                        f"{self.lock_timeout_s:.0f}s; retry later") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.25)

    @staticmethod
    def _remove_stale_partials(entry: Path) -> None:
        """Partial folders left by a downloader that died (we hold the entry's lock stripe, so none is live)."""
        for stale in entry.parent.glob(f"{entry.name}{PARTIAL}*"):
            shutil.rmtree(stale, ignore_errors=True)


def _touch(folder: Path) -> None:
    """Mark an entry used now (its mtime is the LRU clock); it may have been evicted meanwhile."""
    try:
        os.utime(folder)
    except FileNotFoundError:
        pass


def _folder_bytes(folder: Path) -> int:
    total = 0
    for f in folder.iterdir():
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _remove_empty_parents(folder: Path, root: Path) -> None:
    """The key's upper folders, once their last entry went (so evicted keys leave no empty folders behind)."""
    while folder != root and root in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent

"""A node-local download cache that every replica on the node shares.

Each entry is a folder keyed by source and version. The first process to want an entry
takes an exclusive ``flock`` on the entry's lock file, downloads into a private temporary
folder and renames it into place; the others wait on the lock and then find the entry, so
N replicas on a node download once. Rename is atomic, so an entry that exists is whole,
and a crashed downloader leaves only a temporary folder (removed by the next one) and a
lock the kernel has already released.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import SourceUnavailableError


@dataclass(frozen=True)
class CacheFetch:
    """What one ``NodeDownloadCache.get`` did: where the files are and whether this call downloaded them."""

    folder: Path
    downloaded: bool
    waited_s: float     # time spent waiting for another process's download
    seconds: float      # total time of the call


class NodeDownloadCache:
    def __init__(self, root: str | os.PathLike, lock_timeout_s: float = 600.0):
        self.root = Path(root)
        self.lock_timeout_s = lock_timeout_s

    def entry(self, *key: str) -> Path:
        return self.root.joinpath(*key)

    def get(self, key: tuple[str, ...], download: Callable[[Path], None]) -> CacheFetch:
        """The folder for ``key``; ``download(tmp_folder)`` fills it if no process on this node has yet."""
        start = time.monotonic()
        entry = self.entry(*key)
        if entry.is_dir():
            return CacheFetch(entry, False, 0.0, time.monotonic() - start)
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock_path = entry.parent / f"{entry.name}.lock"
        with open(lock_path, "a+b") as lock_file:
            self._acquire(lock_file, lock_path)
            waited = time.monotonic() - start
            try:
                if entry.is_dir():
                    return CacheFetch(entry, False, waited, time.monotonic() - start)
                self._remove_stale_partials(entry)
                tmp = entry.parent / f"{entry.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                tmp.mkdir()
                try:
                    download(tmp)
                    os.rename(tmp, entry)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                return CacheFetch(entry, True, waited, time.monotonic() - start)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

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
        """Partial folders left by a downloader that died (we hold the lock, so none is live)."""
        for stale in entry.parent.glob(f"{entry.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)

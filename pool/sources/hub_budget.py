"""Hub adapter snapshots in huggingface_hub's cache, held to a byte budget.

Hub adapters stay in huggingface_hub's own cache (``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` keep
working), but every repo anyone registers or a resolver looks up lands there, so the adapter
snapshots are held to the node's adapter budget: after each hub resolve, the least recently
used adapter revisions go until the adapter snapshots fit (``cache_budget.prune_lru``). Only
adapter revisions are counted or removed (an ``adapter_config.json`` and no ``config.json``):
the base model, and anything else sharing the cache, is never touched. A revision's last use
is its snapshot folder's mtime, which each resolve touches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..adapter import CONFIG_FILE
from .cache_budget import CacheItem, held_lock, prune_lru

PRUNE_LOCK = ".lorafleet-prune.lock"   # in the hub cache folder: one pruner per node at a time
BASE_MODEL_CONFIG = "config.json"


def touch_snapshot(snapshot: Path) -> None:
    """Mark a revision used now (its snapshot folder's mtime is the LRU clock)."""
    try:
        os.utime(snapshot)
    except FileNotFoundError:
        pass


def adapter_revisions(cache_dir: Optional[Path] = None, info=None) -> list[CacheItem]:
    """Every adapter revision in the hub cache: its snapshot folder, bytes and last use (``info``: a scan
    already made, ``huggingface_hub.scan_cache_dir``'s answer)."""
    from huggingface_hub import scan_cache_dir

    items = []
    for repo in (info or scan_cache_dir(cache_dir)).repos:
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            names = {f.file_name for f in revision.files}
            if CONFIG_FILE in names and BASE_MODEL_CONFIG not in names:
                items.append(CacheItem(revision.snapshot_path, revision.size_on_disk,
                                       revision.snapshot_path.stat().st_mtime))
    return items


def prune_hub_adapters(max_bytes: Optional[int], keep: Optional[Path] = None, cache_dir: Optional[Path] = None,
                       evict_grace_s: float = 60.0) -> list[Path]:
    """Remove least recently used adapter revisions until they fit in ``max_bytes`` (never ``keep``, never one
    used within ``evict_grace_s``); returns the snapshot folders removed. ``None``: no budget."""
    if max_bytes is None:
        return []
    import time

    from huggingface_hub import constants, scan_cache_dir

    root = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    if not root.is_dir():
        return []
    with held_lock(root / PRUNE_LOCK):
        info = scan_cache_dir(root)
        evicted = prune_lru(adapter_revisions(info=info), max_bytes, time.time() - evict_grace_s,
                            keep={keep} if keep is not None else set())
        if evicted:
            info.delete_revisions(*{item.path.name for item in evicted}).execute()
    return [item.path for item in evicted]

"""What a registration's weights are: the content version recorded with it, checked on every read.

A registration names a source, not bytes; a replica that loads it later, or re-reads it
after a host-tier eviction, must get the bytes it was validated with, or serve nothing.
Hub and object-store sources carry their own version (the hub commit, the object's content
version). A local folder gets a hash of its adapter_config.json and weights; the weights'
hash is kept per (path, size, mtime), so checking an unchanged file again is a stat, and a
copy of the same bytes on another node (another mtime) hashes the same.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

from pool.adapter import CONFIG_FILE, WEIGHTS_FILE
from pool.errors import AdapterError
from pool.store import AdapterRecord


class SourceChangedError(AdapterError):
    """The adapter's source no longer holds what was registered under this uid (409: re-register it)."""


_WEIGHT_HASHES: OrderedDict[tuple[str, int, int], str] = OrderedDict()   # (path, size, mtime_ns) -> sha256
_MAX_WEIGHT_HASHES = 256


def _weights_hash(path: Path) -> str:
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    known = _WEIGHT_HASHES.get(key)
    if known is None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        known = _WEIGHT_HASHES[key] = digest.hexdigest()
        while len(_WEIGHT_HASHES) > _MAX_WEIGHT_HASHES:
            _WEIGHT_HASHES.popitem(last=False)
    _WEIGHT_HASHES.move_to_end(key)
    return known


def folder_fingerprint(folder: Path) -> str:
    digest = hashlib.sha256((folder / CONFIG_FILE).read_bytes())
    digest.update(_weights_hash(folder / WEIGHTS_FILE).encode())
    return f"local:{digest.hexdigest()[:16]}"


def content_version(record: AdapterRecord) -> str:
    """The record's own version (hub commit, object version), else its folder's fingerprint."""
    return record.version if record.version is not None else folder_fingerprint(Path(record.folder))


def check_unchanged(record: AdapterRecord, registered: str | None) -> None:
    """Raise ``SourceChangedError`` when ``record`` is not what was registered (``None``: nothing recorded)."""
    if registered is None:
        return
    now = content_version(record)
    if now != registered:
        raise SourceChangedError(
            f"adapter {record.name!r}: its source {record.source!r} changed since it was registered "
            f"(registered {registered}, now {now}); register it again to serve the new weights")

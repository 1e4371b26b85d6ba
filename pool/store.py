"""AdapterStore: a replica's registered adapters and where their weights come from.

Registration resolves the source (local folder, hub repo, or object-store prefix through
the node-local download cache), reads and validates the whole adapter, and puts it in
the host tier, so every refusal happens before the pool is touched. The pool's slot loads
use ``fetch_staged`` (host tier only, a memory copy); ``fetch`` re-reads an adapter the host
tier dropped, on a thread that may block.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from .adapter import LoRAAdapterWeights, load_adapter_folder, max_adapter_file_bytes
from .errors import AdapterNotFoundError, AdapterNotStagedError
from .host_cache import HostAdapterCache
from .shapes import LoRAModelShape
from .sources import SourcePolicy, resolve_adapter_source


@dataclass(frozen=True)
class AdapterRecord:
    uid: str
    name: str
    source: str
    revision: Optional[str]
    folder: Path
    rank: int
    nbytes: int
    version: Optional[str] = None   # hub commit or object-store content version; None for a local folder


class AdapterStore:
    def __init__(
        self,
        shape: LoRAModelShape,
        max_lora_rank: int,
        *,
        dtype: torch.dtype = torch.float32,
        host_cache_bytes: int = 1 << 30,
        allowed_roots: Sequence[str] | None = None,
        hub_orgs: Sequence[str] | None = None,
        object_store_prefixes: Sequence[str] | None = None,
        adapter_cache_dir: str | None = None,
        adapter_cache_bytes: int | None = None,
    ):
        self.shape = shape
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.host_cache = HostAdapterCache(host_cache_bytes)
        self.policy = SourcePolicy.of(allowed_roots, hub_orgs, object_store_prefixes, adapter_cache_dir,
                                      adapter_cache_bytes)
        self._records: dict[str, AdapterRecord] = {}
        self._lock = threading.Lock()

    def register(self, uid: str, source: str, *, name: Optional[str] = None,
                 revision: Optional[str] = None) -> AdapterRecord:
        """Resolve, read and validate the adapter; keep it in the host tier.

        Runs without the store's lock held so loads of unrelated adapters overlap.
        """
        name = name or uid
        resolved = resolve_adapter_source(source, revision, self.policy,
                                          max_adapter_file_bytes(self.shape, self.max_lora_rank))
        weights = load_adapter_folder(resolved.folder, self.shape, self.max_lora_rank, name=name, dtype=self.dtype)
        record = AdapterRecord(uid, name, source, revision, resolved.folder, weights.rank, weights.nbytes,
                               resolved.version)
        self.host_cache.put(uid, weights)
        with self._lock:
            self._records[uid] = record
        return record

    def unregister(self, uid: str) -> None:
        with self._lock:
            self._records.pop(uid, None)
        self.host_cache.remove(uid)

    def record(self, uid: str) -> AdapterRecord:
        with self._lock:
            try:
                return self._records[uid]
            except KeyError:
                raise AdapterNotFoundError(f"adapter {uid!r} is not registered on this replica") from None

    def __contains__(self, uid: str) -> bool:
        with self._lock:
            return uid in self._records

    def uids(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def fetch_staged(self, uid: str) -> LoRAAdapterWeights:
        """Weights for a slot load, from the host tier only (a memory copy, never a file read)."""
        cached = self.host_cache.get(uid)
        if cached is None:
            self.record(uid)  # an unknown uid is AdapterNotFoundError, not "not staged"
            raise AdapterNotStagedError(uid)
        return cached

    def is_staged(self, uid: str) -> bool:
        return uid in self.host_cache

    def fetch(self, uid: str) -> LoRAAdapterWeights:
        """Weights from the host tier, else re-read from the folder (and kept in the host tier)."""
        cached = self.host_cache.get(uid)
        if cached is not None:
            return cached
        record = self.record(uid)
        folder = record.folder
        if not folder.is_dir():   # a download cache evicted it (held to its budget): fetch the same content again
            folder = resolve_adapter_source(record.source, record.version or record.revision, self.policy,
                                            max_adapter_file_bytes(self.shape, self.max_lora_rank)).folder
        weights = load_adapter_folder(folder, self.shape, self.max_lora_rank, name=record.name, dtype=self.dtype)
        return self.host_cache.put(uid, weights)

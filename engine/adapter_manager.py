"""AdapterManager: registers, pins and unloads adapters across the store, the pool and the registry.

Reading and validating files happens on the caller's thread, so unrelated adapters load
concurrently and generation never waits on a file. Unloading waits for the adapter's
requests to drain, then takes the engine's step lock so no step is using its slot.
"""

from __future__ import annotations

import threading
import uuid
from typing import Callable, Optional

from pool.errors import LoRAFleetError
from pool.memory_pool import LoRAMemoryPool
from pool.store import AdapterRecord, AdapterStore

from .adapter_registry import AdapterRegistry, CancelRequests
from .errors import AdapterExistsError

RETIRE_REPLACED_TIMEOUT_S = 60.0  # a re-registered name's old uid serves its requests this long at most


class AdapterManager:
    def __init__(self, store: AdapterStore, pool: LoRAMemoryPool, registry: AdapterRegistry, *,
                 step_lock: threading.Lock, running_uids: Callable[[], set], cancel: CancelRequests):
        self.store = store
        self.pool = pool
        self.registry = registry
        self._step_lock = step_lock
        self._running_uids = running_uids
        self._cancel = cancel

    def register(self, name: str, source: str, *, revision: Optional[str] = None,
                 uid: Optional[str] = None, pinned: bool = False) -> AdapterRecord:
        """Read, validate and host-cache an adapter under ``name``; errors leave nothing behind.

        Re-registering a name with a new uid retires the old uid once its requests finish.
        """
        current = self.registry.current_uid(name)
        if current is not None and (uid is None or uid == current):
            record = self.registry.record(current)
            if record.source == source and record.revision == revision:
                if pinned:
                    self.pool.pin(current)
                return record
            if uid is None:
                raise AdapterExistsError(f"adapter {name!r} is already registered from {record.source!r}")
        uid = uid or f"{name}@{uuid.uuid4().hex[:8]}"
        record = self.store.register(uid, source, name=name, revision=revision)
        if pinned:
            try:
                self.pool.pin(uid)
            except LoRAFleetError:
                self.store.unregister(uid)
                raise
        old = self.registry.bind(record)
        if old is not None:
            threading.Thread(target=self.retire, args=(old, RETIRE_REPLACED_TIMEOUT_S), daemon=True).start()
        return record

    def unregister(self, name: str, timeout_s: float) -> str:
        """Refuse new requests for ``name`` at once, drain its requests, then unload it. Returns the uid."""
        uid = self.registry.unbind(name)
        self.retire(uid, timeout_s)
        return uid

    def unregister_uid(self, uid: str, timeout_s: float) -> bool:
        """Retire one registration by its uid: a name re-registered meanwhile keeps its new uid.

        False when this engine does not hold ``uid`` (never loaded here, or retired already).
        """
        if not self.registry.knows(uid):
            return False
        self.registry.unbind_uid(uid)
        self.retire(uid, timeout_s)
        return True

    def retire(self, uid: str, timeout_s: float) -> None:
        """Drain ``uid`` (cancelling what is left after ``timeout_s``), then drop it from pool and store."""
        self.registry.drain(uid, timeout_s, self._cancel)
        with self._step_lock:
            self.pool.retain_batch(self._running_uids())
            self.pool.remove(uid)
            self.store.unregister(uid)
            self.registry.forget(uid)

    def pin(self, name: str) -> int:
        return self.pool.pin(self.registry.resolve(name))

    def unpin(self, name: str) -> bool:
        uid = self.registry.resolve(name)
        if uid not in self.pool.pinned:
            return False
        return self.pool.unpin(uid)

    def validate_files(self, uid: str, source: str, *, name: str, revision: Optional[str] = None) -> AdapterRecord:
        """Read and validate an adapter as registration would, keeping nothing: its facts, or the error."""
        record = self.store.register(uid, source, name=name, revision=revision)
        self.store.unregister(uid)
        return record

"""Adapter weights made ready for slot loads without a file read on the engine thread.

The pool's slot loads read only memory: the host tier, or weights handed over once for an
adapter the host tier cannot keep (a budget of 0, or smaller than the adapter). Reads from
disk happen on the submitting thread, or on a background thread when the host tier dropped
an adapter between submission and admission.
"""

from __future__ import annotations

import threading
from typing import Callable

from pool.adapter import LoRAAdapterWeights
from pool.errors import LoRAFleetError
from pool.store import AdapterStore


class AdapterStaging:
    def __init__(self, store: AdapterStore, on_failure: Callable[[str, Exception], None],
                 on_done: Callable[[], None]):
        self.store = store
        self._on_failure = on_failure  # (uid, error): fail that adapter's requests
        self._on_done = on_done        # wake the engine loop
        self._handover: dict[str, LoRAAdapterWeights] = {}
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()

    def stage(self, uid: str) -> None:
        """Read ``uid`` if the host tier lacks it (blocks: call it off the engine thread)."""
        weights = self.store.fetch(uid)
        if not self.store.is_staged(uid):
            self._handover[uid] = weights

    def slot_weights(self, uid: str) -> LoRAAdapterWeights:
        """The pool's weight source: a memory copy only (raises ``AdapterNotStagedError`` otherwise)."""
        handed = self._handover.pop(uid, None)
        return handed if handed is not None else self.store.fetch_staged(uid)

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    def stage_in_background(self, uid: str) -> None:
        with self._lock:
            if uid in self._in_flight:
                return
            self._in_flight.add(uid)
        threading.Thread(target=self._stage_then_wake, args=(uid,), name=f"lorafleet-stage-{uid}",
                         daemon=True).start()

    def _stage_then_wake(self, uid: str) -> None:
        try:
            self.stage(uid)
        except LoRAFleetError as exc:  # unregistered meanwhile, or unreadable: its requests fail alone
            self._on_failure(uid, exc)
        finally:
            with self._lock:
                self._in_flight.discard(uid)
            self._on_done()

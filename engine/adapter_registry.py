"""AdapterRegistry: which uid a name serves now, and how many requests each uid still owes.

A name is re-pointed to a new uid atomically; the old uid keeps serving the requests it
already accepted until they drain (or a timeout cancels them), so an update or an
unregister never cuts a request short and never lets a new one reach a retiring uid.
Pure bookkeeping under one condition variable: no model, no pool, safe from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable, Optional

from pool.errors import AdapterNotFoundError
from pool.store import AdapterRecord

from .errors import AdapterUnregisteredError

CancelRequests = Callable[[str, Exception], None]


class AdapterRegistry:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._uids: dict[str, str] = {}                # name -> current uid
        self._records: dict[str, AdapterRecord] = {}   # uid -> record, until the uid is unloaded
        self._inflight: Counter = Counter()            # uid (None: base model) -> waiting + running requests

    # ------------------------------------------------------------------ reads

    def current_uid(self, name: str) -> Optional[str]:
        """The uid ``name`` serves now, or None when the name is not registered."""
        with self._cond:
            return self._uids.get(name)

    def resolve(self, name: Optional[str]) -> Optional[str]:
        """Like ``current_uid``, but an unknown name is an error; None (the base model) stays None."""
        if name is None:
            return None
        uid = self.current_uid(name)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return uid

    def record(self, uid: str) -> Optional[AdapterRecord]:
        with self._cond:
            return self._records.get(uid)

    def names(self) -> dict[str, str]:
        """A copy of name -> current uid."""
        with self._cond:
            return dict(self._uids)

    def inflight(self, uid: Optional[str]) -> int:
        with self._cond:
            return self._inflight[uid]

    # ------------------------------------------------------------------ names

    def bind(self, record: AdapterRecord) -> Optional[str]:
        """Point ``record.name`` at ``record.uid``; returns the uid it pointed at before, if another."""
        with self._cond:
            old = self._uids.get(record.name)
            self._uids[record.name] = record.uid
            self._records[record.uid] = record
        return old if old != record.uid else None

    def unbind_uid(self, uid: str) -> bool:
        """Stop routing new requests to ``uid`` if its name still points at it; False if it does not."""
        with self._cond:
            record = self._records.get(uid)
            if record is None or self._uids.get(record.name) != uid:
                return False
            del self._uids[record.name]
        return True

    def knows(self, uid: str) -> bool:
        with self._cond:
            return uid in self._records

    def unbind(self, name: str) -> str:
        """Stop routing new requests to ``name`` at once; returns the uid it served."""
        with self._cond:
            uid = self._uids.pop(name, None)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return uid

    # ------------------------------------------------------------------ requests

    def acquire(self, name: Optional[str], uid: Optional[str]) -> None:
        """Count one more request on ``uid``, if ``name`` still serves it (checked and counted atomically)."""
        with self._cond:
            if name is not None and self._uids.get(name) != uid:
                raise AdapterNotFoundError(f"adapter {name!r} is not registered")
            self._inflight[uid] += 1

    def release(self, uid: Optional[str]) -> None:
        with self._cond:
            self._inflight[uid] -= 1
            self._cond.notify_all()

    def drain(self, uid: str, timeout_s: float, cancel: CancelRequests) -> None:
        """Wait until ``uid`` has no requests; past ``timeout_s`` call ``cancel`` and wait for them to end.

        ``cancel(uid, error)`` must make every request on ``uid`` end (and be released) soon;
        it is called without the registry's lock held.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._inflight[uid] > 0 and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            if self._inflight[uid] == 0:
                return
        cancel(uid, AdapterUnregisteredError(f"adapter uid {uid!r} was unregistered; its requests were cancelled "
                                             f"after {timeout_s:.0f}s"))
        with self._cond:
            while self._inflight[uid] > 0:
                self._cond.wait(timeout=1.0)

    def forget(self, uid: str) -> None:
        """Drop a drained uid's record and count (its weights are unloaded by the caller)."""
        with self._cond:
            self._records.pop(uid, None)
            if self._inflight[uid] == 0:
                self._inflight.pop(uid, None)

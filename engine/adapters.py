"""ReplicaAdapters: an adapter's whole life on one replica, in one object.

register (read and validate the files, keep the weights in the host tier) -> stage (make the
next slot load a memory copy) -> load into a slot (a batch that needs it, or ``load_into_slot``
with no request) -> retire (refuse new requests, drain, unload) -> report.

Why one object: names, in-flight counts, staging and unloading used to live in three engine
files with a second copy of every record. Now the store (``pool/store.py``) keeps the one
record of each adapter (its files' facts, needed to re-read it) and this object keeps only
what serving adds: which uids are live (each with its name) and how many requests each uid owes.

The pool stays the single owner of slots, and the engine thread the only thread that changes
it: every slot change made here (load, pin, unpin, unload) is handed to the engine with
``at_step_boundary`` and runs between two steps, never under a running forward. Files are read
on the caller's thread (or a staging thread), never on the engine thread, so unrelated adapters
load concurrently and generation never waits on a file (Ray issue 65346).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, OrderedDict
from typing import Callable, Iterable, Optional, TypeVar

from pool.adapter import LoRAAdapterWeights
from pool.errors import AdapterNotFoundError, LoRAFleetError
from pool.memory_pool import LoRAMemoryPool
from pool.store import AdapterRecord, AdapterStore

from .errors import AdapterExistsError, AdapterUnregisteredError

T = TypeVar("T")
AtStepBoundary = Callable[[Callable[[], T]], T]  # run a pool change on the engine thread between steps
CancelRequests = Callable[[str, Exception], None]  # fail every request of a uid soon
RETIRE_REPLACED_TIMEOUT_S = 60.0  # a re-registered name's old uid serves its requests this long at most


class ReplicaAdapters:
    def __init__(self, store: AdapterStore, pool: LoRAMemoryPool, *, at_step_boundary: AtStepBoundary,
                 running_uids: Callable[[], set], cancel: CancelRequests, wake: Callable[[], None]):
        self.store = store
        self.pool = pool
        self._at_step_boundary = at_step_boundary
        self._running_uids = running_uids
        self._cancel = cancel  # (uid, error): fail that uid's requests (a drain timeout, a failed re-read)
        self._wake = wake      # the engine loop: a staged adapter's requests may be admitted now
        self._cond = threading.Condition()
        # each live uid -> its name (at most one uid per name): a request's uid is checked here; a name is
        # looked up (a scan) only by registration, admin calls and callers that drive the engine directly
        self._serving: dict[str, str] = {}
        self.name_lookups = 0             # names resolved for requests that came without a uid (engine-only callers)
        self._inflight: Counter = Counter()  # uid (None: base model) -> waiting + running requests
        # read for one slot load the host tier cannot keep; at most one per slot (a batch loads no more), oldest
        # out first: a dropped one is read again when its load comes (``AdapterNotStagedError``: staged anew)
        self._handover: OrderedDict[str, LoRAAdapterWeights] = OrderedDict()
        self.handover_max = pool.slots
        self._staging: set[str] = set()   # uids being re-read on a background thread

    # ------------------------------------------------------------------ names and requests

    def current_uid(self, name: str) -> Optional[str]:
        """The uid ``name`` serves now, or None when the name is not registered."""
        with self._cond:
            return next((uid for uid, served in self._serving.items() if served == name), None)

    def resolve(self, name: Optional[str]) -> Optional[str]:
        """A request's uid when its caller gave only a name (a script or test driving the engine itself; the
        fleet's requests carry the uid the ingress resolved). Counted, so a test can show the fleet's
        requests never come here. None (the base model) stays None."""
        if name is None:
            return None
        with self._cond:
            self.name_lookups += 1
        return self._registered(name)

    def serves(self, uid: str) -> bool:
        """``uid`` is live here: registered, and not replaced, unregistered or retiring."""
        with self._cond:
            return uid in self._serving

    def _registered(self, name: str) -> str:
        uid = self.current_uid(name)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return uid

    def _serve(self, name: str, uid: Optional[str]) -> Optional[str]:
        """``name`` serves ``uid`` from now on (None: nothing); returns the uid it served until now, if another."""
        with self._cond:
            old = next((u for u, served in self._serving.items() if served == name), None)
            self._serving.pop(old, None)
            if uid is not None:
                self._serving[uid] = name
        return old if old != uid else None

    def names(self) -> dict[str, str]:
        """A copy of name -> current uid."""
        with self._cond:
            return {name: uid for uid, name in self._serving.items()}

    def inflight(self, uid: Optional[str]) -> int:
        with self._cond:
            return self._inflight[uid]

    def acquire(self, uid: Optional[str]) -> None:
        """Count one more request on ``uid`` if it is still live (checked and counted atomically, so no
        request reaches a uid that retiring has stopped, and none is served a re-registered name's new
        weights: the uid it was resolved to is refused instead)."""
        with self._cond:
            if uid is not None and uid not in self._serving:
                raise AdapterUnregisteredError(f"adapter uid {uid!r} no longer serves here: its name was "
                                               f"re-registered or unregistered after this request was resolved")
            self._inflight[uid] += 1

    def release(self, uid: Optional[str]) -> None:
        with self._cond:
            self._inflight[uid] -= 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ register and retire

    def register(self, name: str, source: str, *, revision: Optional[str] = None,
                 uid: Optional[str] = None, pinned: bool = False) -> AdapterRecord:
        """Read, validate and host-cache an adapter under ``name``; errors leave nothing behind.

        The same source again is a no-op (pinning it if asked). Re-registering a name with a new uid
        retires the old uid once its requests finish, so a request is never served other weights.
        """
        current = self.current_uid(name)
        if current is not None and (uid is None or uid == current):
            record = self.store.record(current)
            if record.source == source and record.revision == revision:
                if pinned:
                    self._at_step_boundary(lambda: self.pool.pin(current))
                return record
            if uid is None:
                raise AdapterExistsError(f"adapter {name!r} is already registered from {record.source!r}")
        uid = uid or f"{name}@{uuid.uuid4().hex[:8]}"
        record = self.store.register(uid, source, name=name, revision=revision)
        if pinned:
            try:
                self._at_step_boundary(lambda: self.pool.pin(uid))
            except LoRAFleetError:
                self.store.unregister(uid)
                raise
        old = self._serve(name, uid)
        if old is not None:
            threading.Thread(target=self.retire, args=(old, RETIRE_REPLACED_TIMEOUT_S), daemon=True).start()
        return record

    def validate_files(self, uid: str, source: str, *, name: str, revision: Optional[str] = None) -> AdapterRecord:
        """Read and validate an adapter as registration would, keeping nothing: its facts, or the error."""
        record = self.store.register(uid, source, name=name, revision=revision)
        self.store.unregister(uid)
        return record

    def unregister(self, name: str, timeout_s: float) -> str:
        """Refuse new requests for ``name`` at once, drain its requests, then unload it. Returns the uid."""
        uid = self._serve(name, None)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        self.retire(uid, timeout_s)
        return uid

    def unregister_uid(self, uid: str, timeout_s: float) -> bool:
        """Retire one registration by its uid: a name re-registered meanwhile keeps its new uid.

        False when this replica does not hold ``uid`` (never registered here, or retired already).
        """
        try:
            name = self.store.record(uid).name
        except AdapterNotFoundError:  # never registered here, or retired meanwhile
            return False
        with self._cond:
            self._serving.pop(uid, None)  # a newer uid of the same name keeps serving
        self.retire(uid, timeout_s)
        return True

    def retire(self, uid: str, timeout_s: float) -> None:
        """Drain ``uid`` (cancelling what is left after ``timeout_s``), then drop it from pool and store.

        The unload runs at a step boundary: the pool refuses to unload an adapter of the running
        batch, and once drained ``uid`` is in no batch.
        """
        self._drain(uid, timeout_s)

        def unload() -> None:
            self.pool.retain_batch(self._running_uids())
            self.pool.remove(uid)
            self.store.unregister(uid)
            with self._cond:
                self._handover.pop(uid, None)

        self._at_step_boundary(unload)
        with self._cond:
            if self._inflight[uid] == 0:
                self._inflight.pop(uid, None)

    def _drain(self, uid: str, timeout_s: float) -> None:
        """Wait until ``uid`` has no requests; past ``timeout_s`` cancel them and wait for them to end."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._inflight[uid] > 0 and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            if self._inflight[uid] == 0:
                return
        self._cancel(uid, AdapterUnregisteredError(f"adapter uid {uid!r} was unregistered; its requests were "
                                                   f"cancelled after {timeout_s:.0f}s"))
        with self._cond:
            while self._inflight[uid] > 0:
                self._cond.wait(timeout=1.0)

    # ------------------------------------------------------------------ stage and load

    def stage(self, uid: str) -> None:
        """Read ``uid`` if the host tier lacks it, so its slot load is a memory copy (blocks: never call
        it on the engine thread). An adapter the host tier cannot keep is handed over for one load."""
        weights = self.store.fetch(uid)
        if not self.store.is_staged(uid):
            with self._cond:
                self._handover[uid] = weights
                self._handover.move_to_end(uid)
                while len(self._handover) > self.handover_max:
                    self._handover.popitem(last=False)

    def stage_in_background(self, uid: str) -> None:
        """``stage`` on a thread of its own (the host tier dropped ``uid`` after its request was admitted)."""
        with self._cond:
            if uid in self._staging:
                return
            self._staging.add(uid)
        threading.Thread(target=self._stage_then_wake, args=(uid,), name=f"lorafleet-stage-{uid}",
                         daemon=True).start()

    def map_sizes(self) -> dict[str, int]:
        """Entries of each per-adapter map here (the soak test checks each against its bound)."""
        with self._cond:
            return {"serving": len(self._serving), "inflight": len(self._inflight), "handover": len(self._handover),
                    "staging": len(self._staging)}

    @property
    def staging(self) -> bool:
        """A background read is under way: the engine loop waits for it instead of spinning."""
        return bool(self._staging)

    def slot_weights(self, uid: str) -> LoRAAdapterWeights:
        """The pool's weight source: a memory copy only (raises ``AdapterNotStagedError`` otherwise)."""
        with self._cond:
            handed = self._handover.pop(uid, None)
        return handed if handed is not None else self.store.fetch_staged(uid)

    def load_into_slot(self, uid: str) -> int:
        """Load a registered adapter into a slot now, with no request (a warm-up, the plan's read-ahead).

        The file read, if the host tier lost the adapter, happens here on the caller's thread; the
        slot copy runs on the engine thread between two steps, as a batch's own loads do, and counts
        as one load. Like a pin it takes an empty slot, else evicts an adapter that is neither in the
        running batch nor pinned. A uid that retiring has stopped is refused: warming weights no
        request may ask for would only evict adapters that serve traffic.
        """
        self._check_serving(uid)
        self.stage(uid)

        def load() -> int:
            self._check_serving(uid)  # retired while it was read: never load a dead uid into a slot
            return self.pool.load(uid)

        return self._at_step_boundary(load)

    def fetch_to_host(self, uid: str) -> None:
        """Bring a registered adapter into the host tier (a file read), so its slot load is a memory copy."""
        self.store.fetch(uid)

    def pin(self, name: str) -> int:
        uid = self._registered(name)
        return self._at_step_boundary(lambda: self.pool.pin(uid))

    def unpin(self, name: str) -> bool:
        uid = self._registered(name)
        return self._at_step_boundary(lambda: uid in self.pool.pinned and self.pool.unpin(uid))

    def keep(self, uids: Iterable[str]) -> None:
        """Evict these last (``LoRAMemoryPool.keep``): the placement plan's adapters on this replica."""
        self.pool.keep(uids)

    def _check_serving(self, uid: str) -> None:
        name = self.store.record(uid).name  # an unknown uid is AdapterNotFoundError
        if not self.serves(uid):
            raise AdapterUnregisteredError(f"adapter uid {uid!r} is retiring: {name!r} no longer serves it")

    def _stage_then_wake(self, uid: str) -> None:
        try:
            self.stage(uid)
        except LoRAFleetError as exc:  # unregistered meanwhile, or unreadable: its requests fail alone
            self._cancel(uid, exc)
        finally:
            with self._cond:
                self._staging.discard(uid)
            self._wake()

    # ------------------------------------------------------------------ reports

    def record(self, uid: str) -> AdapterRecord:
        """The adapter's one record (source, folder, rank, bytes, content version)."""
        return self.store.record(uid)

    def is_resident(self, uid: str) -> bool:
        return self.pool.is_resident(uid)

    def host_cached(self, uid: str) -> bool:
        return uid in self.store.host_cache

    def host_cached_uids(self) -> list[str]:
        return self.store.host_cache.uids()

    def host_tier_bytes(self) -> tuple[int, int]:
        cache = self.store.host_cache
        return cache.stats.bytes_used, cache.budget_bytes

    def pinned_uids(self) -> frozenset[str]:
        return frozenset(self.pool.pinned)

"""The adapters of one worker replica, kept to what its registry copy says: loads by uid, retirements, pins.

Why apart from the deployment (``deployments/worker.py``): bringing a registry entry into the
engine, retiring what the registry dropped or replaced, and keeping pins where the pin rule puts
them is one concern, shared by the request path, the warm start, a rollout's pre-warm and the
placement plan's read-ahead. A request reaches it with the uid the ingress resolved
(``GenerateRequest.resolved``): the engine says whether that uid is live, and only a uid it lacks
is looked up (by uid) to be loaded. Adapters are read in a thread, with one lock per uid, so loads
of unrelated adapters overlap and never stall the engine (Ray issue 65346).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Optional

from engine.engine import LoRAEngine
from engine.errors import AdapterUnregisteredError
from engine.request import AdapterRef, GenerateRequest
from pool.errors import AdapterNotFoundError, LoRAFleetError
from routing.load_timings import LoadTimings
from routing.pins import pin_holders

from .config import resolve_demo_source
from .content_version import SourceChangedError, check_unchanged
from .registry import RegistryEntry, RegistryFollower

log = logging.getLogger("ray.serve")
PIN_RETRY_INTERVAL_S = 1.0


class WorkerAdapters:
    def __init__(self, engine: LoRAEngine, registry: RegistryFollower, replica_id: str, drain_timeout_s: float):
        self.engine = engine
        self.registry = registry
        self.replica_id = replica_id
        self.drain_timeout_s = drain_timeout_s
        self.loading: set[str] = set()   # uids being read in (routers see them in the replica's state)
        self.load_timings = LoadTimings()
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._content: dict[str, Optional[str]] = {}  # uid -> content version registered (checked on a re-read)
        self._retiring: set[str] = set()
        self._prewarmed: set[str] = set()  # uids a rollout's pre-warm plan asked of this replica (started)
        self._warming: set[asyncio.Task] = set()
        self._refused_pins: set[str] = set()  # uids whose refused pin was logged (the pin loop retries each second)

    # ------------------------------------------------------------------ requests

    async def resolved(self, request: GenerateRequest) -> GenerateRequest:
        """The request with its adapter's uid: as the ingress resolved it, or, for a caller that reached the
        worker directly with a name only, resolved here (once, in this replica's registry copy)."""
        if request.adapter is None or request.resolved is not None:
            return request
        entry = await self._find(lambda: self.registry.entry(request.adapter))
        if entry is None:
            raise AdapterNotFoundError(f"adapter {request.adapter!r} is not registered")
        return dataclasses.replace(request, resolved=AdapterRef(entry.name, entry.uid))

    async def ensure_uid(self, ref: Optional[AdapterRef]) -> None:
        """Make ``ref``'s uid servable here. The engine checks the uid is live; one it lacks is looked up by uid
        (once per replica) and loaded; one the registry no longer has is refused (410)."""
        if ref is None:
            return
        if self.engine.serves(ref.uid):
            await self._restage(ref.uid)
            return
        entry = await self._find(lambda: self.registry.entry_of_uid(ref.uid))
        if entry is None:
            raise AdapterUnregisteredError(f"adapter {ref.name!r} (uid {ref.uid!r}) is no longer registered: it was "
                                           f"re-registered or unregistered after this request was resolved")
        await self.ensure_entry(entry)

    async def _find(self, lookup: Callable[[], Optional[RegistryEntry]]) -> Optional[RegistryEntry]:
        """``lookup`` in the registry copy, and once more after a refresh when it finds nothing (registered a
        moment ago: our long poll may not have seen it yet)."""
        entry = lookup()
        if entry is None and self.registry.directory is not None:
            await self.registry.refresh()
            entry = lookup()
        return entry

    async def ensure_entry(self, entry: RegistryEntry) -> None:
        """Register ``entry``'s uid in the engine unless it serves it already, and stage it (requests, warm-up,
        pins and the plan, which hold the entry already, come here)."""
        if not self.engine.serves(entry.uid):
            async with self._load_locks.setdefault(entry.uid, asyncio.Lock()):
                if not self.engine.serves(entry.uid):
                    await self._load(entry)
        await self._restage(entry.uid)

    async def prewarm(self, entry: RegistryEntry, into_slot: bool) -> None:
        """Bring a registered adapter into the host tier and, if asked, into a slot (between two engine
        steps, with no request: a warm-up must not queue behind traffic or count as one)."""
        await self.ensure_entry(entry)
        if into_slot:
            await asyncio.to_thread(self.engine.load_into_slot, entry.uid)

    async def _restage(self, uid: str) -> None:
        if not self.engine.is_resident(uid) and not self.engine.host_cached(uid):
            # evicted from the host tier too: re-read it here, off the engine thread, so the step
            # that loads it into a slot does a memory copy instead of a file read (of what was registered)
            await asyncio.to_thread(check_unchanged, self.engine.adapter_record(uid), self._content.get(uid))
            with self.load_timings.disk_read():
                await asyncio.to_thread(self.engine.fetch_to_host, uid)

    async def _load(self, entry: RegistryEntry) -> None:
        self.loading.add(entry.uid)
        try:
            source = await asyncio.to_thread(resolve_demo_source, entry.source)
            with self.load_timings.disk_read():
                record = await asyncio.to_thread(self.engine.register_adapter, entry.name, source,
                                                 revision=entry.revision, uid=entry.uid)
            try:
                await asyncio.to_thread(check_unchanged, record, entry.content)
            except SourceChangedError:
                await asyncio.to_thread(self.engine.unregister_uid, entry.uid, 0.0)  # never serve other weights
                raise
            current = self.registry.entries.get(entry.name)
            if current is None or current.uid != entry.uid:
                # retired while it was read: the retire found nothing here to unload, so nothing else will
                # unload it; undo the load and let the request re-pick its version
                await asyncio.to_thread(self.engine.unregister_uid, entry.uid, 0.0)
                raise AdapterUnregisteredError(f"adapter {entry.name!r} was retired while it loaded")
            self._content[entry.uid] = entry.content
        finally:
            self.loading.discard(entry.uid)

    # ------------------------------------------------------------------ registry changes

    async def registry_changed(self, old: dict[str, RegistryEntry], new: dict[str, RegistryEntry]) -> None:
        """Retire registrations removed or replaced (by uid, so a newer uid of the name is safe); warm what a
        rollout's plan asks of this replica; re-apply pins."""
        for entry in new.values():
            plan = (entry.prewarm or {}).get(self.replica_id)
            if plan is not None and entry.uid not in self._prewarmed:
                self._prewarmed.add(entry.uid)
                task = asyncio.get_running_loop().create_task(self._prewarm_planned(entry, plan == "slot"))
                self._warming.add(task)   # held until done (the loop keeps only weak references)
                task.add_done_callback(self._warming.discard)
        for name, entry in old.items():
            if (name not in new or new[name].uid != entry.uid) and entry.uid not in self._retiring:
                self._retiring.add(entry.uid)
                asyncio.get_running_loop().create_task(self._retire(entry.uid))
        await self.apply_pins()

    async def _prewarm_planned(self, entry: RegistryEntry, into_slot: bool) -> None:
        """A rollout's pre-warm plan names this replica (deployments/versions.py): warm it, best effort."""
        try:
            await self.prewarm(entry, into_slot)
        except Exception as exc:  # the PUT reports this replica as not warmed; traffic still loads it
            log.warning("lorafleet worker %s: pre-warm of %s failed (%r)", self.replica_id, entry.name, exc)
            self._prewarmed.discard(entry.uid)

    async def _retire(self, uid: str) -> None:
        try:
            await asyncio.to_thread(self.engine.unregister_uid, uid, self.drain_timeout_s)
        finally:
            self._retiring.discard(uid)
            self._prewarmed.discard(uid)
            self._load_locks.pop(uid, None)  # per-uid state goes with the uid
            self._content.pop(uid, None)

    # ------------------------------------------------------------------ pins

    async def pin_loop(self) -> None:
        """Pins are desired state: one that could not be applied (busy slots, a replica just added or
        removed) is tried again every PIN_RETRY_INTERVAL_S until it holds."""
        while True:
            await asyncio.sleep(PIN_RETRY_INTERVAL_S)
            if self._pins_differ():
                await self.apply_pins()

    def _pins_differ(self) -> bool:
        replicas = sorted(set(self.registry.replicas) | {self.replica_id})
        pinned = self.engine.pinned_uids()
        return any((entry.pinned and self.replica_id in pin_holders(name, replicas, entry.replicas))
                   != (entry.uid in pinned) for name, entry in self.registry.entries.items())

    async def apply_pins(self) -> None:
        """Pin each pinned adapter on its ``pin_holders`` (the rule ingress and view share); unpin elsewhere."""
        replicas = sorted(set(self.registry.replicas) | {self.replica_id})
        for name, entry in self.registry.entries.items():
            should_pin = entry.pinned and self.replica_id in pin_holders(name, replicas, entry.replicas)
            is_pinned = entry.uid in self.engine.pinned_uids()
            try:
                if should_pin and not is_pinned:
                    await self.ensure_entry(entry)
                    await asyncio.to_thread(self.engine.pin_adapter, name)
                elif is_pinned and not should_pin:
                    await asyncio.to_thread(self.engine.unpin_adapter, name)
            except LoRAFleetError as exc:  # a refused pin (starvation guard) must not break the sync loop
                if entry.uid not in self._refused_pins:  # logged once; the pin loop keeps retrying
                    self._refused_pins.add(entry.uid)
                    log.warning("lorafleet worker %s: pin of %s refused (kept trying each %.0f s): %r",
                                self.replica_id, name, PIN_RETRY_INTERVAL_S, exc)

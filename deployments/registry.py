"""Fleet adapter registry entries: name -> the uid minted at registration, source, pin policy."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from pool.errors import LoRAFleetError


class RegistryWriteError(LoRAFleetError):
    """The fleet's adapter registry could not be written durably; nothing changed."""


class RegistryConflictError(LoRAFleetError):
    """An admin write was based on a registry entry that changed meanwhile (409); nothing changed."""


@dataclass
class RegistryEntry:
    name: str
    uid: str
    source: str
    revision: Optional[str] = None
    pinned: bool = False
    replicas: int = 1  # how many replicas pin it (first in its rendezvous order)
    rank: Optional[int] = None
    created: float = field(default_factory=time.time)
    version: Optional[str] = None         # rollout label ("v2"); None: the name's first registration ("v1")
    version_of: Optional[str] = None      # the requested name this entry serves a version of (deployments/versions.py)
    traffic: Optional[int] = None         # percent of the name's requests; None: what the versions leave
    max_concurrency: Optional[int] = None  # per-name quota, the same on every entry of the name
    requests_per_s: Optional[float] = None
    generation: int = 0                   # bumped by the directory on every write (compare-and-set)
    retire_at: Optional[float] = None     # wall time a 0% version leaves the registry (deployments/versions.py)
    content: Optional[str] = None         # content version at registration (deployments/content_version.py)
    prewarm: Optional[dict] = None        # replica id -> "slot" | "host": workers named here warm it themselves

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RegistryEntry":
        return cls(**d)


class RegistryFollower:
    """Keeps a local copy of the directory's registry through its long poll.

    Used by workers (to load, retire and pin adapters) and by the ingress (for 404s and
    ``/v1/models`` without a round trip).
    """

    def __init__(self, directory, on_change=None, poll_timeout_s: float = 5.0):
        self.directory = directory
        self.on_change = on_change  # async callable(old entries, new entries)
        self.poll_timeout_s = poll_timeout_s
        self.entries: dict[str, RegistryEntry] = {}
        self.replicas: list[str] = []
        self.version = -1
        self.lookups = 0  # entries a request looked up here (``entry``, ``entry_of_uid``); tests count them
        self._poll = None  # the long poll in flight (a DeploymentResponse), for ``withdraw``

    def entry(self, name: str) -> Optional[RegistryEntry]:
        """A request's entry by name (a caller that reached a worker directly, with no uid); counted."""
        self.lookups += 1
        return self.entries.get(name)

    def entry_of_uid(self, uid: str) -> Optional[RegistryEntry]:
        """The entry registered under ``uid``, or None once its name was re-registered or unregistered.
        Read when a worker loads a uid it does not hold yet (once per uid); counted. A scan: no second
        table to keep true while admin calls drop entries in place."""
        self.lookups += 1
        return next((e for e in self.entries.values() if e.uid == uid), None)

    async def apply(self, reply: dict) -> None:
        old = self.entries
        self.entries = {e["name"]: RegistryEntry.from_dict(e) for e in reply["entries"]}
        self.replicas = list(reply["replicas"])
        self.version = reply["version"]
        if self.on_change is not None:
            await self.on_change(old, self.entries)

    async def refresh(self) -> None:
        await self.apply(await self.directory.get_registry.remote(-1, 0.0))

    async def merge(self, written: list[dict], removed: Optional[dict[str, str]] = None) -> None:
        """Apply this replica's own acknowledged write (the entries ``write_entries`` returned; the names it
        removed, each with the uid it removed) to the copy at once, without a round trip: a rollout's traffic
        change must read its own write without a second directory call. The long poll may already have
        brought something newer (another ingress's later write): an entry is kept where the copy holds its
        uid at a higher generation or holds another uid (a re-registration), a removed name goes only while
        the copy still holds the uid that was removed. A new dict, as ``apply`` makes: readers detect a
        change by identity."""
        old = self.entries
        removed = removed or {}
        entries = {n: e for n, e in old.items() if removed.get(n) != e.uid}
        for d in written:
            held = entries.get(d["name"])
            if held is None or (held.uid == d["uid"] and held.generation <= d["generation"]):
                entries[d["name"]] = RegistryEntry.from_dict(d)
        self.entries = entries
        if self.on_change is not None:
            await self.on_change(old, self.entries)

    def withdraw(self) -> None:
        """Cancel the long poll in flight; the owner cancels ``run``'s task too, on its graceful stop. The
        directory counts the poll as an ongoing request and Serve stops it only once none is left: cancelling
        the task alone leaves the call running there for up to ``poll_timeout_s``, keeping a deleted app's
        directory draining for a caller that is gone."""
        poll, self._poll = self._poll, None
        if poll is not None:
            poll.cancel()

    async def run(self) -> None:
        import asyncio
        import logging

        while True:
            try:
                self._poll = self.directory.get_registry.remote(self.version, self.poll_timeout_s)
                reply = await self._poll
                self._poll = None
                await self.apply(reply)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the directory restarts: poll from scratch once it is back
                logging.getLogger("ray.serve").warning("lorafleet: registry poll failed (%r)", exc)
                self.version = -1
                await asyncio.sleep(0.5)

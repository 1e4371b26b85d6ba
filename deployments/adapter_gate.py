"""What the ingress does with a request's adapter name before any worker sees it.

In order: find the name (registry, then the resolvers for a name never seen), take the
name's quota, and draw the version that serves it. The request then carries the version's
registry name; the response keeps the requested name as ``model`` and names the version
in the ``x-lorafleet-adapter-version`` header.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from engine.errors import AdapterExistsError
from pool.errors import AdapterNotFoundError

from .quotas import AdapterQuotas
from .resolvers import AdapterResolver
from .traffic_split import families, label_of, pick, quota_of
from .versions import VersionedFleetAdmin

VERSION_HEADER = "x-lorafleet-adapter-version"


def _noop() -> None:
    return None


@dataclass
class Admission:
    adapter: Optional[str] = None              # the registry entry that serves it (None: the base model)
    version: Optional[str] = None              # its version label
    release: Callable[[], None] = field(default=_noop)   # frees the quota place; call once the request ends

    def headers(self) -> dict[str, str]:
        return {VERSION_HEADER: self.version} if self.version else {}


class AdapterGate:
    def __init__(self, admin: VersionedFleetAdmin, quotas: AdapterQuotas, resolver: Optional[AdapterResolver] = None,
                 rng: Optional[random.Random] = None):
        self.admin = admin
        self.quotas = quotas
        self.resolver = resolver
        self.rng = rng or random.Random()
        self._families: dict[str, list] = {}
        self._families_of: Optional[dict] = None   # held, so its id cannot be reused by a newer dict
        self._families_len = 0

    def family(self, name: str) -> list:
        entries = self.admin.registry.entries
        # the follower replaces the dict on every change; admin calls pop from it in place
        if entries is not self._families_of or len(entries) != self._families_len:
            self._families = families(entries.values())
            self._families_of, self._families_len = entries, len(entries)
        return self._families.get(name, [])

    async def admit(self, name: Optional[str]) -> Admission:
        """404/429 before any work, else the entry to serve and the quota place to release."""
        if name is None:
            return Admission()
        family = self.family(name)
        if not family:
            family = await self._find(name)
        release = self.quotas.acquire(name, *quota_of(family))
        try:
            entry = pick(family, self.rng)
        except BaseException:
            release()
            raise
        return Admission(entry.name, label_of(entry), release)

    async def _find(self, name: str) -> list:
        try:
            await self.admin.check_registered(name)
        except AdapterNotFoundError:
            if not self.family(name):  # (re-read: a name served only by versions has no entry of its own)
                if self.resolver is None:
                    raise
                try:
                    await self.resolver.resolve(name)
                except AdapterExistsError:
                    pass   # registered by someone else meanwhile
                await self.admin.registry.refresh()
        family = self.family(name)
        if not family:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return family


def build_gate(admin: VersionedFleetAdmin, args, ingress_replicas: int) -> AdapterGate:
    """The gate an ingress replica runs, from its app args (resolvers only when configured)."""
    resolver = None
    if args.adapter_resolvers:
        resolver = AdapterResolver(args.adapter_resolvers, admin.register, args.adapter_resolver_negative_ttl_s)
    return AdapterGate(admin, AdapterQuotas(ingress_replicas), resolver)

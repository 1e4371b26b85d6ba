"""What the ingress does with a request's adapter name before any worker sees it.

In order: find the name (registry, then the resolvers for a name never seen), take the
name's quota, and draw the version that serves it. This is the only place a request's name
is looked up: the request then carries the drawn entry's name and uid (``AdapterRef``), and
the worker and engine serve that uid or refuse it. The response keeps the requested name as
``model`` and names the version in the ``x-lorafleet-adapter-version`` header.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from engine.errors import AdapterExistsError
from engine.request import AdapterRef
from pool.errors import AdapterNotFoundError

from .config import NAME_RE
from .fleet_admin import not_registered
from .quotas import GIVE_BACK_WAIT_S, AdapterQuotas, HandleCalls
from .replica_share import serve_placement
from .resolvers import RESOLVER_BUSY, AdapterResolver, LookupLimiter, shown
from .traffic_split import families, label_of, pick, quota_of
from .versions import VersionedFleetAdmin

VERSION_HEADER = "x-lorafleet-adapter-version"
log = logging.getLogger("ray.serve")


@dataclass
class Admission:
    ref: Optional[AdapterRef] = None           # the registry entry that serves it, and its uid (None: base model)
    version: Optional[str] = None              # its version label
    requested: Optional[str] = None            # the name the client asked for
    _releases: list = field(default_factory=list)   # quota place, ingress place: freed once, by release()
    _returning: list = field(default_factory=list)  # quota leases on their way back to their owner

    def also_release(self, release: Callable[[], Optional[Awaitable[None]]]) -> None:
        self._releases.append(release)

    def release(self) -> None:
        """Give back every place this request holds (idempotent); call once the request ends."""
        while self._releases:
            returning = self._releases.pop()()
            if inspect.isawaitable(returning):
                self._returning.append(returning)

    async def finish(self) -> None:
        """``release``, then wait (bounded) until quota leases are back with their owner: a request that
        ended must not hold its place while the client's next request, on any ingress replica, asks for it."""
        self.release()
        returning, self._returning = self._returning, []
        if returning:
            try:
                await asyncio.wait_for(asyncio.gather(*returning, return_exceptions=True), GIVE_BACK_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("lorafleet quotas: a lease was not back within %ss", GIVE_BACK_WAIT_S)

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
        self.lookups = 0   # names looked up in the registry copy (one per request; tests count them)
        self.early_refusals = 0   # requests refusal_now answered (the model guard's; tests and benchmarks read it)
        self.guard_asked = 0   # requests refusal_now was asked about: one the proxy's edge guard answered never is

    def family(self, name: str) -> list:
        """The registry entries serving ``name`` (its versions): the one name look-up of a request."""
        self.lookups += 1
        return self._current_families().get(name, [])

    def known_names(self) -> dict[str, list]:
        """The registry copy's requested names (keys; their families as values), read without counting a lookup."""
        return self._current_families()

    def _current_families(self) -> dict[str, list]:
        entries = self.admin.registry.entries
        # the follower replaces the dict on every change; admin calls pop from it in place
        if entries is not self._families_of or len(entries) != self._families_len:
            self._families = families(entries.values())
            self._families_of, self._families_len = entries, len(entries)
        return self._families

    def refusal_now(self, name: object) -> Optional[BaseException]:
        refusal = self._refusal_now(name)
        self.guard_asked += 1
        self.early_refusals += refusal is not None
        if getattr(refusal, "code", None) == RESOLVER_BUSY:
            self.resolver.limiter.refused += 1
        return refusal

    def _refusal_now(self, name: object) -> Optional[BaseException]:
        """The error ``admit`` would raise for ``name`` if it can be told from cached state alone, else None.

        No await and no lookup: the ingress's model guard (model_guard.py) asks before FastAPI parses the
        request, so a flood of bogus names costs the ingress as little as it can. It mirrors ``_find`` step by
        step and answers only where ``_find`` would not refresh the registry copy nor look anything up: a name
        no registration can have, and (while no registry refresh is due) one the copy lacks and the resolvers'
        negative cache holds, or whose lookup the rate limit would refuse. A known name is never refused here."""
        if not isinstance(name, str) or name in self._current_families():
            return None
        if not NAME_RE.fullmatch(name):
            return AdapterNotFoundError(f"adapter {shown(name)} is not registered")
        if name in self.admin.registry.entries or self.admin.refresh_due():
            return None
        if self.resolver is None:
            return not_registered(name)
        miss = self.resolver.known_miss(name)
        if miss is not None:
            return miss
        limiter = self.resolver.limiter
        if limiter is not None and not self.resolver.looking_up(name) and limiter.would_refuse():
            return limiter.busy()
        return None

    def rate_refusal_ends_in_s(self, name: object) -> float:
        """Seconds until the lookup rate lets ``name``'s lookup start, when the rate's 429 is what ``refusal_now``
        would answer now and the rate alone refuses; else 0 (no refusal, another one, or the concurrency limit
        refuses too). Counts nothing: the model guard asks it before ``refusal_now``."""
        limiter = self.resolver.limiter if self.resolver is not None else None
        if limiter is None or getattr(self._refusal_now(name), "code", None) != RESOLVER_BUSY:
            return 0.0
        return limiter.rate_alone_refuses_for_s()

    async def admit(self, name: Optional[str]) -> Admission:
        """404/429 before any work, else the entry to serve and the quota place to release."""
        if name is None:
            return Admission()
        family = self.family(name)
        if not family:
            family = await self._find(name)
        admission = Admission(requested=name)
        admission.also_release(await self.quotas.acquire(name, *quota_of(family)))
        try:
            entry = pick(family, self.rng)
        except BaseException:
            admission.release()
            raise
        admission.ref, admission.version = AdapterRef(entry.name, entry.uid), label_of(entry)
        return admission

    async def repick(self, admission: Admission) -> bool:
        """The drawn version was retired meanwhile: draw again from the name's current family.
        False when there is nothing else to draw (the base model, or the same entry again)."""
        if admission.requested is None:
            return False
        await self.admin.refresh_after_miss()
        family = [e for e in self.family(admission.requested) if e.name != admission.ref.name]
        try:
            entry = pick(family, self.rng) if family else None
        except AdapterNotFoundError:
            entry = None
        if entry is None:
            return False
        admission.ref, admission.version = AdapterRef(entry.name, entry.uid), label_of(entry)
        return True

    async def _find(self, name: str) -> list:
        if not NAME_RE.fullmatch(name):   # no registration or resolver can have it: no lookup, no refresh
            raise AdapterNotFoundError(f"adapter {shown(name)} is not registered")
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
            raise AdapterNotFoundError(f"adapter {shown(name)} is not registered")
        return family


def build_gate(admin: VersionedFleetAdmin, args, quota_leases) -> AdapterGate:
    """The gate an ingress replica runs, from its app args (resolvers only when configured) and the handle
    of the application's ``QuotaLeases`` (the owner of every quota count)."""
    resolver = None
    if args.adapter_resolvers:
        limiter = LookupLimiter(args.adapter_resolver_lookups_per_s, args.adapter_resolver_max_concurrent_lookups,
                                serve_placement)

        async def register(spec):   # resolver-made entries expire (and are found again if still wanted)
            return await admin.register(spec, expires_after_s=args.adapter_resolver_entry_ttl_s, missing_ok=True)

        resolver = AdapterResolver(args.adapter_resolvers, register, args.adapter_resolver_negative_ttl_s,
                                   limiter=limiter)
    quotas = AdapterQuotas(HandleCalls(quota_leases), heartbeat_s=args.quota_lease_heartbeat_s)
    return AdapterGate(admin, quotas, resolver)

"""Resolve on first request: an unregistered name is looked for under ``adapter_resolvers``.

For name ``x`` each root proposes ``root/x`` (pool.sources.resolver_roots), tried in
order through the same registration path as the admin API (validated on a worker,
published fleet-wide under a fresh uid). The first that validates wins. Concurrent first
requests for one name share a single attempt.

The path is open to anyone who can send a request, so every part of it is bounded: a
name that is no valid adapter name is refused before any lookup or memory is spent on it;
a miss is remembered for ``negative_ttl_s`` in an LRU of at most ``max_misses`` names, and
each request gets a fresh error (never one shared object whose traceback would keep every
request that raised it); lookups are limited to ``lookups_per_s`` and ``max_concurrent``
(the fleet's figures, split over the ingress replicas so the parts sum to them), past
which a request gets a 429 instead of a lookup. The rate is there to pace names that lead
nowhere: a lookup that finds its adapter gives its token back, so registering real adapters
on first request is never refused because an earlier real one just took the token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Awaitable, Callable, Optional, Sequence

from pydantic import ValidationError

from engine.errors import AdapterExistsError
from pool.errors import AdapterError, AdapterNotFoundError, LoRAFleetError, SourceNotAllowedError
from pool.sources import candidate_source

from .config import NAME_RE, AdapterSpec
from .http_errors import HTTPError, unwrap
from .replica_share import replica_share

log = logging.getLogger("ray.serve")
SHOWN_NAME_CHARS = 80
RESOLVER_BUSY = "resolver_busy"   # the code of the lookup limit's 429 (``LookupLimiter.busy``)


def shown(name: str) -> str:
    """A name as error messages quote it: a hostile 1 MiB name must not come back 1 MiB long."""
    return repr(name) if len(name) <= SHOWN_NAME_CHARS else f"{name[:SHOWN_NAME_CHARS]!r}... ({len(name)} chars)"


def not_registered(name: str) -> AdapterNotFoundError:
    return AdapterNotFoundError(f"adapter {shown(name)} is not registered and no adapter resolver holds it")


def fresh(cls: type, message: str) -> BaseException:
    """A new error of ``cls`` with ``message`` (whatever its ``__init__`` takes), with no traceback yet."""
    error = Exception.__new__(cls)
    Exception.__init__(error, message)
    return error


class LookupLimiter:
    """This ingress replica's part of the fleet's lookup rate and concurrency."""

    def __init__(self, lookups_per_s: float, max_concurrent: int, placement: Callable[[], tuple[int, Optional[int]]],
                 clock: Callable[[], float] = time.monotonic):
        self.lookups_per_s, self.max_concurrent = lookups_per_s, max_concurrent
        self.placement, self.clock = placement, clock
        self.running = 0
        self._tokens: Optional[float] = None
        self._updated = clock()
        self.refused = 0

    def _refill(self) -> float:
        """Tokens now (a burst of one: lookups are paced evenly, so no window of a flood sees more than the
        rate; a bucket of a second's worth let a flood's first second double it: 5.03/s measured against 5)."""
        replicas, _ = self.placement()
        rate = self.lookups_per_s / replicas
        now = self.clock()
        tokens = 1.0 if self._tokens is None else min(1.0, self._tokens + (now - self._updated) * rate)
        self._tokens, self._updated = tokens, now
        return tokens

    def would_refuse(self) -> bool:
        """Whether ``take`` would refuse now; takes nothing (the ingress's model guard asks before any await)."""
        replicas, rank = self.placement()
        return self.running >= replica_share(self.max_concurrent, replicas, rank) or self._refill() < 1.0

    def refusing_for_s(self) -> float:
        """Seconds from now during which ``take`` will refuse unless a running lookup finds its adapter (0: none).

        Only the rate can say so: the concurrency limit ends whenever a lookup does. A lookup that finds its
        adapter gives its token back, but only after it registered the adapter, a registry write: the edge
        guard in Serve's proxy, which answers for this replica that long, ends its window on any registry
        change it sees (edge_guard.py)."""
        tokens = self._refill()
        if tokens >= 1.0:
            return 0.0
        replicas, _ = self.placement()
        return (1.0 - tokens) * replicas / self.lookups_per_s

    def rate_alone_refuses_for_s(self) -> float:
        """``refusing_for_s`` when the rate is all that refuses a lookup now; 0 when the concurrency limit is
        reached too (it ends whenever a lookup does, a time nobody can state) or nothing refuses."""
        replicas, rank = self.placement()
        if self.running >= replica_share(self.max_concurrent, replicas, rank):
            return 0.0
        return self.refusing_for_s()

    @staticmethod
    def busy() -> HTTPError:
        return HTTPError(429, "adapter resolver lookups are at their limit; retry later",
                         param="model", code=RESOLVER_BUSY, retry_after=1)

    def take(self) -> None:
        """One lookup may start now, or a 429 (nothing is remembered of the name)."""
        if self.would_refuse():
            self.refused += 1
            raise self.busy()
        self._tokens -= 1.0
        self.running += 1

    def done(self, found: bool = False) -> None:
        """A lookup ended; one that ``found`` its adapter gives its token back: the rate paces misses."""
        self.running -= 1
        if found:
            self._tokens = min(1.0, self._refill() + 1.0)


class AdapterResolver:
    def __init__(self, roots: Sequence[str], register: Callable[[AdapterSpec], Awaitable[dict]],
                 negative_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 limiter: Optional[LookupLimiter] = None, max_misses: int = 4096):
        self.roots = list(roots)
        self.register = register
        self.negative_ttl_s = negative_ttl_s
        self.clock = clock
        self.limiter = limiter
        self.max_misses = max_misses
        # name -> (expiry, error class, message): the error is made afresh for each request
        self.misses: OrderedDict[str, tuple[float, type, str]] = OrderedDict()
        self._attempts: dict[str, asyncio.Future] = {}
        self.resolved = 0
        self.lookups = 0

    async def resolve(self, name: str) -> dict:
        """Register ``name`` from the first root that holds a valid adapter, or raise why none did."""
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise not_registered(name)   # no root can hold it: nothing looked up, nothing remembered
        miss = self.known_miss(name)
        if miss is not None:
            raise miss
        self.misses.pop(name, None)   # absent, or expired
        attempt = self._attempts.get(name)
        if attempt is None:
            if self.limiter is not None:
                self.limiter.take()
            attempt = self._attempts[name] = asyncio.ensure_future(self._try_roots(name))
            attempt.add_done_callback(lambda done: self._finished(name, done))
        return await asyncio.shield(attempt)

    def known_miss(self, name: str) -> Optional[BaseException]:
        """The error ``resolve`` would raise now from the negative cache alone, or None (no await, no lookup)."""
        miss = self.misses.get(name)
        if miss is None:
            return None
        expiry, cls, message = miss
        if self.clock() >= expiry:
            return None
        self.misses.move_to_end(name)
        return fresh(cls, message)

    def miss_remaining_s(self, name: str) -> float:
        """Seconds the negative cache still holds ``name`` (0: not held); read without touching its LRU order."""
        miss = self.misses.get(name)
        return max(0.0, miss[0] - self.clock()) if miss is not None else 0.0

    def looking_up(self, name: str) -> bool:
        return name in self._attempts

    def _finished(self, name: str, attempt: asyncio.Future) -> None:
        self._attempts.pop(name, None)
        if self.limiter is not None:   # found: registered here, or by someone else meanwhile
            found = not attempt.cancelled() and isinstance(attempt.exception(), (type(None), AdapterExistsError))
            self.limiter.done(found)

    def _remember_miss(self, name: str, error: LoRAFleetError) -> None:
        self.misses[name] = (self.clock() + self.negative_ttl_s, type(error), str(error))
        self.misses.move_to_end(name)
        while len(self.misses) > self.max_misses:
            self.misses.popitem(last=False)

    async def _try_roots(self, name: str) -> dict:
        self.lookups += 1
        refusal: Optional[LoRAFleetError] = None
        for root in self.roots:
            try:
                spec = AdapterSpec(name=name, source=candidate_source(root, name))
            except ValidationError:
                break  # not a valid adapter name: no root can hold it
            try:
                entry = await self.register(spec)
            except AdapterExistsError:
                raise  # registered from elsewhere meanwhile; the caller re-reads the registry
            except SourceNotAllowedError as exc:
                log.warning("lorafleet resolver: %s is outside the allow-lists (%s)", spec.source, exc)
                continue
            except AdapterNotFoundError:
                continue
            except AdapterError as exc:  # it exists there but is not a servable adapter
                refusal = refusal or exc
                continue
            self.resolved += 1
            return entry
        error = unwrap(refusal) if refusal is not None else not_registered(name)
        self._remember_miss(name, error)
        raise fresh(type(error), str(error))

"""Resolve on first request: an unregistered name is looked for under ``adapter_resolvers``.

For name ``x`` each root proposes ``root/x`` (pool.sources.resolver_roots), tried in
order through the same registration path as the admin API (validated on a worker,
published fleet-wide under a fresh uid). The first that validates wins. Concurrent first
requests for one name share a single attempt, and a miss is remembered for
``negative_ttl_s`` so a stream of bogus names costs the workers one lookup per name per TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional, Sequence

from pydantic import ValidationError

from engine.errors import AdapterExistsError
from pool.errors import AdapterError, AdapterNotFoundError, LoRAFleetError, SourceNotAllowedError
from pool.sources import candidate_source

from .config import AdapterSpec

log = logging.getLogger("ray.serve")


class AdapterResolver:
    def __init__(self, roots: Sequence[str], register: Callable[[AdapterSpec], Awaitable[dict]],
                 negative_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.roots = list(roots)
        self.register = register
        self.negative_ttl_s = negative_ttl_s
        self.clock = clock
        self.misses: dict[str, tuple[float, LoRAFleetError]] = {}   # name -> (expiry, what to raise)
        self._attempts: dict[str, asyncio.Future] = {}
        self.resolved = 0
        self.lookups = 0

    async def resolve(self, name: str) -> dict:
        """Register ``name`` from the first root that holds a valid adapter, or raise why none did."""
        miss = self.misses.get(name)
        if miss is not None:
            if self.clock() < miss[0]:
                raise miss[1]
            del self.misses[name]
        attempt = self._attempts.get(name)
        if attempt is None:
            attempt = self._attempts[name] = asyncio.ensure_future(self._try_roots(name))
            attempt.add_done_callback(lambda _: self._attempts.pop(name, None))
        return await asyncio.shield(attempt)

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
        error = refusal or AdapterNotFoundError(
            f"adapter {name!r} is not registered and no adapter resolver holds it")
        self.misses[name] = (self.clock() + self.negative_ttl_s, error)
        raise error

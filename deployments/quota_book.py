"""The one owner of every adapter's quota count: leases held per ingress replica, and rate tokens.

Why one owner: a fleet-wide limit split into per-replica shares refuses requests the fleet has
room for (Serve's proxy spreads requests over ingress replicas, so one replica's share can be
spent while another's is idle). Here a request is refused only when admitting it would put the
fleet over the limit: the book counts every lease handed out, whoever holds it.

Round trips stay cheap while the limit is far: a grant then carries spare leases (and rate
tokens) that the ingress uses without asking again. Near the limit a grant is one lease, and
spares go back at once (the holder's next heartbeat names the names that are near), so a spare
held at one ingress never refuses a request at another: a grant that finds nothing free while
spares may be out is answered after they come back (``may_have_spares``), not refused.

A holder (one ingress replica) that stops calling for ``ttl_s`` is taken for dead and its leases
return (``expire``). A holder the book does not know (it expired, or the book restarted) is
re-adopted from what its heartbeat reports it holds. This module is pure (no Ray, no clock of its
own): the Serve deployment in ``quota_lease_actor.py`` runs it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

NAMES_BEFORE_SWEEP = 1024   # past this many names, refilled buckets that nothing holds are dropped
CONCURRENCY = "max_concurrency"
RATE = "requests_per_s"


@dataclass
class LeaseGrant:
    """The answer to one ask: leases and rate tokens for one request, plus spares to cache."""

    granted: bool
    refused: Optional[str] = None   # which quota refused (CONCURRENCY or RATE) when not granted
    spare_leases: int = 0           # concurrency leases beyond this request's, held at the ingress
    spare_tokens: int = 0           # rate tokens beyond this request's
    near: bool = True               # near the limit: the ingress must give back what it does not use


@dataclass
class HeldReport:
    """What one ingress replica holds of one name (sent with each heartbeat)."""

    leases: int = 0        # concurrency leases held (in use plus spare)
    spare_leases: int = 0  # of those, the ones no request uses now
    spare_tokens: int = 0  # rate tokens held and not used yet


@dataclass
class Reclaimed:
    """Leases taken back from a holder that stopped calling (an event the actor keeps a few of)."""

    holder: str
    leases: int
    silent_for_s: float    # time from its last call to the reclaim (at most ttl_s plus one sweep)


@dataclass
class _Bucket:
    tokens: float
    updated: float
    rate: float


@dataclass
class _Name:
    held: Counter = field(default_factory=Counter)         # holder -> concurrency leases
    spare_out: Counter = field(default_factory=Counter)    # holder -> leases/tokens it may hold unused
    bucket: Optional[_Bucket] = None
    max_concurrency: Optional[int] = None                  # the limit of the latest ask

    def idle(self) -> bool:
        return not self.held and not self.spare_out and self.bucket is None


class QuotaBook:
    def __init__(self, batch: int = 8, ttl_s: float = 5.0):
        if batch < 1 or ttl_s <= 0:
            raise ValueError(f"quota book needs batch >= 1 and ttl_s > 0 (got {batch}, {ttl_s})")
        self.batch, self.ttl_s = batch, ttl_s
        self.names: dict[str, _Name] = {}
        self.seen: dict[str, float] = {}   # holder -> its last call (monotonic seconds)
        self.spare_names: dict[str, set[str]] = {}   # holder -> names it may hold spares of
        self.grants = self.refusals = 0
        self._sweep_at = NAMES_BEFORE_SWEEP

    # ------------------------------------------------------------------ asks

    def grant(self, holder: str, name: str, max_concurrency: Optional[int], requests_per_s: Optional[float],
              now: float) -> LeaseGrant:
        """One lease and one rate token for one request of ``name`` if the fleet has room for both, and spares
        to cache while the limits are far. Nothing is taken when either is refused."""
        self.touch(holder, now)
        if name not in self.names and len(self.names) >= self._sweep_at:
            self._sweep_idle(now)
        entry = self.names.setdefault(name, _Name())
        holders = max(1, len(self.seen))
        entry.max_concurrency = max_concurrency
        near = False
        spare_leases = spare_tokens = 0
        if max_concurrency is not None:
            free = max_concurrency - sum(entry.held.values())
            if free < 1:
                return self._refuse(name, entry, CONCURRENCY)
            spare_leases = self._spare(free, holders)
            near = near or spare_leases == 0
        if requests_per_s is not None:
            bucket = self._refill(entry, requests_per_s, now)
            if bucket.tokens < 1.0:
                return self._refuse(name, entry, RATE)
            spare_tokens = self._spare(int(bucket.tokens), holders)
            near = near or spare_tokens == 0
            bucket.tokens -= 1 + spare_tokens
        if max_concurrency is not None:
            entry.held[holder] += 1 + spare_leases
        if spare_leases or spare_tokens:
            entry.spare_out[holder] += spare_leases + spare_tokens
            self.spare_names.setdefault(holder, set()).add(name)
        self.grants += 1
        return LeaseGrant(True, None, spare_leases, spare_tokens, near)

    def give_back(self, holder: str, name: str, leases: int, tokens: int, spares_left: int, now: float) -> None:
        """Leases a request no longer holds (or spares), and unused rate tokens, back to the fleet;
        ``spares_left``: what the holder still holds unused of ``name`` afterwards."""
        if leases < 0 or tokens < 0 or spares_left < 0:
            raise ValueError(f"cannot give back a negative count (leases {leases}, tokens {tokens}, "
                             f"spares left {spares_left})")
        self.touch(holder, now)
        entry = self.names.get(name)
        if entry is None:
            return
        if leases:
            left = entry.held[holder] - leases
            if left > 0:
                entry.held[holder] = left
            else:
                entry.held.pop(holder, None)
        if tokens and entry.bucket is not None:
            bucket = self._refill(entry, entry.bucket.rate, now)
            bucket.tokens = min(max(1.0, bucket.rate), bucket.tokens + tokens)
        if spares_left:
            entry.spare_out[holder] = spares_left
        else:
            entry.spare_out.pop(holder, None)
        self._forget_if_idle(name, entry, now)

    def heartbeat(self, holder: str, held: dict[str, HeldReport], now: float) -> list[str]:
        """A holder's report; returns the names whose spares it must give back (they are near their limit).
        An unknown holder (expired, or the book restarted) is re-adopted from ``held``."""
        if holder not in self.seen:
            for name, report in held.items():
                if report.leases > 0:
                    self.names.setdefault(name, _Name()).held[holder] = report.leases
        self.touch(holder, now)
        recall = []
        reported = {name for name, report in held.items() if report.spare_tokens > 0 or report.leases > 0}
        for name in self.spare_names.pop(holder, set()) | reported:
            entry = self.names.get(name)
            report = held.get(name)
            spare = 0 if report is None else report.spare_tokens + report.spare_leases
            if entry is None:
                continue
            if spare <= 0:
                entry.spare_out.pop(holder, None)
                self._forget_if_idle(name, entry, now)
                continue
            entry.spare_out[holder] = spare
            self.spare_names.setdefault(holder, set()).add(name)
            if self._near(entry, now):
                recall.append(name)
        return recall

    def _near(self, entry: _Name, now: float) -> bool:
        """Whether a grant now would carry no spares (then spares held elsewhere must come back)."""
        holders = max(1, len(self.seen))
        if entry.max_concurrency is not None:
            if self._spare(entry.max_concurrency - sum(entry.held.values()), holders) == 0:
                return True
        if entry.bucket is not None:
            bucket = self._refill(entry, entry.bucket.rate, now)
            if self._spare(int(bucket.tokens), holders) == 0:
                return True
        return False

    def may_have_spares(self, name: str, asker: str) -> bool:
        """Whether another holder may hold unused leases or tokens of ``name`` (a refusal would then be false)."""
        entry = self.names.get(name)
        return entry is not None and any(h != asker and n > 0 for h, n in entry.spare_out.items())

    # ------------------------------------------------------------------ liveness

    def touch(self, holder: str, now: float) -> None:
        self.seen[holder] = now

    def expire(self, now: float) -> list[Reclaimed]:
        """Take back everything held by holders silent for ``ttl_s`` (a dead ingress replica); returns those
        that held leases (a holder that held nothing is just forgotten)."""
        dead = [h for h, last in self.seen.items() if now - last >= self.ttl_s]
        reclaimed = []
        for holder in dead:
            last = self.seen.pop(holder)
            self.spare_names.pop(holder, None)
            leases = 0
            for name, entry in list(self.names.items()):
                leases += entry.held.pop(holder, 0)
                entry.spare_out.pop(holder, None)
                self._forget_if_idle(name, entry, now)
            if leases:
                reclaimed.append(Reclaimed(holder, leases, now - last))
        return reclaimed

    def held(self, name: str) -> int:
        entry = self.names.get(name)
        return sum(entry.held.values()) if entry else 0

    # ------------------------------------------------------------------ internals

    def _spare(self, free: int, holders: int) -> int:
        """Spares one grant may carry: none unless, after it, half of what is free stays with the book
        for every holder's next ask (far from the limit)."""
        return max(0, min(self.batch - 1, (free - 1) // (2 * holders)))

    def _refill(self, entry: _Name, rate: float, now: float) -> _Bucket:
        capacity = max(1.0, rate)   # one second of the rate (at least one request)
        bucket = entry.bucket
        if bucket is None or bucket.rate != rate:
            bucket = entry.bucket = _Bucket(capacity if bucket is None else min(capacity, bucket.tokens), now, rate)
        bucket.tokens = min(capacity, bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        return bucket

    def _refuse(self, name: str, entry: _Name, quota: str) -> LeaseGrant:
        self.refusals += 1
        self._forget_if_idle(name, entry, None)
        return LeaseGrant(False, quota)

    def _sweep_idle(self, now: float) -> None:
        """Drop every name that holds nothing and whose bucket has refilled; the next sweep waits until the
        map doubles, so the cost per grant stays constant."""
        for name, entry in list(self.names.items()):
            self._forget_if_idle(name, entry, now)
        self._sweep_at = max(NAMES_BEFORE_SWEEP, 2 * len(self.names))

    def _forget_if_idle(self, name: str, entry: _Name, now: Optional[float]) -> None:
        """A full bucket with nothing held is the same as no entry: drop it, so the map stays as small as
        the names in use."""
        bucket = entry.bucket
        if bucket is not None and now is not None:
            capacity = max(1.0, bucket.rate)
            if bucket.tokens + (now - bucket.updated) * bucket.rate >= capacity:
                entry.bucket = None
        if entry.idle():
            self.names.pop(name, None)

"""Per-adapter quotas at the ingress: concurrent requests and requests per second.

Quotas are fleet-wide limits: each ingress replica enforces its part, and the parts sum to
the limit exactly (``replica_share``: the first ``limit % replicas`` ranks get one more, so
``max_concurrency: 1`` over 2 replicas admits 1 on rank 0 and none on rank 1); the rate is
a token bucket holding one second of its part. The replica count and rank are read on every
request from Serve's replica context, so a resized or re-ranked ingress follows at once.
A refusal is a 429 that names the adapter and the quota, and counts in
``lorafleet_adapter_quota_rejections_total``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from .http_errors import HTTPError


MAX_IDLE_BUCKETS = 1024  # past this many rate buckets, refilled ones are dropped


@dataclass
class _Bucket:
    tokens: float
    updated: float
    full_at: float = 0.0   # when it will have refilled (then it is the same as no bucket)


@dataclass
class QuotaState:
    inflight: Counter = field(default_factory=Counter)
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    rejections: Counter = field(default_factory=Counter)   # (adapter, quota) -> count
    peak_inflight: Counter = field(default_factory=Counter)  # adapter -> most requests held at once here


def replica_share(limit: int, replicas: int, rank: Optional[int]) -> int:
    """This replica's part of a fleet-wide whole-number limit; the parts of ranks 0..replicas-1 sum to it.
    An unknown or out-of-range rank takes the smallest part, so the fleet never admits more than ``limit``."""
    base, extra = divmod(limit, max(1, replicas))
    return base + 1 if rank is not None and 0 <= rank < extra else base


def serve_placement() -> tuple[int, Optional[int]]:
    """(replicas of this deployment, this replica's rank) from Serve, read now (both change live)."""
    from ray import serve

    context = serve.get_replica_context()
    rank = getattr(context.rank, "rank", context.rank)
    return max(1, context.world_size or 1), rank if isinstance(rank, int) else None


class AdapterQuotas:
    def __init__(self, placement: Callable[[], tuple[int, Optional[int]]] = lambda: (1, 0),
                 clock: Callable[[], float] = time.monotonic, metrics: bool = True):
        self.placement = placement
        self.clock = clock
        self.state = QuotaState()
        self._counter = None
        if metrics:
            from ray.serve.metrics import Counter as RayCounter

            self._counter = RayCounter("lorafleet_adapter_quota_rejections_total",
                                       description="Requests refused by an adapter's quota (429)",
                                       tag_keys=("adapter", "quota"))

    def acquire(self, name: str, max_concurrency: Optional[int], requests_per_s: Optional[float]) -> Callable[[], None]:
        """Admit one request for ``name`` or raise a 429; returns the release to call when it ends."""
        if max_concurrency is None and requests_per_s is None:
            return _noop
        state = self.state
        replicas, rank = self.placement()
        if max_concurrency is not None:
            if state.inflight[name] >= replica_share(max_concurrency, replicas, rank):
                self._reject(name, "max_concurrency",
                             f"adapter {name!r} is at its quota of {max_concurrency} concurrent requests; retry later")
        if requests_per_s is not None:
            rate = requests_per_s / replicas
            now = self.clock()
            bucket = state.buckets.get(name)
            capacity = max(1.0, rate)
            if bucket is None:
                if len(state.buckets) >= MAX_IDLE_BUCKETS:
                    state.buckets = {n: b for n, b in state.buckets.items() if b.full_at > now}
                bucket = state.buckets[name] = _Bucket(capacity, now)
            bucket.tokens = min(capacity, bucket.tokens + (now - bucket.updated) * rate)
            bucket.updated = now
            if bucket.tokens < 1.0:
                self._reject(name, "requests_per_s",
                             f"adapter {name!r} is over its quota of {requests_per_s:g} requests per second; "
                             f"retry later")
            bucket.tokens -= 1.0
            bucket.full_at = now + (capacity - bucket.tokens) / rate
        state.inflight[name] += 1
        state.peak_inflight[name] = max(state.peak_inflight[name], state.inflight[name])
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state.inflight[name] -= 1
                if state.inflight[name] <= 0:
                    del state.inflight[name]

        return release

    def _reject(self, name: str, quota: str, message: str) -> None:
        self.state.rejections[(name, quota)] += 1
        if self._counter is not None:
            self._counter.inc(tags={"adapter": name, "quota": quota})
        raise HTTPError(429, message, param="model", code="adapter_quota_exceeded", retry_after=1)


def _noop() -> None:
    return None

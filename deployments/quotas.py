"""Per-adapter quotas at the ingress: concurrent requests and requests per second.

Quotas are fleet-wide limits: each of the ingress's ``world_size`` replicas enforces its
even share (concurrency rounded down, at least 1; the rate as a token bucket holding one
second of its share), so the fleet admits at most the limit. A refusal is a 429 that names
the adapter and the quota, and counts in ``lorafleet_adapter_quota_rejections_total``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from .http_errors import HTTPError


@dataclass
class _Bucket:
    tokens: float
    updated: float


@dataclass
class QuotaState:
    inflight: Counter = field(default_factory=Counter)
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    rejections: Counter = field(default_factory=Counter)   # (adapter, quota) -> count


class AdapterQuotas:
    def __init__(self, ingress_replicas: int = 1, clock: Callable[[], float] = time.monotonic, metrics: bool = True):
        self.share = 1.0 / max(1, ingress_replicas)
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
        if max_concurrency is not None:
            limit = max(1, math.floor(max_concurrency * self.share))
            if state.inflight[name] >= limit:
                self._reject(name, "max_concurrency",
                             f"adapter {name!r} is at its quota of {max_concurrency} concurrent requests; retry later")
        if requests_per_s is not None:
            rate = requests_per_s * self.share
            now = self.clock()
            bucket = state.buckets.get(name)
            capacity = max(1.0, rate)
            if bucket is None:
                bucket = state.buckets[name] = _Bucket(capacity, now)
            bucket.tokens = min(capacity, bucket.tokens + (now - bucket.updated) * rate)
            bucket.updated = now
            if bucket.tokens < 1.0:
                self._reject(name, "requests_per_s",
                             f"adapter {name!r} is over its quota of {requests_per_s:g} requests per second; "
                             f"retry later")
            bucket.tokens -= 1.0
        state.inflight[name] += 1
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

"""What one router learns from its own traffic, kept cheap enough for every decision.

- requests in flight per replica and the adapters they use (whether an adapter can join a
  replica's running batch now);
- each replica's recent request time (seconds from send to completion, an EWMA): the
  ``T`` of the policy's queue wait; and how much longer a request takes per request
  already running where it went (a decayed least-squares fit of time against the queue
  it joined): the policy's batch slowdown, measured rather than assumed (nearly 0 on a
  GPU, large where each request costs its replica CPU);
- each adapter's recent demand (requests per second, exponentially decayed) and when it
  was last sent to each replica: what an eviction costs (the pools evict the least
  recently used);
- decisions handed to Serve but not yet counted in its queue-length cache, so routing
  tasks that decide in the same instant do not all pick the one free row.

No Ray here: ``routing.ray_router`` and the simulator drive the same code.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Callable, Mapping, Optional, Sequence

from .settings import DEFAULT_SETTINGS, RoutingSettings

_EMPTY: Mapping = {}
PRUNE_INTERVAL_S = 10.0


class DemandRates:
    """Requests (or request-seconds, with ``weight``) per second per adapter, decayed with time
    constant ``tau_s`` (read lazily)."""

    def __init__(self, tau_s: float, clock: Callable[[], float]):
        self.tau_s = tau_s
        self._clock = clock
        self._value: dict[Optional[str], tuple[float, float]] = {}  # adapter -> (decayed count, at)

    def add(self, adapter: Optional[str], weight: float = 1.0) -> None:
        now = self._clock()
        value, at = self._value.get(adapter, (0.0, now))
        self._value[adapter] = (value * math.exp((at - now) / self.tau_s) + weight, now)

    def names(self) -> list:
        return list(self._value)

    def get(self, adapter: Optional[str], default: float = 0.0) -> float:
        entry = self._value.get(adapter)
        if entry is None:
            return default
        value, at = entry
        return value * math.exp((at - self._clock()) / self.tau_s) / self.tau_s

    def prune(self, below: float = 1e-3) -> None:
        """Forget adapters whose rate decayed below ``below`` (bounds memory)."""
        self._value = {a: e for a, e in self._value.items() if self.get(a) >= below}

    def __len__(self) -> int:
        return len(self._value)


class ByIndex:
    """``table[ids[i]]`` for index ``i`` without building a list per decision (large fleets)."""

    __slots__ = ("ids", "table", "default")

    def __init__(self, ids: Sequence[str], table: Mapping, default):
        self.ids, self.table, self.default = ids, table, default

    def __getitem__(self, i: int):
        return self.table.get(self.ids[i], self.default)

    def __len__(self) -> int:
        return len(self.ids)


class SecondsLeft:
    """``max(0, table[ids[i]] - now) + extra[ids[i]]`` for index ``i``: a time left per replica, computed only
    for the replicas a decision looks at (large fleets)."""

    __slots__ = ("ids", "table", "now", "extra")

    def __init__(self, ids: Sequence[str], table: Mapping[str, float], now: float,
                 extra: Optional[Mapping[str, float]] = None):
        self.ids, self.table, self.now, self.extra = ids, table, now, extra

    def __getitem__(self, i: int) -> float:
        rid = self.ids[i]
        end = self.table.get(rid)
        left = end - self.now if end is not None and end > self.now else 0.0
        return left + self.extra.get(rid, 0.0) if self.extra else left

    def __len__(self) -> int:
        return len(self.ids)


class LocalRouterState:
    def __init__(self, clock: Callable[[], float] = time.monotonic, settings: RoutingSettings = DEFAULT_SETTINGS,
                 max_tracked: int = 10_000):
        self._clock = clock
        self.alpha = settings.request_time_alpha
        self.send_ttl_s = settings.send_ttl_s
        self.max_tracked = max_tracked
        self.demand = DemandRates(settings.demand_tau_s, clock)
        self.request_time: dict[str, float] = {}              # replica -> EWMA seconds
        self.inflight: Counter = Counter()                     # replica -> requests in flight
        self.active: dict[str, Counter] = {}                   # replica -> adapter -> requests in flight
        self.last_used: dict[str, dict] = {}                   # replica -> adapter -> when last sent there
        self._requests: dict[str, tuple[str, Optional[str], float, int]] = {}  # id -> (replica, adapter, at, queue)
        self._fit = [0.0, 0.0, 0.0, 0.0, 0.0]  # decayed n, sum q, sum t, sum q*q, sum q*t (time against queue)
        self.fit_decay = 0.995
        self._chosen: dict[str, tuple[str, float]] = {}        # request id -> (replica, expiry)
        self.pending: Counter = Counter()                      # replica -> chosen, not yet in Serve's cache
        self.full_at: dict[str, float] = {}                    # replica -> when it was last seen full
        self.prefill_end: dict[str, float] = {}                # replica -> when the prompts sent there have prefilled
        # prompts decided for a replica and not yet accepted there: request id -> (replica, seconds, expiry)
        self._prompts_chosen: dict[str, tuple[str, float, float]] = {}
        self.pending_prefill: dict[str, float] = {}            # replica -> those prompts' prefill seconds
        self._pruned_at = clock()

    # ------------------------------------------------------------------ events

    def chose(self, request_id: str, replica_id: str, prompt_s: float = 0.0) -> None:
        """A decision was handed to Serve; it counts against the replica until Serve sends it, and its prompt
        (``prompt_s`` seconds of prefill there) until the replica accepts it (``routed``).

        Why the prompt counts from the decision: Serve sends each request in a task of its own, and the replica's
        accept comes a round trip later (tens to hundreds of ms on a busy host). A burst decided within that
        window saw no prefill queued at the replica a moment ago idle, and every long prompt of it went there
        (``fleet_live``'s slowest first tokens: three prompts of 4.6k-7.4k tokens sent to one replica at once)."""
        previous = self._chosen.pop(request_id, None)
        if previous is not None:
            self._release(previous[0])
        self._release_prompt(request_id)
        if len(self._chosen) > self.max_tracked:  # requests cancelled before sending never come back
            self._chosen.clear()
            self.pending.clear()
        if len(self._prompts_chosen) > self.max_tracked:
            self._prompts_chosen.clear()
            self.pending_prefill.clear()
        expiry = self._clock() + self.send_ttl_s
        self._chosen[request_id] = (replica_id, expiry)
        self.pending[replica_id] += 1
        if prompt_s > 0:
            self._prompts_chosen[request_id] = (replica_id, prompt_s, expiry)
            self.pending_prefill[replica_id] = self.pending_prefill.get(replica_id, 0.0) + prompt_s

    def sent(self, replica_id: str) -> None:
        """Serve sent a request to ``replica_id`` (its queue-length cache now counts it)."""
        for request_id, (rid, _) in self._chosen.items():
            if rid == replica_id:
                del self._chosen[request_id]
                self._release(rid)
                return

    def routed(self, request_id: str, replica_id: str, adapter: Optional[str], prompt_tokens: int = 0,
               prefill_s_per_token: float = 0.0) -> None:
        """The replica accepted the request: a prompt of ``prompt_tokens`` that it prefills at
        ``prefill_s_per_token`` (its measured rate, else the settings' prior), after those sent before."""
        self._release_prompt(request_id)  # counted from its decision until now (``chose``)
        if prompt_tokens > 0 and prefill_s_per_token > 0:
            now = self._clock()
            self.prefill_end[replica_id] = max(self.prefill_end.get(replica_id, now), now) + \
                prompt_tokens * prefill_s_per_token
        if len(self._requests) > self.max_tracked:
            self._requests.clear()
            self.inflight.clear()
            self.active.clear()
        self._requests[request_id] = (replica_id, adapter, self._clock(), self.inflight[replica_id])
        self.inflight[replica_id] += 1
        self.active.setdefault(replica_id, Counter())[adapter] += 1
        self.last_used.setdefault(replica_id, {})[adapter] = self._clock()
        self.demand.add(adapter)

    def completed(self, request_id: str) -> Optional[str]:
        """The request finished (any outcome); returns its replica, or None if it was not tracked."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        replica_id, adapter, at, queue = entry
        if self.inflight[replica_id] > 0:
            self.inflight[replica_id] -= 1
        running = self.active.get(replica_id)
        if running is not None and running[adapter] > 0:
            running[adapter] -= 1
            if not running[adapter]:
                del running[adapter]
        seconds = self._clock() - at
        old = self.request_time.get(replica_id)
        self.request_time[replica_id] = seconds if old is None else old + self.alpha * (seconds - old)
        fit, d = self._fit, self.fit_decay
        for k, v in enumerate((1.0, queue, seconds, queue * queue, queue * seconds)):
            fit[k] = fit[k] * d + v
        return replica_id

    def batch_slowdown(self, min_samples: float = 20.0) -> Optional[float]:
        """Extra share of a request's time per request already running on its replica, fitted
        from this router's completed requests; None until there are enough, or no spread in queues."""
        n, sq, st, sqq, sqt = self._fit
        if n < min_samples:
            return None
        var = sqq - sq * sq / n
        if var <= 1e-9 * n:
            return None
        slope = (sqt - sq * st / n) / var
        intercept = st / n - slope * sq / n
        if intercept <= 0:
            return None
        return min(1.0, max(0.0, slope / intercept))

    def forget_replica(self, replica_id: str) -> None:
        for table in (self.request_time, self.inflight, self.active, self.pending, self.last_used, self.full_at,
                      self.prefill_end, self.pending_prefill):
            table.pop(replica_id, None)
        for request_id in [k for k, (rid, _, _) in self._prompts_chosen.items() if rid == replica_id]:
            del self._prompts_chosen[request_id]

    def expire(self) -> None:
        """Drop decisions Serve never sent (cancelled requests), so their rows come back; every
        ``PRUNE_INTERVAL_S`` forget adapters no longer asked for (bounded maps)."""
        now = self._clock()
        if now - self._pruned_at >= PRUNE_INTERVAL_S:
            self._pruned_at = now
            self.demand.prune()
            for used in self.last_used.values():
                for name in [a for a, t in used.items() if now - t > PRUNE_INTERVAL_S * 6]:
                    del used[name]
        for request_id, (rid, expiry) in list(self._chosen.items()):
            if expiry <= now:
                del self._chosen[request_id]
                self._release(rid)
        for request_id, (_, _, expiry) in list(self._prompts_chosen.items()):
            if expiry <= now:
                self._release_prompt(request_id)

    # ------------------------------------------------------------------ policy inputs

    def active_by_index(self, ids: Sequence[str]) -> ByIndex:
        return ByIndex(ids, self.active, _EMPTY)

    def last_used_by_index(self, ids: Sequence[str]) -> ByIndex:
        return ByIndex(ids, self.last_used, _EMPTY)

    def saw_full(self, replica_id: str) -> None:
        """Replica ``replica_id`` had no free row just now (a spill target must have been idle a while)."""
        self.full_at[replica_id] = self._clock()

    def full_at_by_index(self, ids: Sequence[str]) -> ByIndex:
        return ByIndex(ids, self.full_at, float("-inf"))

    def prefill_wait_by_index(self, ids: Sequence[str]) -> SecondsLeft:
        """Per replica, seconds until the prompts this router sent it have prefilled (0 when none are left).
        An estimate from this router's own sends at the replicas' measured rates: a prompt that finished
        early (cancelled, or prefilled faster) still counts until its estimated end, never beyond."""
        return SecondsLeft(ids, self.prefill_end, self._clock(), self.pending_prefill)

    def request_s_by_index(self, ids: Sequence[str]) -> ByIndex:
        """Measured request time per replica; an unmeasured replica gets the fleet's mean."""
        times = self.request_time
        default = sum(times.values()) / len(times) if times else None
        return ByIndex(ids, times, default)

    def _release_prompt(self, request_id: str) -> None:
        entry = self._prompts_chosen.pop(request_id, None)
        if entry is None:
            return
        rid, seconds, _ = entry
        left = self.pending_prefill.get(rid, 0.0) - seconds
        if left > 1e-9:
            self.pending_prefill[rid] = left
        else:
            self.pending_prefill.pop(rid, None)

    def _release(self, replica_id: str) -> None:
        if self.pending[replica_id] > 1:
            self.pending[replica_id] -= 1
        else:
            self.pending.pop(replica_id, None)

"""What Serve's own routers know of a replica's queue, and when they learn it (Ray 2.60), in simulated time.

Why: live, Serve's default router at concurrency 64 on two replicas left them idle 26 % of the run
while requests waited, and 2.4 of its sends per request were refused (``benchmarks.serve_release``).
A router that decides on exact counts (the simulator's before this model) cannot do either, so the
simulator served twice the live req/s. What Serve's router does (``request_router.py``,
``router.py``):

- it keeps a cache of each replica's ongoing count, set by a probe's answer or a send's
  accept/refuse reply, raised by one at each send, lowered by one when a result comes back;
- a candidate whose cached count is missing or at ``max_ongoing_requests`` is probed; when a
  candidate's cache has room the router sends there at once (and probes the others in the
  background); else it waits for the probes (deadline 0.1 s doubling per failed try, at most 1 s)
  and sends to the least loaded answer with room -- an answer that is late counts as none;
- the replica accepts a send only below its limit, else refuses it with its count; a refused
  request goes back to the front of the routing queue.

Every message takes an RPC time drawn from ``ServeTimes.rpc`` (one-way half of it) times the share of
the replica's rows taken: its event loop serves the running requests' handlers between messages, so
an idle replica answers at once (at concurrency 1 the live fleet's requests took 35-44 ms in all,
engine included). The replica releases a finished request's count ``release`` after its result leaves,
and the router's cache and the closed-loop client hear of the result ``client`` after it leaves (both
scaled the same way). Those two are measured by ``benchmarks.serve_release`` per request; the RPC time
is fitted to its probes (median call time and share that timed out) and checked against what it
measured beside them: refusals per request, sends at a full cache, the replicas' idle share, req/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class LogNormal:
    """A positive time in seconds: ``median * exp(sigma * N(0, 1))``."""

    median_s: float
    sigma: float

    @classmethod
    def from_quantiles(cls, p50_s: float, p90_s: float) -> "LogNormal":
        """The lognormal through a measured median and 90th percentile."""
        return cls(p50_s, max(0.0, math.log(max(p90_s, p50_s) / p50_s)) / 1.2815515594936252)

    def draw(self, rng: np.random.Generator) -> float:
        return self.median_s * math.exp(self.sigma * float(rng.standard_normal())) if self.sigma > 0 else self.median_s


@dataclass(frozen=True)
class ServeTimes:
    """Serve's message and release times on the live machine, as at concurrency 64 (replicas full). Defaults:
    ``benchmarks.serve_release --quick`` (2026-12-03, pow2 at c=64, 2 replicas, 2 cores): release p50 5.1 ms /
    p90 19.6; client p50 6.5 / p90 30.5; the RPC time chosen on a grid (medians 50-120 ms, sigma 0.6-1.0) as
    the nearest to its probes (call p50 101 ms, 24 % timed out): simulated 67 ms and 21 % at that setting."""

    rpc: LogNormal = LogNormal(0.070, 0.6)
    release: LogNormal = LogNormal.from_quantiles(0.0051, 0.0196)
    client: LogNormal = LogNormal.from_quantiles(0.0065, 0.0305)
    probe_deadline_s: float = 0.1       # RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S
    max_probe_deadline_s: float = 1.0   # RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S
    # the replica's CPU per send it refuses and per probe it answers (serve_release --quick, 2026-12-06: a replica
    # held at its limit, 654 refused sends/s and 1,389 probes/s, its CPU above the same replica idle; a scratch
    # run of the same measurement read 1.37-1.73 and 0.50-0.53 ms)
    refusal_cpu_s: float = 0.00121
    probe_cpu_s: float = 0.00048


class Clock(Protocol):
    now: float

    def at(self, t: float, action: Callable, *args) -> None: ...


class ServeQueueCache:
    """One Serve router's queue-length cache and its probes (see the module docstring). ``count(i)`` is
    replica ``i``'s real ongoing count (what a probe's answer reads when it reaches the replica)."""

    def __init__(self, clock: Clock, times: ServeTimes, max_ongoing: int, count: Callable[[int], int],
                 rng: np.random.Generator, on_probe: Optional[Callable[[int], None]] = None):
        self.clock, self.times, self.max_ongoing, self.count, self.rng = clock, times, max_ongoing, count, rng
        self.on_probe = on_probe  # a probe reached replica i (its CPU), answered in time or not
        self.cached: dict[int, int] = {}
        self.probes = 0
        self.probe_answers = 0
        self.probe_timeouts = 0
        self.probe_call_s: list[float] = []
        self.sends = 0
        self.sends_at_full_cache = 0

    def rpc_s(self, i: int) -> float:
        """A message's round trip to replica ``i``: the fitted time, scaled by the share of its rows taken (its
        event loop serves the running requests' handlers between messages: an idle replica answers at once)."""
        return self.busy_scaled(self.times.rpc, i)

    def busy_scaled(self, time: LogNormal, i: int) -> float:
        """A draw of ``time`` (measured with replicas full) scaled by the share of replica ``i``'s rows taken."""
        return time.draw(self.rng) * min(1.0, self.count(i) / self.max_ongoing)

    def select(self, candidates: Sequence[int], backoff_index: int, then: Callable[[Optional[int]], None]) -> None:
        """Serve's ``_select_from_candidate_replicas``: ``then(replica or None)``, at once when a candidate's
        cached count has room, else when the probes have answered or their deadline passed."""
        best, unknown = None, []
        for i in candidates:
            q = self.cached.get(i)
            if q is None or q >= self.max_ongoing:
                unknown.append(i)
            elif best is None or q < self.cached[best]:
                best = i
        if best is not None:
            if unknown:
                self._probe(unknown, backoff_index, None)  # in the background: only fills the cache
            then(best)
            return
        self._probe(unknown, backoff_index, then)

    def _probe(self, replicas: Sequence[int], backoff_index: int,
               then: Optional[Callable[[Optional[int]], None]]) -> None:
        t = self.times
        deadline = min(t.probe_deadline_s * 2 ** min(backoff_index, 30), max(t.probe_deadline_s, t.max_probe_deadline_s))
        now = self.clock.now
        answers: list[tuple[float, int]] = []  # (answer time, replica) for those within the deadline
        for i in replicas:
            self.probes += 1
            if self.on_probe is not None:
                self.on_probe(i)
            latency = self.rpc_s(i)
            if latency > deadline:
                self.probe_timeouts += 1
                continue
            self.probe_answers += 1
            answers.append((latency, i))
            self.clock.at(now + latency, self._answer, i)
        waited = max((lat for lat, _ in answers), default=0.0) if len(answers) == len(replicas) else deadline
        self.probe_call_s.append(waited)
        if then is not None:
            self.clock.at(now + waited, self._probed, [i for _, i in answers], then)

    def _answer(self, i: int) -> None:
        self.cached[i] = self.count(i)

    def _probed(self, answered: list[int], then: Callable[[Optional[int]], None]) -> None:
        room = [i for i in answered if self.cached.get(i, self.max_ongoing) < self.max_ongoing]
        then(min(room, key=lambda i: self.cached[i]) if room else None)

    def sent(self, i: int) -> None:
        """Serve's ``on_send_request``: the cache counts the send before any reply."""
        q = self.cached.get(i) or 0
        self.sends += 1
        self.sends_at_full_cache += q >= self.max_ongoing
        self.cached[i] = q + 1

    def replied(self, i: int, count: int) -> None:
        """A send's accept or refusal: the replica's count as it answered."""
        self.cached[i] = count

    def result(self, i: int) -> None:
        """A result came back (``decrement_queue_len_cache``): one fewer, never below zero, only if cached."""
        q = self.cached.get(i)
        if q is not None:
            self.cached[i] = max(0, q - 1)

"""What ``benchmarks.chaos`` records about each request, and the tables and goals computed from it.

Pure: no Ray, no HTTP. The benchmark fills these records while it drives traffic and kills
things; this module decides what counts as lost, how long recovery took, how many engine
steps went to requests nobody was waiting for, and how much the workers' memory grew, so
the verdicts can be tested from hand-made records.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from .common import Goal, Row, goal

OK = "ok"                     # the whole answer arrived (a stream: its finish reason and [DONE])
DROPPED = "dropped"           # the client closed the stream on purpose after some tokens
STATUS = "status"             # an error status before anything was streamed: the request is lost
NO_RESPONSE = "no_response"   # the connection failed or timed out before a status: lost
ERROR_EVENT = "error_event"   # a started stream ended with an OpenAI-style error event and [DONE]
CUT = "cut"                   # a started stream ended without an error event or without [DONE]
KINDS = (OK, DROPPED, STATUS, NO_RESPONSE, ERROR_EVENT, CUT)
LOST_KINDS = (STATUS, NO_RESPONSE)

RECOVERY_GOAL_S = 15.0
RSS_GROWTH_GOAL_PCT = 5.0
ORPHAN_STEPS_GOAL = 1


@dataclass
class Outcome:
    """One request of the traffic, as the client saw it."""

    phase: str
    stream: bool
    kind: str
    started: float
    ended: float
    status: Optional[int] = None               # the HTTP status, None when none arrived
    tokens_received: int = 0                   # streamed token chunks read before the end
    completion_tokens: Optional[int] = None    # the server's usage count, when it sent one
    error_code: Optional[str] = None           # the error body's (or event's) code, or the exception's type

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"outcome kind {self.kind!r} is not one of {KINDS}")


@dataclass
class Probe:
    """One small request for one adapter, sent after a kill to see when it is servable again."""

    adapter: str
    started: float
    ended: float
    ok: bool
    status: Optional[int] = None


@dataclass
class KillRecord:
    """One kill: what, when, the probes that followed, and when the killed part was back."""

    target: str                 # "worker" or "directory"
    killed_at: float
    probes: list[Probe] = field(default_factory=list)
    back_at: Optional[float] = None          # the replacement replica alive and reporting
    adapters_listed: Optional[bool] = None   # /v1/models listed every adapter afterwards


@dataclass
class IsolatedDrop:
    """One stream dropped by its client on an otherwise idle fleet, with its replica's engine counters.

    ``tokens_*`` are the serving replica's ``tokens_generated``: when the stream started, the
    most any poll saw before the engine counted its cancel, the least any poll saw after, and
    once the replica was idle again. With nothing else running, each of its tokens is one step.
    """

    tokens_received: int
    tokens_start: int
    tokens_before_cancel: Optional[int]   # None: the cancel was never counted (it finished first)
    tokens_after_cancel: Optional[int]
    tokens_end: int
    engine_steps_after_cancel: Optional[int] = None  # the engine's own count (max_steps_after_cancel), exact

    @property
    def steps_after_disconnect(self) -> int:
        """Steps the engine spent on it after the client's last read (disconnect propagation included)."""
        return self.tokens_end - self.tokens_start - self.tokens_received

    @property
    def steps_after_cancel_bounds(self) -> Optional[tuple[int, int]]:
        """(at least, at most) steps spent on it after the engine counted its cancel; None without a cancel."""
        if self.tokens_before_cancel is None or self.tokens_after_cancel is None:
            return None
        return self.tokens_end - self.tokens_after_cancel, self.tokens_end - self.tokens_before_cancel

    @property
    def orphan_steps_at_most(self) -> int:
        """The bound the goal holds: the tighter of two upper bounds of the steps after the engine's cancel.

        Every token the client read was made before its disconnect, which came before the cancel, so
        ``steps_after_disconnect`` bounds them too; the polls around the cancel give the other. When the
        engine never counted a cancel (the stream finished first, or the cancel never arrived), only the
        first holds.
        """
        bounds = self.steps_after_cancel_bounds
        return self.steps_after_disconnect if bounds is None else min(bounds[1], self.steps_after_disconnect)


# ---------------------------------------------------------------------------- requests


def lost(outcomes: Iterable[Outcome]) -> int:
    """Requests that failed before anything was streamed to the client."""
    return sum(o.kind in LOST_KINDS for o in outcomes)


def cut(outcomes: Iterable[Outcome]) -> int:
    """Started streams that ended without an error event and [DONE]."""
    return sum(o.kind == CUT for o in outcomes)


def errors(outcomes: Iterable[Outcome]) -> int:
    """Every request that did not end as asked: lost, cut, or ended by an error event."""
    return sum(o.kind not in (OK, DROPPED) for o in outcomes)


def _statuses(outcomes: Sequence[Outcome]) -> str:
    counts = Counter(o.status for o in outcomes if o.kind == STATUS)
    return " ".join(f"{status}:{n}" for status, n in sorted(counts.items())) or "-"


def request_rows(outcomes: Sequence[Outcome], phases: Sequence[str]) -> list[Row]:
    """Per phase (then all): requests, streams, each kind, and the error statuses seen."""
    by_phase: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_phase[o.phase].append(o)
    rows = []
    for phase in [*phases, "all"]:
        chosen = list(outcomes) if phase == "all" else by_phase.get(phase, [])
        kinds = Counter(o.kind for o in chosen)
        rows.append({"phase": phase, "requests": len(chosen), "streams": sum(o.stream for o in chosen),
                     **{kind: kinds.get(kind, 0) for kind in KINDS}, "statuses": _statuses(chosen)})
    return rows


def accounted_tokens(outcomes: Iterable[Outcome]) -> int:
    """Tokens the clients were sent: usage of complete answers, chunks read of the others."""
    total = 0
    for o in outcomes:
        if o.kind == OK and o.completion_tokens is not None:
            total += o.completion_tokens
        else:
            total += o.tokens_received
    return total


def unaccounted_tokens(generated: int, outcomes: Sequence[Outcome]) -> int:
    """Tokens the engines generated beyond what any client was sent: work nobody received."""
    return generated - accounted_tokens(outcomes)


# ---------------------------------------------------------------------------- recovery


def adapter_recovered_at(probes: Sequence[Probe]) -> Optional[float]:
    """When the adapter became servable for good: the end of its first success after its last failure."""
    ordered = sorted(probes, key=lambda p: p.started)
    failures = [p.started for p in ordered if not p.ok]
    after = failures[-1] if failures else -math.inf
    successes = [p.ended for p in ordered if p.ok and p.started > after]
    return min(successes) if successes else None


def recovery_seconds(kill: KillRecord, adapters: Sequence[str]) -> float:
    """Seconds from the kill until every adapter was servable for good (inf if one never was)."""
    worst = 0.0
    for adapter in adapters:
        at = adapter_recovered_at([p for p in kill.probes if p.adapter == adapter])
        if at is None:
            return math.inf
        worst = max(worst, at - kill.killed_at)
    return worst


def recovery_rows(kills: Sequence[KillRecord], adapters: Sequence[str]) -> list[Row]:
    rows = []
    for kill in kills:
        failed = [p for p in kill.probes if not p.ok]
        rows.append({
            "killed": kill.target,
            "all_servable_s": recovery_seconds(kill, adapters),
            "replica_back_s": None if kill.back_at is None else kill.back_at - kill.killed_at,
            "probes": len(kill.probes),
            "probes_failed": len(failed),
            "failed_statuses": " ".join(f"{s}:{n}" for s, n in sorted(Counter(
                p.status if p.status is not None else 0 for p in failed).items())) or "-",
            "adapters_listed": kill.adapters_listed,
        })
    return rows


# ---------------------------------------------------------------------------- orphaned work


def orphan_steps(isolated: Sequence[IsolatedDrop]) -> Optional[int]:
    """Steps spent on a sequence after its cancel: the engine's exact count where it reported one,
    else the measured upper bound."""
    counted = [d.engine_steps_after_cancel for d in isolated if d.engine_steps_after_cancel is not None]
    if counted:
        return max(counted)
    return max((d.orphan_steps_at_most for d in isolated), default=None)


def orphan_rows(isolated: Sequence[IsolatedDrop], loaded_unaccounted: int, loaded_dropped: int,
                loaded_cancelled: int) -> list[Row]:
    """Engine steps on requests nobody waited for: measured alone per stream, and in sum under load."""
    after_disconnect = [d.steps_after_disconnect for d in isolated]
    bounds = [b for b in (d.steps_after_cancel_bounds for d in isolated) if b is not None]
    return [
        {"measurement": "isolated drops", "streams": len(isolated), "engine_cancels": len(bounds),
         "steps_after_disconnect_max": max(after_disconnect, default=None),
         "steps_after_disconnect_mean": (sum(after_disconnect) / len(after_disconnect)) if after_disconnect else None,
         "after_cancel_at_least_max": max((lo for lo, _ in bounds), default=None),
         "after_cancel_at_most_max": max((d.orphan_steps_at_most for d in isolated), default=None),
         "engine_counted_max": orphan_steps(isolated)},
        {"measurement": "drops under load", "streams": loaded_dropped, "engine_cancels": loaded_cancelled,
         "steps_after_disconnect_max": None,
         "steps_after_disconnect_mean": (loaded_unaccounted / loaded_dropped) if loaded_dropped else None,
         "after_cancel_at_least_max": None, "after_cancel_at_most_max": None, "engine_counted_max": None},
    ]


# ---------------------------------------------------------------------------- memory


def rss_growth_pct(before: dict[int, int], after: dict[int, int]) -> float:
    """The largest growth of one worker process's RSS, in percent (inf if a process was replaced)."""
    if not before or set(before) != set(after):
        return math.inf
    return max(100.0 * (after[pid] - before[pid]) / before[pid] for pid in before)


def rss_rows(before: dict[int, int], after: dict[int, int]) -> list[Row]:
    rows = []
    for pid in sorted(set(before) | set(after)):
        b, a = before.get(pid), after.get(pid)
        rows.append({"worker_pid": pid, "rss_before_mb": None if b is None else b / 2**20,
                     "rss_after_mb": None if a is None else a / 2**20,
                     "growth_pct": None if a is None or b is None else 100.0 * (a - b) / b})
    return rows


# ---------------------------------------------------------------------------- goals


def chaos_goals(chaos_outcomes: Sequence[Outcome], kills: Sequence[KillRecord], adapters: Sequence[str],
                isolated: Sequence[IsolatedDrop], soak_outcomes: Sequence[Outcome],
                rss_before: dict[int, int], rss_after: dict[int, int]) -> list[Goal]:
    """The four goals of the chaos run, each FAIL with its number when missed."""
    missing = lost(chaos_outcomes) + cut(chaos_outcomes)
    recovery = max((recovery_seconds(k, adapters) for k in kills), default=math.inf)
    orphan = orphan_steps(isolated)
    growth = rss_growth_pct(rss_before, rss_after)
    soak_errors = errors(soak_outcomes)
    return [
        goal("chaos_lost_requests", missing, "== 0 (lost before streaming + streams cut without an error event)",
             missing == 0),
        goal("chaos_orphan_steps", orphan,
             f"<= {ORPHAN_STEPS_GOAL} step after the engine's cancel (engine-counted; max over isolated drops)",
             None if orphan is None else orphan <= ORPHAN_STEPS_GOAL),
        goal("chaos_recovery_s", recovery, f"<= {RECOVERY_GOAL_S:g} s after each kill",
             recovery <= RECOVERY_GOAL_S),
        goal("soak_rss_growth", {"max_worker_growth_pct": round(growth, 3), "errors": soak_errors},
             f"< {RSS_GROWTH_GOAL_PCT:g}% after warm-up and 0 errors",
             growth < RSS_GROWTH_GOAL_PCT and soak_errors == 0 and len(soak_outcomes) > 0),
    ]

"""A replica's measured adapter load times, as routers price them (no Ray, no torch).

Two tiers: a host-tier copy into a slot (the pool's own counters: load seconds over loads
since the last report) and a disk (or hub) read into the host tier (timed by the worker
around the read). Beside them the replica's prefill rate, seconds per prompt token (the
engine's prefill-heavy steps: seconds over prompt tokens since the last report), which
routers use to price the prompts queued ahead of a request. Each is an EWMA, reported
rounded to two significant digits so the directory's view changes only when a timing really
moves.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterator, Optional


def _two_digits(x: Optional[float]) -> Optional[float]:
    if x is None or x <= 0:
        return x
    return round(x, 1 - int(math.floor(math.log10(x))))


class LoadTimings:
    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha
        self.host_s: Optional[float] = None
        self.disk_s: Optional[float] = None
        self._loads = 0
        self._load_seconds = 0.0
        self.prefill_s: Optional[float] = None  # seconds per prompt token
        self._prefill = (0, 0.0)

    def _ewma(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe_disk(self, seconds: float) -> None:
        self.disk_s = self._ewma(self.disk_s, seconds)

    @contextmanager
    def disk_read(self) -> Iterator[None]:
        """Time a read into the host tier (wall time: the caller waits for all of it)."""
        started = time.perf_counter()
        yield
        self.observe_disk(time.perf_counter() - started)

    def observe_pool(self, loads: int, load_seconds: float) -> None:
        """The pool's cumulative ``counters.loads`` / ``counters.load_seconds``: the mean of the new loads."""
        if loads > self._loads:
            self.host_s = self._ewma(self.host_s, (load_seconds - self._load_seconds) / (loads - self._loads))
        self._loads, self._load_seconds = loads, load_seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine's cumulative ``prefill_timed`` (prompt tokens, seconds): the rate of the new steps."""
        before_tokens, before_s = self._prefill
        if tokens > before_tokens:
            self.prefill_s = self._ewma(self.prefill_s, (seconds - before_s) / (tokens - before_tokens))
        self._prefill = (tokens, seconds)

    def report(self) -> dict:
        return {"host": _two_digits(self.host_s), "disk": _two_digits(self.disk_s),
                "prefill": _two_digits(self.prefill_s)}

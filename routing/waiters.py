"""Requests waiting in the router for capacity, woken oldest first.

A completion frees one row. The waiting requests look at it in arrival order, the oldest
first, and the first whose decision suits the row takes it; so a request is never passed
over just because it went back to sleep later than others (which an ``asyncio.Event`` would
do: its waiters resume in the order they last started waiting). The row is handed down the
line (``relay``): the oldest sleeping request wakes, and if it goes back to sleep while some
replica still has room it wakes the next one (``wait(handoff=True)``); once a decision finds
every replica full the relay ends. Waking every waiter at each completion (``wake_all``) made
each of them decide again: under saturation ~50 decisions a request, most of the router's CPU.
No Ray here.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools


class OldestFirstWaiters:
    def __init__(self) -> None:
        self._waiting: list[tuple[float, int, asyncio.Future]] = []  # sorted by (first seen, arrival)
        self._counter = itertools.count()
        self._line: list[tuple[float, str]] = []  # (first seen, request id) of every request waiting, asleep or not

    def join_line(self, since: float, request_id: str) -> None:
        """A request starts waiting for capacity (it stays in line while it decides again between sleeps)."""
        bisect.insort(self._line, (since, request_id))

    def leave_line(self, since: float, request_id: str) -> None:
        self._line.remove((since, request_id))

    def is_oldest(self, request_id: str) -> bool:
        """Whether ``request_id`` heads the line: no request waiting in this router is older."""
        return bool(self._line) and self._line[0][1] == request_id

    def __len__(self) -> int:
        return len(self._waiting)

    def first_in_line(self, since: float) -> bool:
        """Whether no waiting request is older than one that first asked at ``since``."""
        return not self._waiting or self._waiting[0][0] >= since

    async def wait(self, since: float, timeout: float, handoff: bool = False) -> bool:
        """Sleep until woken (True) or ``timeout`` seconds (False); ``since``: when the request first asked
        for a replica (its place in line). ``handoff``: this request was woken by a relay and leaves the
        room it saw to the next younger sleeping request (woken now)."""
        if handoff:
            self.hand_on(since)
        future = asyncio.get_running_loop().create_future()
        entry = (since, next(self._counter), future)
        bisect.insort(self._waiting, entry)
        try:
            await asyncio.wait_for(future, max(0.0, timeout))
            return True
        except asyncio.TimeoutError:
            return False
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.hand_on(since)  # woken by a relay, then cancelled: the row goes to the next in line
            raise
        finally:
            if not future.done():
                future.cancel()
            try:
                self._waiting.remove(entry)
            except ValueError:
                pass  # already taken by wake_all

    def wake_all(self) -> None:
        """Wake every waiting request, oldest first (their coroutines resume in this order)."""
        waiting, self._waiting = self._waiting, []
        for _, _, future in waiting:
            if not future.done():
                future.set_result(None)

    def relay(self) -> None:
        """A row was freed: wake the oldest sleeping request (it hands the row on if it does not take it)."""
        while self._waiting:
            _, _, future = self._waiting.pop(0)
            if not future.done():
                future.set_result(None)
                return

    def hand_on(self, since: float) -> None:
        """Wake the oldest sleeping request younger than ``since`` (the next in line after the one handing on)."""
        for i, (other_since, _, future) in enumerate(self._waiting):
            if other_since > since and not future.done():
                del self._waiting[i]
                future.set_result(None)
                return

"""Requests waiting in the router for capacity, woken oldest first.

A completion frees one row. Every waiting request decides again, and the first to decide
takes the row if it suits it; woken in arrival order, the oldest request gets the first
look, so a request is never passed over just because it went back to sleep later than
others (which an ``asyncio.Event`` would do: its waiters resume in the order they last
started waiting). No Ray here.
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

    async def wait(self, since: float, timeout: float) -> bool:
        """Sleep until ``wake_all`` (True) or ``timeout`` seconds (False); ``since``: when the
        request first asked for a replica (its place in line)."""
        future = asyncio.get_running_loop().create_future()
        entry = (since, next(self._counter), future)
        bisect.insort(self._waiting, entry)
        try:
            await asyncio.wait_for(future, max(0.0, timeout))
            return True
        except asyncio.TimeoutError:
            return False
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

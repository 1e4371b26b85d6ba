"""A bounded buffer of pool events between the engine thread and the flusher task.

Appending never blocks generation. When the buffer is full the oldest event is dropped
and the buffer asks for a snapshot resync, since the directory would see a gap anyway.
"""

from __future__ import annotations

import threading
from collections import deque

from pool.events import PoolEvent


class EventBuffer:
    def __init__(self, capacity: int = 4096):
        self._events: deque[PoolEvent] = deque()
        self.capacity = capacity
        self.dropped = 0
        self.resync_needed = True  # the first report carries a snapshot
        self._lock = threading.Lock()

    def append(self, event: PoolEvent) -> None:
        with self._lock:
            if len(self._events) >= self.capacity:
                self._events.popleft()
                self.dropped += 1
                self.resync_needed = True
            self._events.append(event)

    def drain(self) -> tuple[list[dict], bool]:
        """(events to send, whether a snapshot must go with them); clears both."""
        with self._lock:
            events = [e.to_dict() for e in self._events]
            self._events.clear()
            resync, self.resync_needed = self.resync_needed, False
            return events, resync

    def request_resync(self) -> None:
        with self._lock:
            self.resync_needed = True

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

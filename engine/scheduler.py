"""Iteration-level admission: requests join the running batch at step boundaries.

Admission is FIFO. A request whose adapter cannot get a slot now (its batch would not
validate) blocks the queue head; later arrivals may still join while they add no new
adapter (their adapter already runs, or is pinned), but only for ``max_bypass_steps``
steps, after which only pinned-adapter requests bypass. Running requests then drain, the
blocked adapter fits, and it goes before every later arrival: nobody starves.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Generic, Hashable, Optional, Protocol, TypeVar


class Schedulable(Protocol):
    uid: Optional[str]
    blocked_steps: int


S = TypeVar("S", bound=Schedulable)


class Scheduler(Generic[S]):
    def __init__(self, validate_batch: Callable[[set], bool], is_pinned: Callable[[Hashable], bool],
                 max_batch_size: int, max_bypass_steps: int = 16):
        self.validate_batch = validate_batch
        self.is_pinned = is_pinned
        self.max_batch_size = max_batch_size
        self.max_bypass_steps = max_bypass_steps
        self.waiting: deque[S] = deque()
        self.running: list[S] = []

    def add(self, seq: S) -> None:
        self.waiting.append(seq)

    def running_uids(self) -> set:
        return {s.uid for s in self.running}

    def admit(self) -> list[S]:
        """Move the requests that may join this step from ``waiting`` to ``running``."""
        uids = self.running_uids()
        admitted: list[S] = []
        blocked_head: Optional[S] = None
        for seq in list(self.waiting):
            if len(self.running) + len(admitted) >= self.max_batch_size:
                break
            fits = self.validate_batch(uids | {seq.uid})
            if blocked_head is not None and fits:
                adds_nothing = seq.uid in uids and blocked_head.blocked_steps < self.max_bypass_steps
                fits = adds_nothing or (seq.uid is not None and self.is_pinned(seq.uid))
            if not fits:
                if blocked_head is None:
                    blocked_head = seq
                continue
            self.waiting.remove(seq)
            admitted.append(seq)
            uids.add(seq.uid)
        if blocked_head is not None:
            blocked_head.blocked_steps += 1
        self.running.extend(admitted)
        return admitted

    def requeue_front(self, seqs: list[S]) -> None:
        """Admitted requests that could not start after all go back to the head, in order."""
        for seq in reversed(seqs):
            self.running.remove(seq)
            self.waiting.appendleft(seq)

    def finish(self, seq: S) -> None:
        self.running.remove(seq)

    def drop_waiting(self, predicate: Callable[[S], bool]) -> list[S]:
        dropped = [s for s in self.waiting if predicate(s)]
        for s in dropped:
            self.waiting.remove(s)
        return dropped

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

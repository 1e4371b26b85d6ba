"""Iteration-level scheduling: who runs this step, by adapter slots and by free KV blocks.

Admission is FIFO. A request whose adapter cannot get a slot now (its batch would not
validate) blocks the queue head; later arrivals may still join while they add no new
adapter (their adapter already runs, or is pinned), but only for ``max_bypass_steps``
steps, after which only pinned-adapter requests bypass. Running requests then drain, the
blocked adapter fits, and it goes before every later arrival: nobody starves.

KV blocks: a request joins only if the blocks its tokens need are free (while others run,
a small watermark stays free for their growth); nobody overtakes a request waiting for
blocks. Before each step every running request gets the block its next token needs,
oldest first; when none is free the newest running request is preempted (its blocks
freed, its tokens recomputed when it is admitted again, in arrival order). The oldest
request alone always fits (requests longer than the cache are refused up front), so the
batch always makes progress: no deadlock.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Generic, Hashable, Optional, Protocol, TypeVar


class Schedulable(Protocol):
    uid: Optional[str]
    blocked_steps: int


S = TypeVar("S", bound=Schedulable)


class BlockSpace(Protocol[S]):
    """What the scheduler needs from the KV cache (``engine.block_manager.BlockManager``)."""

    watermark: int

    def num_free(self) -> int: ...
    def admission_cost(self, seq: S) -> int: ...
    def allocate(self, seq: S) -> None: ...
    def growth_needed(self, seq: S) -> int: ...
    def grow(self, seq: S) -> None: ...
    def release(self, seq: S) -> None: ...


class Scheduler(Generic[S]):
    def __init__(self, validate_batch: Callable[[set], bool], is_pinned: Callable[[Hashable], bool],
                 max_batch_size: int, max_bypass_steps: int = 16, blocks: Optional[BlockSpace] = None):
        """``blocks``: the KV cache's block accounting; None schedules by slots and batch size only."""
        self.validate_batch = validate_batch
        self.is_pinned = is_pinned
        self.max_batch_size = max_batch_size
        self.blocks = blocks
        self.max_bypass_steps = max_bypass_steps
        self.waiting: deque[S] = deque()
        self.running: list[S] = []
        self.preemptions = 0
        self.max_running = 0
        self._arrivals = itertools.count()
        self._arrival: dict[int, int] = {}  # id(seq) -> order of arrival, while queued or running

    def add(self, seq: S) -> None:
        self._arrival[id(seq)] = next(self._arrivals)
        self.waiting.append(seq)

    def add_running(self, seq: S) -> None:
        """A sequence that already holds its blocks joins the running batch (a forked sample, engine.sample_group)."""
        self._arrival[id(seq)] = next(self._arrivals)
        self.running.append(seq)

    def _order(self, seq: S) -> int:
        return self._arrival[id(seq)]

    def running_uids(self) -> set:
        return {s.uid for s in self.running}

    def schedule(self) -> tuple[list[S], list[S]]:
        """(admitted, preempted) for this step; afterwards every running request has blocks for its next input.

        A step that had to preempt admits nobody (the freed blocks go to the older requests' growth).
        """
        preempted = self._make_room() if self.blocks is not None else []
        admitted = [] if preempted else self.admit()
        self.max_running = max(self.max_running, len(self.running))
        return admitted, preempted

    def admit(self) -> list[S]:
        """Move the requests that may join this step from ``waiting`` to ``running``, with their blocks."""
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
            if self.blocks is not None:
                reserve = self.blocks.watermark if (self.running or admitted) else 0
                if self.blocks.admission_cost(seq) > self.blocks.num_free() - reserve:
                    break  # FIFO: nobody overtakes a request waiting for KV blocks
                self.blocks.allocate(seq)
            self.waiting.remove(seq)
            admitted.append(seq)
            uids.add(seq.uid)
        if blocked_head is not None:
            blocked_head.blocked_steps += 1
        self.running.extend(admitted)
        return admitted

    def _make_room(self) -> list[S]:
        """Blocks for every running request's next input, oldest first, preempting the newest when short."""
        preempted: list[S] = []
        out: set[int] = set()
        for seq in sorted(self.running, key=self._order):
            if id(seq) in out:
                continue
            while self.blocks.growth_needed(seq) > self.blocks.num_free():
                victim = max((s for s in self.running if id(s) not in out), key=self._order)
                self.blocks.release(victim)
                preempted.append(victim)
                out.add(id(victim))
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq)
        if preempted:
            self.running = [s for s in self.running if id(s) not in out]
            self._requeue(preempted)
            self.preemptions += len(preempted)
        return preempted

    def _requeue(self, seqs: list[S]) -> None:
        """Back into ``waiting`` in arrival order (``waiting`` is always in arrival order)."""
        self.waiting = deque(sorted([*seqs, *self.waiting], key=self._order))

    def requeue_front(self, seqs: list[S]) -> None:
        """Admitted requests that could not start after all go back, their blocks freed, in arrival order."""
        for seq in seqs:
            self.running.remove(seq)
            if self.blocks is not None:
                self.blocks.release(seq)
        self._requeue(seqs)

    def finish(self, seq: S) -> None:
        self.running.remove(seq)
        if self.blocks is not None:
            self.blocks.release(seq)
        del self._arrival[id(seq)]

    def drop_waiting(self, predicate: Callable[[S], bool]) -> list[S]:
        dropped = [s for s in self.waiting if predicate(s)]
        for s in dropped:
            self.waiting.remove(s)
            del self._arrival[id(s)]
        return dropped

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

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

Token budget (``max_num_batched_tokens``): a step feeds at most that many tokens, so one
step's activations stay bounded and a long prompt cannot stall the decodes behind it.
``plan_step`` gives every decoding request its one token first, then splits what is left
among prefills, fewest remaining tokens first (chunked prefill: a prompt longer than the
budget takes several steps, its K/V cached chunk by chunk), so a short prompt arriving
behind a 4k-token one starts at the next step instead of after it. A prefill left out for
``max_bypass_steps`` steps in a row goes first: shorter prompts cannot starve a long one.
Admission stops at the first waiting request that would get no token this step (a long
prompt, below, is passed over instead: the shorter requests behind it start). Without a
budget every running request feeds all its uncomputed tokens.

Long prefills (``long_prefill_tokens``): a prompt with more tokens left than that feeds at
most ``long_prefill_chunk_tokens`` (by default the same number) a step, and none in a step that
already prefills another prompt (unless it was left out ``max_bypass_steps`` steps). Why: the budget sets how many short prompts one
step batches (big GEMMs are cheaper per token, so a large budget serves more tokens per
second), while a step's duration is what a request arriving during it waits, and what
every running decode waits for its next token. The cap lets a large budget batch many short
prompts while a long prompt's chunks stay short steps, and a short prompt's first token
never waits behind a long chunk in its own step. A step still feeds at most the budget:
every decode row, then prefill chunks.

Context (``context_span``): a prompt token fed after ``c`` cached ones also attends over them, which
on the CPU costs about ``c / context_span`` of its projections. With a span, a prefill's remaining
tokens count that cost when deciding whether it is long, and a long prompt's chunk is
``long_prefill_chunk_tokens / (1 + c / span)`` tokens: its steps cost about the same from its first
chunk to its last. Why: with chunks of 64 tokens a 4k-token prompt's last chunks took twice its
first (attention over 4k cached tokens), and its last 128 tokens, no longer above the threshold,
went in one step of four times a chunk's cost; a short prompt arriving meanwhile waited for it.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Generic, Hashable, Optional, Protocol, TypeVar


class Schedulable(Protocol):
    uid: Optional[str]
    blocked_steps: int
    num_computed: int    # leading tokens whose K/V are cached (read only with a token budget)

    @property
    def num_tokens(self) -> int: ...


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
                 max_batch_size: int, max_bypass_steps: int = 16, blocks: Optional[BlockSpace] = None,
                 max_num_batched_tokens: Optional[int] = None, long_prefill_tokens: Optional[int] = None,
                 long_prefill_chunk_tokens: Optional[int] = None, context_span: Optional[int] = None):
        """``blocks``: the KV cache's block accounting; None schedules by slots and batch size only.
        ``max_num_batched_tokens``: tokens one step may feed (at least ``max_batch_size``, so every decode
        fits); None: no budget, no chunking. ``long_prefill_tokens``: a prefill with more tokens left is long
        (yielding to other prefills); None: the budget (no prefill is long). ``long_prefill_chunk_tokens``: the
        most tokens a long prefill feeds a step; None: ``long_prefill_tokens``. ``context_span``: cached tokens whose
        attention costs about one fed token's projections (a long prefill's chunk shrinks with its cached context);
        None: the context is not counted."""
        if max_num_batched_tokens is not None and max_num_batched_tokens < max_batch_size:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is below max_batch_size="
                             f"{max_batch_size}: one step must fit every running request's next token")
        if long_prefill_tokens is not None and long_prefill_tokens < 1:
            raise ValueError(f"long_prefill_tokens must be at least 1 (got {long_prefill_tokens})")
        if long_prefill_chunk_tokens is not None and long_prefill_chunk_tokens < 1:
            raise ValueError(f"long_prefill_chunk_tokens must be at least 1 (got {long_prefill_chunk_tokens})")
        if context_span is not None and context_span < 1:
            raise ValueError(f"context_span must be at least 1 (got {context_span})")
        self.long_prefill_tokens = long_prefill_tokens
        self.context_span = context_span
        self.last_chunk_tokens: Optional[int] = None  # the chunk the last plan gave a long prefill (None: no long one)
        self.long_prefill_chunk_tokens = long_prefill_chunk_tokens or long_prefill_tokens
        self.validate_batch = validate_batch
        self.is_pinned = is_pinned
        self.max_batch_size = max_batch_size
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunks = 0  # prefill inputs cut short by the budget (their prompt continues next step)
        self._starved: dict[int, int] = {}  # id(seq) -> steps in a row a running prefill fed no token
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
            if not self._gets_tokens(seq, admitted):
                if self._is_long(seq):
                    continue  # a long prompt waits for the running prefills; shorter ones behind it may start
                break  # FIFO: it would get no token this step, and nobody overtakes it
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

    def _is_long(self, seq: S) -> bool:
        """A prefill with more than ``long_prefill_tokens`` left, counting its attention over the cached context
        with a ``context_span`` (capped a step, yielding to other prefills)."""
        return self.long_prefill_tokens is not None and self._weight(seq) * self._wanted(seq) > self.long_prefill_tokens

    def _weight(self, seq: S) -> float:
        """What feeding one of ``seq``'s tokens costs, in fed tokens at no cached context: ``1 + cached / span``."""
        return 1.0 if self.context_span is None else 1.0 + seq.num_computed / self.context_span

    def _chunk(self, seq: S) -> int:
        """Tokens a long prefill feeds this step: ``long_prefill_chunk_tokens`` over its weight (at least one)."""
        return max(1, int(self.long_prefill_chunk_tokens / self._weight(seq)))

    @staticmethod
    def _wanted(seq: S) -> int:
        """Tokens ``seq`` has yet to feed: 1 while decoding, the uncached prompt (and output) while prefilling."""
        return seq.num_tokens - seq.num_computed

    def _gets_tokens(self, seq: S, admitted: list[S]) -> bool:
        """Whether ``seq``, admitted now, would feed a token this step: the budget left after every decode and
        every prefill ranked before it (fewer tokens to go; its prefix blocks are not looked up yet)."""
        if self.max_num_batched_tokens is None:
            return True
        wanted = self._wanted(seq)
        ahead = 0
        for other in (*self.running, *admitted):
            w = self._wanted(other)
            ahead += 1 if w == 1 else (w if w <= wanted else 0)
        return ahead < self.max_num_batched_tokens

    def plan_step(self) -> list[tuple[S, int]]:
        """(request, tokens it feeds this step) for the running requests that feed any: decodes first, then
        prefill chunks, fewest remaining tokens first (a prefill starved ``max_bypass_steps`` steps first of all),
        until the budget is spent; a long prefill feeds at most its chunk (``_chunk``), and only as the step's
        first prefill (or when starved); a request left out feeds next step."""
        if self.max_num_batched_tokens is None:
            return [(seq, self._wanted(seq)) for seq in self.running]
        by_age = sorted(self.running, key=self._order)
        left = self.max_num_batched_tokens
        plan: list[tuple[S, int]] = []
        for seq in by_age:
            if self._wanted(seq) == 1 and left > 0:
                plan.append((seq, 1))
                left -= 1
        prefills = [seq for seq in by_age if self._wanted(seq) > 1]
        prefills.sort(key=lambda seq: (self._starved.get(id(seq), 0) < self.max_bypass_steps, self._wanted(seq)))
        prefilling = False
        self.last_chunk_tokens = None
        for seq in prefills:
            if left <= 0:
                break
            wanted = self._wanted(seq)
            starved = self._starved.get(id(seq), 0) >= self.max_bypass_steps
            long = self._is_long(seq)
            if long and prefilling and not starved:
                continue  # a long prompt's chunk would lengthen a step that already prefills a shorter prompt
            if long:
                self.last_chunk_tokens = chunk = self._chunk(seq)
                plan.append((seq, min(wanted, left, chunk)))
            else:
                plan.append((seq, min(wanted, left)))
            left -= plan[-1][1]
            prefilling = True
        return plan

    def note_plan(self, plan: list[tuple[S, int]]) -> None:
        """Record the step the engine runs: prefills left out count a starved step; chunks cut short are counted."""
        fed = {id(seq) for seq, _ in plan}
        for seq in self.running:
            if id(seq) in fed or self._wanted(seq) == 1:
                self._starved.pop(id(seq), None)
            else:
                self._starved[id(seq)] = self._starved.get(id(seq), 0) + 1
        self.prefill_chunks += sum(1 for seq, n in plan if n < self._wanted(seq))

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
        self._starved.pop(id(seq), None)

    def drop_waiting(self, predicate: Callable[[S], bool]) -> list[S]:
        dropped = [s for s in self.waiting if predicate(s)]
        for s in dropped:
            self.waiting.remove(s)
            del self._arrival[id(s)]
        return dropped

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

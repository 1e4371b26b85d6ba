"""The engine thread: between steps it runs the pool changes other threads handed it, then one step.

A mixin of ``LoRAEngine`` (engine/engine.py builds the parts; this file runs them). One step:
schedule (admit waiting requests while the batch's adapter set validates), make the batch's
adapters resident (``_prepare_slots``), plan the token budget, one forward, sample, finish.
The engine thread is the only thread that changes the pool's slots: registration, pinning,
unloading and ``load_into_slot`` hand their change to ``at_step_boundary``, so a slot never
changes under a running forward and no extra lock orders them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, TypeVar

import torch

from pool.errors import AdapterNotStagedError, LoRAFleetError, PoolError

from .errors import EngineUnhealthyError
from .logprobs import prompt_logprobs, step_logprobs
from .model_runner import SeqInput
from .output_processor import append_token, next_tokens
from .sample_group import child_of, fork_ready, share_prompt_blocks
from .sequence import Sequence

log = logging.getLogger(__name__)
T = TypeVar("T")
# a step is timed for the prefill rate when its prompt tokens are at least this many: its time is then mostly
# prefill (a decode row costs about one token's prefill), so seconds / prompt tokens is the rate routers price
PREFILL_TIMED_MIN_TOKENS = 128
# ... or a long prompt's chunk (``long_prefill_chunk_tokens``, 64 on the CPU) when the step's decode rows are at most
# this share of its prompt tokens: a CPU engine feeds prompts over 128 tokens in such chunks, never 128 at once
PREFILL_TIMED_TOKENS_PER_DECODE_ROW = 4
STAGING_POLL_S = 0.01
BOUNDARY_WAIT_S = 1.0  # how often a thread waiting on the engine checks that the engine thread still lives


class StepLoop:
    # ------------------------------------------------------------------ between steps

    def at_step_boundary(self, change: Callable[[], T]) -> T:
        """Run ``change`` (a pool change) on the engine thread before its next step; return its result.

        Blocks the caller until then (one step at most). Once the engine has stopped nobody steps,
        so the change runs here, under the step lock, as it would have run there.
        """
        if threading.current_thread() is self._thread:
            return change()
        done: Future = Future()
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._boundary_work.append((change, done))
                self._lock.notify_all()
        if stopped:
            with self._step_lock:
                return change()
        while True:
            try:
                return done.result(timeout=BOUNDARY_WAIT_S)
            except TimeoutError:
                if not self._thread.is_alive() and not done.done():
                    raise EngineUnhealthyError("the engine thread died before it ran this adapter change")

    def _run_boundary_work(self, work: list[tuple[Callable[[], object], Future]]) -> None:
        """Called on the engine thread with the step lock held: each change alone; its error goes to its caller."""
        for change, done in work:
            try:
                done.set_result(change())
            except BaseException as exc:  # the caller's error (a refused pin, a full pool): the loop goes on
                done.set_exception(exc)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not len(self.scheduler) and not self._boundary_work:
                    self._lock.wait()
                work, self._boundary_work = self._boundary_work, []
                stopped = self._stopped
                if not work and not stopped and self.adapters.staging and not self.scheduler.running:
                    self._lock.wait(STAGING_POLL_S)  # the head waits for a file read: do not spin
            if stopped:  # changes handed over before the stop still run (their callers wait); no step does
                with self._step_lock:
                    self._run_boundary_work(work)
                return
            cpu = time.thread_time()
            try:
                with self._step_lock:
                    self._run_boundary_work(work)
                    self._step()
                self.failed_steps_in_row = 0
            except Exception as exc:  # a failed forward must not kill the replica: fail that batch
                self.failed_steps_in_row += 1
                log.exception("engine step failed (%d in a row)", self.failed_steps_in_row)
                with self._lock:
                    for seq in list(self.scheduler.running):
                        self._finish(seq, exc)
            finally:  # what a step costs the host, whatever its batch (benchmarks price steps by it)
                self.engine_cpu_s += time.thread_time() - cpu

    def _prefill_heavy(self, prompt_tokens: int, planned: list, inputs: list) -> bool:
        """Whether a step's time is mostly its prompt tokens' (``PREFILL_TIMED_MIN_TOKENS``)."""
        if prompt_tokens >= PREFILL_TIMED_MIN_TOKENS:
            return True
        # this step's long chunk (smaller after a long cached context, ``Scheduler._chunk``), else the configured one
        chunk = self.scheduler.last_chunk_tokens or self.scheduler.long_prefill_chunk_tokens
        if chunk is None or prompt_tokens < chunk:
            return False
        decode_rows = sum(1 for s, x in zip(planned, inputs) if x.start_pos >= len(s.prompt_ids))
        return prompt_tokens >= PREFILL_TIMED_TOKENS_PER_DECODE_ROW * decode_rows

    def _step(self) -> None:
        with self._lock:
            for seq in [s for s in self.scheduler.running if s.cancel_reason is not None]:
                # a cancel that landed during the last forward cost that one step: never more
                self.max_steps_after_cancel = max(self.max_steps_after_cancel,
                                                  len(seq.output_ids) - seq.tokens_at_cancel)
                self._finish(seq, seq.cancel_reason)
            admitted, _ = self.scheduler.schedule()
        running = list(self.scheduler.running)
        if not running:
            self.pool.release_batch()
            return
        slots = self._prepare_slots(admitted)
        if slots is None:
            return
        plan = self.scheduler.plan_step()
        self.scheduler.note_plan(plan)
        inputs = [SeqInput(seq.block_table, seq.token_at(seq.num_computed, seq.num_computed + n), seq.num_computed,
                           slots[seq.uid], scored=seq.prompt_logprobs is not None) for seq, n in plan]
        started = time.perf_counter()
        logits = self.runner.forward(inputs)
        self.steps += 1
        self.rows_stepped += len(inputs)
        planned = [seq for seq, _ in plan]
        prompt_tokens = sum(max(0, min(len(s.prompt_ids), x.start_pos + len(x.token_ids)) - x.start_pos)
                            for s, x in zip(planned, inputs))
        self.prompt_tokens_computed += prompt_tokens
        self._score_prompts(planned, inputs)  # echo: every row this forward fed, chunks included
        # a prefill cut short by the token budget samples nothing yet: its prompt continues next step
        ends = [seq.num_computed + n == seq.num_tokens for seq, n in plan]
        for seq, n in plan:
            self.blocks.commit(seq, seq.num_computed + n)
        running = [seq for (seq, _), end in zip(plan, ends) if end]
        if len(running) < len(plan):
            rows = [i for i, end in enumerate(ends) if end]
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        running, logits = fork_ready(running, logits, self._fork)
        finished: list[tuple[Sequence, object]] = []
        tokens = next_tokens(logits, running, self.eos_ids, self._grammar)
        if self._prefill_heavy(prompt_tokens, planned, inputs):  # (sampling synchronized the device: the forward is done)
            timed_tokens, timed_s = self.prefill_timed
            self.prefill_timed = (timed_tokens + prompt_tokens, timed_s + time.perf_counter() - started)
        scored = step_logprobs(logits, [s.request.logprobs for s in running], tokens, self.token_texts)
        for seq, token, logprob in zip(running, tokens, scored):
            if token is None:  # a prompt scored, no token asked for
                finished.append((seq, "length"))
                continue
            if isinstance(token, Exception):  # this sequence's sampling failed: it alone fails
                finished.append((seq, token))
                continue
            reason = append_token(seq, token, self.eos_ids, logprob)
            if reason:
                finished.append((seq, reason))
        self.tokens_generated += sum(1 for t in tokens if isinstance(t, int))
        if finished:
            with self._lock:
                for seq, outcome in finished:
                    self._finish(seq, outcome if isinstance(outcome, Exception) else seq.result(outcome))
            self.pool.retain_batch(self.scheduler.running_uids())

    def _score_prompts(self, running: list[Sequence], inputs: list[SeqInput]) -> None:
        """Echo: the prompt tokens this forward fed are scored from its all-token logits (once each)."""
        for i, (seq, x) in enumerate(zip(running, inputs)):
            scored = seq.prompt_logprobs
            if scored is None or len(scored) >= len(seq.prompt_ids) or x.start_pos > max(0, len(scored) - 1):
                continue
            token_logits = self.runner.token_logits(i)
            skip = max(0, len(scored) - 1 - x.start_pos)  # positions already scored before a preemption
            scored += prompt_logprobs(token_logits[skip:], seq.prompt_ids, x.start_pos + skip,
                                      seq.request.prompt_logprobs, self.token_texts)

    def _fork(self, parent: Sequence, index: int) -> Optional[Sequence]:
        """Sample ``index`` of ``parent``'s request: in this step's batch with shared prompt blocks when
        there is room, else queued as a plain sequence (None)."""
        child = child_of(parent, index, self._sequence)
        with self._lock:
            self.adapters.acquire(child.uid)
            room = len(self.scheduler.running) < self.config.max_batch_size
            if room and share_prompt_blocks(parent, child, self.cache):
                self.scheduler.add_running(child)
                return child
            self.scheduler.add(child)
            return None

    def _prepare_slots(self, admitted: list[Sequence]) -> Optional[dict]:
        """Slots for this step's adapters; newly admitted requests whose adapter fails to load are failed alone."""
        while True:
            uids = self.scheduler.running_uids()
            try:
                return self.pool.prepare_lora_batch(uids)
            except LoRAFleetError as exc:
                culprits = [s for s in admitted if s.uid is not None and not self.pool.is_resident(s.uid)]
                if not culprits:
                    raise
                with self._lock:
                    if isinstance(exc, PoolError):
                        # the pool changed since admission (a pin took a slot), or the host tier dropped
                        # the adapter: wait again, first in line (staging it off this thread)
                        for seq in culprits:
                            admitted.remove(seq)
                        self.scheduler.requeue_front(culprits)
                        if isinstance(exc, AdapterNotStagedError):
                            self.adapters.stage_in_background(exc.uid)
                    else:  # the adapter itself failed to load: fail those requests alone
                        for seq in culprits:
                            self._finish(seq, exc)
                            admitted.remove(seq)
                if not self.scheduler.running:
                    self.pool.release_batch()
                    return None

    # ------------------------------------------------------------------ ending requests

    def _cancel_uid(self, uid: str, error: Exception) -> None:
        """Fail ``uid``'s waiting requests now; running ones end at the next step."""
        with self._lock:
            for seq in self.scheduler.drop_waiting(lambda s: s.uid == uid):
                self._end(seq, error)
            for seq in self.scheduler.running:
                if seq.uid == uid:
                    seq.cancel_reason, seq.tokens_at_cancel = error, len(seq.output_ids)
            self._lock.notify_all()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _finish(self, seq: Sequence, outcome) -> None:
        """Called with ``_lock`` held: free the KV blocks, settle the caller, wake drains."""
        if seq in self.scheduler.running:
            self.scheduler.finish(seq)
        self._end(seq, outcome)

    def _end(self, seq: Sequence, outcome) -> None:
        self.adapters.release(seq.uid)
        seq.sink(outcome)

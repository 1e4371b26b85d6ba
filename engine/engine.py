"""LoRAEngine: base model + LoRA pool + scheduler, generating on a background thread.

One thread owns the model and steps the batch (prefill for new requests and decode for
running ones in one forward); callers submit requests from any thread or event loop and
receive tokens through a sink. Adapter registration reads and validates files on the
caller's thread, so unrelated adapters load concurrently and never stall generation.
Around the loop: ``AdapterRegistry`` (names, in-flight counts, drain), ``InputProcessor``
(validation, tokenization), ``callers`` (async and blocking bridges), ``live_settings``.
"""

from __future__ import annotations

import logging
import threading
from typing import AsyncIterator, Callable, Iterable, Optional

import torch

from pool.errors import AdapterNotStagedError, LoRAFleetError, PoolError
from pool.memory_pool import LoRAMemoryPool
from pool.shapes import LoRAModelShape
from pool.store import AdapterRecord, AdapterStore

from . import callers
from .activation_profile import activation_reserve_bytes
from .adapter_manager import AdapterManager
from .adapter_staging import AdapterStaging
from .adapter_registry import AdapterRegistry
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .fast_paths import choose_fast_paths
from .errors import EngineOverloadedError, EngineShutdownError, EngineUnhealthyError, RequestCancelledError
from .input_processor import InputProcessor
from .block_manager import BlockManager
from .kv_setup import build_kv_cache, fit_max_model_len, token_budget
from .live_settings import apply_live_settings
from .lora_layers import LoRABatchContext, attach_lora
from .model_loader import load_base_model
from .model_runner import ModelRunner, SeqInput
from .grammar import GrammarCompiler
from .logprobs import TokenTexts, prompt_logprobs, step_logprobs
from .output_processor import append_token, eos_token_ids, next_tokens
from .request import GenerateRequest, GenerateResult, TokenDelta
from .read_api import EngineReadAPI
from .sample_group import SampleGroup, child_of, fork_ready, share_prompt_blocks
from .scheduler import Scheduler
from .sequence import Sequence, SinkItem
from .tuning import EngineTuning

log = logging.getLogger(__name__)
STAGING_POLL_S = 0.01


class LoRAEngine(EngineReadAPI):
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, tuning: Optional[EngineTuning] = None):
        """``tuning``: which fast paths to try (each is checked against torch here, before anything is served)."""
        self.config = config
        self.tuning = tuning or EngineTuning()
        if model is None:
            model, tokenizer, _ = load_base_model(config.base_model, dtype=config.dtype, device=config.device,
                                                  revision=config.revision)
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        mc = model.config
        self.shape = LoRAModelShape.from_hf_config(mc, config.target_modules)
        max_model_len = config.max_model_len or min(getattr(mc, "max_position_embeddings", 2048), 2048)
        self._lock = threading.Condition()  # scheduler queues, stop flag
        self.store = AdapterStore(self.shape, config.max_lora_rank, dtype=self.dtype,
                                  host_cache_bytes=config.host_cache_bytes,
                                  allowed_roots=config.adapter_roots, hub_orgs=config.hub_orgs,
                                  object_store_prefixes=config.object_store_prefixes,
                                  adapter_cache_dir=config.adapter_cache_dir)
        self.staging = AdapterStaging(self.store, on_failure=lambda uid, exc: self._cancel(uid, exc),
                                      on_done=self._wake)
        self.pool = LoRAMemoryPool(self.shape, config.max_loras_per_batch, config.max_lora_rank, self.staging.slot_weights,
                                   eviction_policy=config.eviction_policy, device=self.device, dtype=self.dtype,
                                   replica_id=config.replica_id)
        self.context = LoRABatchContext()
        attach_lora(model, self.pool, self.context)
        self.context.target_programs = self.tuning.lora_target_programs
        self.fast_paths = choose_fast_paths(model, self.pool, self.device, self.dtype, self.tuning)
        backend, kernels = self.fast_paths["attention"].used, self.fast_paths["lora_kernels"].fast
        self.max_num_batched_tokens = token_budget(config, self.device)
        reserve = 0 if config.kv_cache_bytes is not None else activation_reserve_bytes(
            model, self.pool, self.context, config, self.device, self.dtype, self.max_num_batched_tokens,
            backend=backend, lora_kernels=kernels)
        self.cache = build_kv_cache(model, config, self.device, self.dtype, max_model_len, reserve_bytes=reserve,
                                    backend=backend)
        self.max_model_len = fit_max_model_len(self.cache, max_model_len, configured=config.max_model_len is not None)
        self.runner = ModelRunner(model, self.pool, self.cache, self.context, lora_kernels=kernels)
        self.blocks = BlockManager(self.cache)
        self.scheduler: Scheduler[Sequence] = Scheduler(
            self.pool.validate_lora_batch, lambda uid: uid in self.pool.pinned,
            config.max_batch_size, config.max_bypass_steps, blocks=self.blocks,
            max_num_batched_tokens=self.max_num_batched_tokens)
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0  # prompt tokens fed to forwards (an n > 1 prompt counts once)
        self.token_texts = TokenTexts(tokenizer)
        self._grammar: Optional[GrammarCompiler] = None  # built at the first response_format request
        self._grammar_lock = threading.Lock()
        self.steps = 0
        self.cancelled = 0            # sequences dropped because their caller went away
        self.max_steps_after_cancel = 0  # the most steps any sequence ran after its cancel (the goal: <= 1)
        self.failed_steps_in_row = 0  # consecutive failed steps; MAX_FAILED_STEPS makes the replica unhealthy
        self._step_lock = threading.Lock()  # one step, or one unload, at a time
        self.registry = AdapterRegistry()
        self.adapter_manager = AdapterManager(self.store, self.pool, self.registry, step_lock=self._step_lock,
                                       running_uids=self.scheduler.running_uids, cancel=self._cancel)
        self.inputs = InputProcessor(tokenizer, mc.vocab_size, self.max_model_len, config, self.registry)
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"lorafleet-engine-{config.replica_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ adapters

    def register_adapter(self, name: str, source: str, *, revision: Optional[str] = None,
                         uid: Optional[str] = None, pinned: bool = False) -> AdapterRecord:
        """Read, validate and host-cache an adapter under ``name`` (see ``AdapterManager.register``)."""
        return self.adapter_manager.register(name, source, revision=revision, uid=uid, pinned=pinned)

    def unregister_adapter(self, name: str, timeout_s: float = 30.0) -> str:
        """Refuse new requests for ``name`` at once, drain its requests, then unload it. Returns the uid."""
        return self.adapter_manager.unregister(name, timeout_s)

    def unregister_uid(self, uid: str, timeout_s: float = 30.0) -> bool:
        """Retire the registration ``uid`` (drain, then unload); a newer uid of the same name is untouched."""
        return self.adapter_manager.unregister_uid(uid, timeout_s)

    def pin_adapter(self, name: str) -> int:
        return self.adapter_manager.pin(name)

    def unpin_adapter(self, name: str) -> bool:
        return self.adapter_manager.unpin(name)

    def keep_adapters(self, uids: Iterable[str]) -> None:
        """Evict these last (``LoRAMemoryPool.keep``): the placement plan's adapters on this replica."""
        self.pool.keep(uids)

    def validate_adapter_files(self, uid: str, source: str, *, name: str,
                               revision: Optional[str] = None) -> AdapterRecord:
        """Read and validate an adapter as registration would, keeping nothing."""
        return self.adapter_manager.validate_files(uid, source, name=name, revision=revision)

    def fetch_to_host(self, uid: str) -> None:
        """Bring a registered adapter into the host tier (a file read), so its slot load is a memory copy."""
        self.store.fetch(uid)

    def _cancel(self, uid: str, error: Exception) -> None:
        """Fail ``uid``'s waiting requests now; running ones end at the next step."""
        with self._lock:
            for seq in self.scheduler.drop_waiting(lambda s: s.uid == uid):
                self._end(seq, error)
            for seq in self.scheduler.running:
                if seq.uid == uid:
                    seq.cancel_reason, seq.tokens_at_cancel = error, len(seq.output_ids)
            self._lock.notify_all()

    # ------------------------------------------------------------------ requests

    @property
    def grammar(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
            return self._grammar

    def _sequence(self, request: GenerateRequest, uid: Optional[str], ids: list[int], sink) -> Sequence:
        seq = Sequence(request, uid, ids, IncrementalDetokenizer(self.tokenizer, request.stop_strings), sink,
                       self.device)
        if request.response_format is not None:
            grammar = self.grammar.compile(request.response_format)  # cached: compiled at submission
            seq.matcher = None if grammar is None else self.grammar.matcher(grammar)
        return seq

    def submit(self, request: GenerateRequest, sink: Callable[[SinkItem], None]) -> Sequence:
        uid, ids = self.inputs.process(request)
        group = None
        if request.n > 1:
            group = SampleGroup(request.n, sink, self.cancel)
            sink = group.sink_for(0)
        seq = self._sequence(request, uid, ids, sink)
        if seq.prompt_logprobs is not None:
            seq.prompt_text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if group is not None:
            seq.group = group
            group.members.append(seq)
        if uid is not None and not self.pool.is_resident(uid):
            self.staging.stage(uid)  # a file read, if the host tier dropped it: here, never on the engine thread
        with self._lock:
            if self._stopped:
                raise EngineShutdownError("the engine is shutting down")
            if not self.healthy():
                raise EngineUnhealthyError(f"{self.failed_steps_in_row} engine steps failed in a row on this replica")
            if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
                raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are waiting on this replica "
                                            f"(limit {self.config.max_waiting_requests}); retry later")
            self.registry.acquire(request.adapter, uid)
            self.scheduler.add(seq)
            self._lock.notify_all()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop ``seq``: a waiting one never runs; a running one frees its KV blocks and slot at the next step."""
        error = RequestCancelledError(f"request {seq.request.request_id} was cancelled by its caller")
        if seq.group is not None and seq.choice_index == 0:  # the caller holds the first sample: cancel all
            for member in list(seq.group.members[1:]):
                self._cancel_one(member, error)
        self._cancel_one(seq, error)

    def _cancel_one(self, seq: Sequence, error: BaseException) -> None:
        with self._lock:
            if seq.cancel_reason is not None:
                return
            if self.scheduler.drop_waiting(lambda s: s is seq):
                self._end(seq, error)
            elif seq in self.scheduler.running:
                seq.cancel_reason, seq.tokens_at_cancel = error, len(seq.output_ids)
            else:
                return  # already finished
            self.cancelled += 1
            self._lock.notify_all()

    def generate_stream(self, request: GenerateRequest,
                        with_result: bool = False) -> AsyncIterator[TokenDelta | GenerateResult]:
        """Token deltas as they are produced (the last carries the finish reason), then the result if asked."""
        return callers.stream(self.submit, self.cancel, request, with_result)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await callers.result(self.submit, self.cancel, request)

    def generate_blocking(self, request: GenerateRequest, timeout_s: float = 120.0) -> GenerateResult:
        """For scripts and benchmarks without an event loop."""
        return callers.blocking(self.submit, request, timeout_s)

    def apply_settings(self, settings: dict) -> None:
        """Change settings without a restart; all are checked before any is applied."""
        apply_live_settings(settings, config=self.config, pool=self.pool, scheduler=self.scheduler,
                            kv_blocks=self.cache.num_blocks)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        self._thread.join(timeout=10)
        error = EngineShutdownError("the engine shut down")
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            seq.sink(error)
        if not self._thread.is_alive():
            self.cache.release()  # the KV cache is most of a replica's GPU memory: free it now, not at the next GC

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not len(self.scheduler):
                    self._lock.wait()
                if self._stopped:
                    return
                if self.staging.busy and not self.scheduler.running:
                    self._lock.wait(STAGING_POLL_S)  # the head waits for a file read: do not spin
            try:
                with self._step_lock:
                    self._step()
                self.failed_steps_in_row = 0
            except Exception as exc:  # a failed forward must not kill the replica: fail that batch
                self.failed_steps_in_row += 1
                log.exception("engine step failed (%d in a row)", self.failed_steps_in_row)
                with self._lock:
                    for seq in list(self.scheduler.running):
                        self._finish(seq, exc)

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
                           slots[seq.uid]) for seq, n in plan]
        logits = self.runner.forward(inputs)
        self.steps += 1
        planned = [seq for seq, _ in plan]
        self.prompt_tokens_computed += sum(max(0, min(len(s.prompt_ids), x.start_pos + len(x.token_ids)) - x.start_pos)
                                           for s, x in zip(planned, inputs))
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
            self.registry.acquire(child.request.adapter, child.uid)
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
                            self.staging.stage_in_background(exc.uid)
                    else:  # the adapter itself failed to load: fail those requests alone
                        for seq in culprits:
                            self._finish(seq, exc)
                            admitted.remove(seq)
                if not self.scheduler.running:
                    self.pool.release_batch()
                    return None

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _finish(self, seq: Sequence, outcome) -> None:
        """Called with ``_lock`` held: free the KV blocks, settle the caller, wake drains."""
        if seq in self.scheduler.running:
            self.scheduler.finish(seq)
        self._end(seq, outcome)

    def _end(self, seq: Sequence, outcome) -> None:
        self.registry.release(seq.uid)
        seq.sink(outcome)

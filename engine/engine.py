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
from typing import AsyncIterator, Callable, Optional

from pool.errors import LoRAFleetError, PoolError
from pool.events import PoolSnapshot
from pool.host_cache import HostAdapterCache
from pool.memory_pool import EventListener, LoRAMemoryPool
from pool.shapes import LoRAModelShape
from pool.store import AdapterRecord, AdapterStore

from . import callers
from .adapter_manager import AdapterManager
from .adapter_registry import AdapterRegistry
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .errors import EngineShutdownError
from .input_processor import InputProcessor
from .kv_cache import KVCache
from .live_settings import apply_live_settings
from .lora_layers import LoRABatchContext, attach_lora
from .model_loader import load_base_model
from .model_runner import ModelRunner, SeqInput
from .output_processor import append_token, eos_token_ids, next_tokens
from .request import GenerateRequest, GenerateResult, TokenDelta
from .scheduler import Scheduler
from .sequence import Sequence, SinkItem

log = logging.getLogger(__name__)


class LoRAEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None):
        self.config = config
        if model is None:
            model, tokenizer, _ = load_base_model(config.base_model, dtype=config.dtype, device=config.device,
                                                  revision=config.revision)
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        mc = model.config
        self.shape = LoRAModelShape.from_hf_config(mc, config.target_modules)
        self.max_model_len = config.max_model_len or min(getattr(mc, "max_position_embeddings", 2048), 2048)
        self.store = AdapterStore(self.shape, config.max_lora_rank, dtype=self.dtype,
                                  host_cache_bytes=config.host_cache_bytes,
                                  allowed_roots=config.adapter_roots, hub_orgs=config.hub_orgs,
                                  object_store_prefixes=config.object_store_prefixes,
                                  adapter_cache_dir=config.adapter_cache_dir)
        self.pool = LoRAMemoryPool(self.shape, config.max_loras_per_batch, config.max_lora_rank, self.store.fetch,
                                   eviction_policy=config.eviction_policy, device=self.device, dtype=self.dtype,
                                   replica_id=config.replica_id)
        self.context = LoRABatchContext()
        attach_lora(model, self.pool, self.context)
        attn = model.model.layers[0].self_attn
        self.cache = KVCache(len(model.model.layers), config.max_batch_size, self.max_model_len,
                             attn.k_proj.weight.shape[0] // attn.head_dim, attn.head_dim,
                             device=self.device, dtype=self.dtype)
        self.runner = ModelRunner(model, self.pool, self.cache, self.context)
        self.scheduler: Scheduler[Sequence] = Scheduler(
            self.pool.validate_lora_batch, lambda uid: uid in self.pool.pinned,
            config.max_batch_size, config.max_bypass_steps)
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.tokens_generated = 0
        self.steps = 0
        self._lock = threading.Condition()  # scheduler queues, stop flag
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

    def pin_adapter(self, name: str) -> int:
        return self.adapter_manager.pin(name)

    def unpin_adapter(self, name: str) -> bool:
        return self.adapter_manager.unpin(name)

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
                    seq.cancel_reason = error
            self._lock.notify_all()

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenerateRequest, sink: Callable[[SinkItem], None]) -> Sequence:
        uid, ids = self.inputs.process(request)
        seq = Sequence(request, uid, ids, IncrementalDetokenizer(self.tokenizer, request.stop_strings), sink,
                       self.device)
        with self._lock:
            if self._stopped:
                raise EngineShutdownError("the engine is shutting down")
            self.registry.acquire(request.adapter, uid)
            self.scheduler.add(seq)
            self._lock.notify_all()
        return seq

    def generate_stream(self, request: GenerateRequest,
                        with_result: bool = False) -> AsyncIterator[TokenDelta | GenerateResult]:
        """Token deltas as they are produced (the last carries the finish reason), then the result if asked."""
        return callers.stream(self.submit, request, with_result)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await callers.result(self.submit, request)

    def generate_blocking(self, request: GenerateRequest, timeout_s: float = 120.0) -> GenerateResult:
        """For scripts and benchmarks without an event loop."""
        return callers.blocking(self.submit, request, timeout_s)

    # ------------------------------------------------------------------ what a replica reports

    def current_uid(self, name: str) -> Optional[str]:
        return self.registry.current_uid(name)

    def is_resident(self, uid: str) -> bool:
        return self.pool.is_resident(uid)

    def host_cached(self, uid: str) -> bool:
        return uid in self.store.host_cache

    def host_cached_uids(self) -> list[str]:
        return self.store.host_cache.uids()

    def pinned_uids(self) -> frozenset[str]:
        return frozenset(self.pool.pinned)

    def pool_snapshot(self) -> PoolSnapshot:
        return self.pool.snapshot()

    def subscribe_pool_events(self, listener: EventListener) -> None:
        """``listener`` gets every pool event, in order, on the thread that caused it: keep it quick."""
        self.pool.subscribe(listener)

    def pool_metrics_sources(self) -> tuple[LoRAMemoryPool, HostAdapterCache]:
        """What metrics exporters read (counters, recent load times, host-tier stats); not for changing."""
        return self.pool, self.store.host_cache

    def queue_len(self) -> int:
        """Requests waiting or running."""
        with self._lock:
            return len(self.scheduler)

    def healthy(self) -> bool:
        """The step thread is alive (a failed step fails its batch, not the thread)."""
        return self._thread.is_alive()

    def stats(self) -> dict:
        with self._lock:
            return {
                "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running),
                "tokens_generated": self.tokens_generated,
                "steps": self.steps,
                "adapters": self.registry.names(),
                "host_cached": self.store.host_cache.uids(),
                "host_cache_bytes": self.store.host_cache.stats.bytes_used,
            }

    def apply_settings(self, settings: dict) -> None:
        """Change settings without a restart; all are checked before any is applied."""
        apply_live_settings(settings, config=self.config, pool=self.pool, scheduler=self.scheduler,
                            kv_rows=self.cache.max_rows)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        self._thread.join(timeout=10)
        error = EngineShutdownError("the engine shut down")
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            seq.sink(error)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not len(self.scheduler):
                    self._lock.wait()
                if self._stopped:
                    return
            try:
                with self._step_lock:
                    self._step()
            except Exception as exc:  # a failed forward must not kill the replica: fail that batch
                log.exception("engine step failed")
                with self._lock:
                    for seq in list(self.scheduler.running):
                        self._finish(seq, exc)

    def _step(self) -> None:
        with self._lock:
            for seq in [s for s in self.scheduler.running if s.cancel_reason is not None]:
                self._finish(seq, seq.cancel_reason)
            admitted = self.scheduler.admit()
        for seq in admitted:
            seq.row = self.cache.allocate()
        running = list(self.scheduler.running)
        if not running:
            self.pool.release_batch()
            return
        slots = self._prepare_slots(admitted)
        if slots is None:
            return
        running = list(self.scheduler.running)
        inputs = []
        for seq in running:
            ids, start = seq.next_input()
            inputs.append(SeqInput(seq.row, ids, start, slots[seq.uid]))
        logits = self.runner.forward(inputs)
        self.steps += 1
        finished: list[tuple[Sequence, str]] = []
        for seq, token in zip(running, next_tokens(logits, running)):
            reason = append_token(seq, token, self.eos_ids)
            if reason:
                finished.append((seq, reason))
        self.tokens_generated += len(running)
        if finished:
            with self._lock:
                for seq, reason in finished:
                    self._finish(seq, seq.result(reason))
            self.pool.retain_batch(self.scheduler.running_uids())

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
                        # the pool changed since admission (a pin took a slot): wait again, first in line
                        for seq in culprits:
                            self.cache.release(seq.row)
                            seq.row = None
                            admitted.remove(seq)
                        self.scheduler.requeue_front(culprits)
                    else:  # the adapter itself failed to load: fail those requests alone
                        for seq in culprits:
                            self._finish(seq, exc)
                            admitted.remove(seq)
                if not self.scheduler.running:
                    self.pool.release_batch()
                    return None

    def _finish(self, seq: Sequence, outcome) -> None:
        """Called with ``_lock`` held: free the row, settle the caller, wake drains."""
        if seq in self.scheduler.running:
            self.scheduler.finish(seq)
        if seq.row is not None:
            self.cache.release(seq.row)
            seq.row = None
        self._end(seq, outcome)

    def _end(self, seq: Sequence, outcome) -> None:
        self.registry.release(seq.uid)
        seq.sink(outcome)

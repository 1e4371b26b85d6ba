"""LoRAEngine: base model + LoRA pool + scheduler, generating on a background thread.

One thread owns the model and steps the batch (prefill for new requests and decode for
running ones in one forward); callers submit requests from any thread or event loop and
receive tokens through a sink. Adapter registration reads and validates files on the
caller's thread, so unrelated adapters load concurrently and never stall generation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from typing import AsyncIterator, Callable, Optional


from pool.errors import AdapterNotFoundError, LoRAFleetError, PoolError
from pool.memory_pool import LoRAMemoryPool
from pool.shapes import LoRAModelShape
from pool.store import AdapterRecord, AdapterStore

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .errors import AdapterExistsError, AdapterUnregisteredError, EngineShutdownError, InvalidRequestError
from .kv_cache import KVCache
from .lora_layers import LoRABatchContext, attach_lora
from .model_loader import load_base_model
from .model_runner import ModelRunner, SeqInput
from .request import GenerateRequest, GenerateResult, TokenDelta
from .sampling import sample_next_token
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
                                  allowed_roots=config.adapter_roots, hub_orgs=config.hub_orgs)
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
        self.eos_ids = self._eos_ids()
        self.adapters: dict[str, str] = {}            # name -> current uid
        self.records: dict[str, AdapterRecord] = {}   # uid -> record
        self.inflight: Counter = Counter()            # uid -> waiting + running requests
        self.tokens_generated = 0
        self.steps = 0
        self._lock = threading.Condition()
        self._step_lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"lorafleet-engine-{config.replica_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ adapters

    def register_adapter(self, name: str, source: str, *, revision: Optional[str] = None,
                         uid: Optional[str] = None, pinned: bool = False) -> AdapterRecord:
        """Read, validate and host-cache an adapter under ``name``; errors leave nothing behind.

        Re-registering a name with a new uid retires the old uid once its requests finish.
        """
        with self._lock:
            current = self.adapters.get(name)
        if current is not None and (uid is None or uid == current):
            record = self.records[current]
            if record.source == source and record.revision == revision:
                if pinned:
                    self.pool.pin(current)
                return record
            if uid is None:
                raise AdapterExistsError(f"adapter {name!r} is already registered from {record.source!r}")
        uid = uid or f"{name}@{uuid.uuid4().hex[:8]}"
        record = self.store.register(uid, source, name=name, revision=revision)
        if pinned:
            try:
                self.pool.pin(uid)
            except LoRAFleetError:
                self.store.unregister(uid)
                raise
        with self._lock:
            old = self.adapters.get(name)
            self.adapters[name] = uid
            self.records[uid] = record
        if old is not None and old != uid:
            threading.Thread(target=self._retire, args=(old, 60.0), daemon=True).start()
        return record

    def unregister_adapter(self, name: str, timeout_s: float = 30.0) -> str:
        """Refuse new requests for ``name`` at once, drain its requests, then unload it. Returns the uid."""
        with self._lock:
            uid = self.adapters.pop(name, None)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        self._retire(uid, timeout_s)
        return uid

    def resolve_uid(self, name: Optional[str]) -> Optional[str]:
        if name is None:
            return None
        with self._lock:
            uid = self.adapters.get(name)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        return uid

    def pin_adapter(self, name: str) -> int:
        return self.pool.pin(self.resolve_uid(name))

    def unpin_adapter(self, name: str) -> bool:
        uid = self.resolve_uid(name)
        if uid not in self.pool.pinned:
            return False
        return self.pool.unpin(uid)

    def _retire(self, uid: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.inflight[uid] > 0 and time.monotonic() < deadline:
                self._lock.wait(timeout=max(0.0, deadline - time.monotonic()))
            if self.inflight[uid] > 0:
                error = AdapterUnregisteredError(f"adapter uid {uid!r} was unregistered; its requests were cancelled "
                                                 f"after {timeout_s:.0f}s")
                for seq in self.scheduler.drop_waiting(lambda s: s.uid == uid):
                    self._end(seq, error)
                for seq in self.scheduler.running:
                    if seq.uid == uid:
                        seq.cancel_reason = error
                self._lock.notify_all()
                while self.inflight[uid] > 0:
                    self._lock.wait(timeout=1.0)
            self.inflight.pop(uid, None)
        with self._step_lock:
            self.pool.retain_batch(self.scheduler.running_uids())
            self.pool.remove(uid)
            self.store.unregister(uid)
            with self._lock:
                self.records.pop(uid, None)

    # ------------------------------------------------------------------ requests

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.token_ids is not None:
            ids = list(request.token_ids)
            vocab = self.model.config.vocab_size
            if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
                raise InvalidRequestError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        elif request.messages is not None:
            if not request.messages:
                raise InvalidRequestError("messages", "messages must not be empty")
            try:
                ids = self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # jinja errors: a role the template refuses, a bad field
                raise InvalidRequestError("messages", f"messages do not fit the chat template: {exc}") from exc
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt) if request.prompt else []
        else:
            raise InvalidRequestError("prompt", "one of prompt, token_ids or messages is required")
        if not ids or (request.prompt is not None and not request.prompt):
            raise InvalidRequestError("prompt", "prompt must not be empty")
        return ids

    def validate(self, request: GenerateRequest) -> tuple[Optional[str], list[int]]:
        """(uid, prompt ids), or a clear error before any work is done."""
        if not isinstance(request.max_tokens, int) or request.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        if request.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequestError("max_tokens", f"max_tokens {request.max_tokens} exceeds this server's limit "
                                                    f"{self.config.max_tokens_limit}")
        if request.temperature < 0:
            raise InvalidRequestError("temperature", f"temperature must be >= 0, got {request.temperature}")
        if not 0 < request.top_p <= 1:
            raise InvalidRequestError("top_p", f"top_p must be in (0, 1], got {request.top_p}")
        uid = self.resolve_uid(request.adapter)
        ids = self._prompt_ids(request)
        if len(ids) + request.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the context "
                              f"window of {self.max_model_len} tokens")
        return uid, ids

    def submit(self, request: GenerateRequest, sink: Callable[[SinkItem], None]) -> Sequence:
        uid, ids = self.validate(request)
        seq = Sequence(request, uid, ids, IncrementalDetokenizer(self.tokenizer, request.stop_strings), sink,
                       self.device)
        with self._lock:
            if self._stopped:
                raise EngineShutdownError("the engine is shutting down")
            if request.adapter is not None and self.adapters.get(request.adapter) != uid:
                raise AdapterNotFoundError(f"adapter {request.adapter!r} is not registered")
            self.inflight[uid] += 1
            self.scheduler.add(seq)
            self._lock.notify_all()
        return seq

    async def generate_stream(self, request: GenerateRequest,
                              with_result: bool = False) -> AsyncIterator[TokenDelta | GenerateResult]:
        """Token deltas as they are produced (the last carries the finish reason), then the result if asked."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(request, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, GenerateResult):
                if with_result:
                    yield item
                return
            yield item

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def sink(item: SinkItem) -> None:
            if isinstance(item, TokenDelta):
                return
            def settle():
                if future.done():
                    return
                if isinstance(item, BaseException):
                    future.set_exception(item)
                else:
                    future.set_result(item)
            loop.call_soon_threadsafe(settle)

        self.submit(request, sink)
        return await future

    def generate_blocking(self, request: GenerateRequest, timeout_s: float = 120.0) -> GenerateResult:
        """For scripts and benchmarks without an event loop."""
        done = threading.Event()
        box: list = []

        def sink(item: SinkItem) -> None:
            if not isinstance(item, TokenDelta):
                box.append(item)
                done.set()

        self.submit(request, sink)
        if not done.wait(timeout_s):
            raise TimeoutError(f"request {request.request_id} did not finish in {timeout_s}s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    # ------------------------------------------------------------------ live settings

    LIVE_SETTINGS = ("eviction_policy", "max_batch_size", "max_tokens_limit")

    def apply_settings(self, settings: dict) -> None:
        """Change settings without a restart; all are checked before any is applied."""
        from pool.eviction import get_eviction_policy

        unknown = sorted(set(settings) - set(self.LIVE_SETTINGS))
        if unknown:
            raise ValueError(f"not live-changeable: {unknown}; live settings are {list(self.LIVE_SETTINGS)}")
        policy = get_eviction_policy(settings["eviction_policy"]) if "eviction_policy" in settings else None
        size = settings.get("max_batch_size")
        if size is not None and not 1 <= int(size) <= self.cache.max_rows:
            raise ValueError(f"max_batch_size must be in [1, {self.cache.max_rows}] (the KV rows allocated), "
                             f"got {size}")
        limit = settings.get("max_tokens_limit")
        if limit is not None and int(limit) < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {limit}")
        if policy is not None:
            self.pool.set_eviction_policy(policy)
        if size is not None:
            self.scheduler.max_batch_size = int(size)
        if limit is not None:
            self.config.max_tokens_limit = int(limit)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        with self._lock:
            return {
                "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running),
                "tokens_generated": self.tokens_generated,
                "steps": self.steps,
                "adapters": dict(self.adapters),
                "host_cached": self.store.host_cache.uids(),
                "host_cache_bytes": self.store.host_cache.stats.bytes_used,
            }

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
        greedy = logits.argmax(dim=-1).tolist()  # one device sync for the whole batch
        for i, seq in enumerate(running):
            req = seq.request
            token = greedy[i] if req.temperature == 0 else sample_next_token(logits[i], req.temperature, req.top_p,
                                                                              seq.generator)
            seq.output_ids.append(token)
            self.tokens_generated += 1
            if token in self.eos_ids:
                text, stopped = seq.detokenizer.finish(), True
            else:
                text, stopped = seq.detokenizer.add(seq.output_ids)
            reason = "stop" if stopped else ("length" if len(seq.output_ids) >= req.max_tokens else None)
            if reason == "length":
                text += seq.detokenizer.finish()
            seq.sink(TokenDelta(req.request_id, token, text, reason))
            if reason:
                finished.append((seq, reason))
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
        self.inflight[seq.uid] -= 1
        seq.sink(outcome)
        self._lock.notify_all()

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return ids

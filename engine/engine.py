"""LoRAEngine: base model + LoRA pool + scheduler, generating on a background thread.

One thread owns the model and the pool and steps the batch (prefill for new requests and
decode for running ones in one forward); callers submit requests from any thread or event
loop and receive tokens through a sink. This file builds the parts and is the engine's API;
``step_loop`` runs the thread, ``adapters`` is every adapter's life on the replica (register,
stage, ``load_into_slot``, retire), ``read_api`` what the worker reads, ``InputProcessor``
checks requests, ``callers`` bridges async and blocking callers, ``live_settings`` changes
settings without a restart.
"""

from __future__ import annotations

import threading
from typing import AsyncIterator, Callable, Iterable, Optional

from pool.memory_pool import LoRAMemoryPool
from pool.shapes import LoRAModelShape
from pool.store import AdapterRecord, AdapterStore

from . import callers
from .activation_profile import activation_reserve_bytes
from .adapters import ReplicaAdapters
from .block_manager import BlockManager
from .config import EngineConfig
from .cpu_gemm import onednn_linear
from .detokenizer import IncrementalDetokenizer
from .errors import EngineOverloadedError, EngineShutdownError, EngineUnhealthyError, RequestCancelledError
from .fast_paths import capture_decode_graphs, choose_fast_paths
from .grammar import GrammarCompiler
from .input_processor import InputProcessor
from .kv_setup import (build_kv_cache, context_span, fit_max_model_len, long_prefill_cap, long_prefill_chunk,
                       token_budget)
from .live_settings import apply_live_settings
from .logprobs import TokenTexts
from .lora_layers import LoRABatchContext, attach_lora
from .model_loader import load_base_model
from .model_runner import ModelRunner
from .openmp_team import release_thread_team
from .output_processor import eos_token_ids
from .read_api import EngineReadAPI
from .request import GenerateRequest, GenerateResult, TokenDelta
from .sample_group import SampleGroup
from .scheduler import Scheduler
from .sequence import Sequence, SinkItem
from .step_loop import StepLoop
from .tuning import EngineTuning


class LoRAEngine(StepLoop, EngineReadAPI):
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
                                  adapter_cache_dir=config.adapter_cache_dir,
                                  adapter_cache_bytes=config.adapter_cache_bytes)
        # the pool's slot loads read weights through the adapters object (built below, once the
        # scheduler exists): a memory copy from the host tier, never a file read
        self.pool = LoRAMemoryPool(self.shape, config.max_loras_per_batch, config.max_lora_rank,
                                   lambda uid: self.adapters.slot_weights(uid),
                                   eviction_policy=config.eviction_policy, device=self.device, dtype=self.dtype,
                                   replica_id=config.replica_id)
        self.context = LoRABatchContext()
        attach_lora(model, self.pool, self.context)
        self.context.target_programs = self.tuning.lora_target_programs
        self.fast_paths = choose_fast_paths(model, self.pool, self.device, self.dtype, self.tuning)
        backend, kernels = self.fast_paths["attention"].used, self.fast_paths["lora_kernels"].fast
        if self.fast_paths["cpu_gemm"].fast:
            self.context.base_linear = onednn_linear
        self.max_num_batched_tokens = token_budget(config, self.device)
        reserve = 0 if config.kv_cache_bytes is not None else activation_reserve_bytes(
            model, self.pool, self.context, config, self.device, self.dtype, self.max_num_batched_tokens,
            backend=backend, lora_kernels=kernels)
        self.cache = build_kv_cache(model, config, self.device, self.dtype, max_model_len, reserve_bytes=reserve,
                                    backend=backend)
        self.max_model_len = fit_max_model_len(self.cache, max_model_len, configured=config.max_model_len is not None)
        self.runner = ModelRunner(model, self.pool, self.cache, self.context, lora_kernels=kernels,
                                  sparse_scores=self.fast_paths["sparse_scores"].fast,
                                  fused_ops=self.fast_paths["fused_ops"].fast, max_positions=self.max_model_len)
        self.fast_paths["cuda_graphs"] = capture_decode_graphs(self.runner, self.tuning, self.fast_paths,
                                                               config.max_batch_size, self.max_model_len)
        self.blocks = BlockManager(self.cache)
        self.scheduler: Scheduler[Sequence] = Scheduler(
            self.pool.validate_lora_batch, lambda uid: uid in self.pool.pinned,
            config.max_batch_size, config.max_bypass_steps, blocks=self.blocks,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_tokens=long_prefill_cap(config, self.device),
            long_prefill_chunk_tokens=long_prefill_chunk(config, self.device),
            context_span=context_span(model, config, self.device))
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0  # prompt tokens fed to forwards (an n > 1 prompt counts once)
        self.prefill_timed = (0, 0.0)    # (prompt tokens, seconds) of prefill-heavy steps: routers price prefill by it
        self.token_texts = TokenTexts(tokenizer)
        self._grammar: Optional[GrammarCompiler] = None  # built at the first response_format request
        self._grammar_lock = threading.Lock()
        self.steps = 0
        self.rows_stepped = 0         # rows fed to forwards, summed over steps (rows / steps: the mean batch)
        self.engine_cpu_s = 0.0       # the engine thread's CPU seconds in steps and the pool changes between them
        self.cancelled = 0            # sequences dropped because their caller went away
        self.max_steps_after_cancel = 0  # the most steps any sequence ran after its cancel (the goal: <= 1)
        self.failed_steps_in_row = 0  # consecutive failed steps; MAX_FAILED_STEPS makes the replica unhealthy
        self._step_lock = threading.Lock()  # held by the engine thread for a step and the pool changes before it
        self._boundary_work: list = []      # pool changes other threads handed over (``at_step_boundary``)
        self.adapters = ReplicaAdapters(self.store, self.pool, at_step_boundary=self.at_step_boundary,
                                        running_uids=self.scheduler.running_uids, cancel=self._cancel_uid,
                                        wake=self._wake)
        self.inputs = InputProcessor(tokenizer, mc.vocab_size, self.max_model_len, config, self.adapters)
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"lorafleet-engine-{config.replica_id}", daemon=True)
        self._thread.start()
        self._free_caller_team()

    def _free_caller_team(self) -> None:
        """The calling thread is done with torch for now: free its OpenMP team, so the engine thread's is the only
        one (``engine.openmp_team``: a second team makes every small parallel op of a CPU step wait on a futex)."""
        if self.tuning.free_caller_openmp_teams and threading.current_thread() is not self._thread:
            release_thread_team()

    # ------------------------------------------------------------------ adapters (``ReplicaAdapters``)

    def register_adapter(self, name: str, source: str, *, revision: Optional[str] = None,
                         uid: Optional[str] = None, pinned: bool = False) -> AdapterRecord:
        """Read, validate and host-cache an adapter under ``name`` (``ReplicaAdapters.register``)."""
        try:
            return self.adapters.register(name, source, revision=revision, uid=uid, pinned=pinned)
        finally:  # reading and casting the weights ran parallel torch ops on the caller's thread
            self._free_caller_team()

    def load_into_slot(self, uid: str) -> int:
        """Load a registered adapter into a slot between two steps, with no request; returns the slot."""
        return self.adapters.load_into_slot(uid)

    def unregister_adapter(self, name: str, timeout_s: float = 30.0) -> str:
        """Refuse new requests for ``name`` at once, drain its requests, then unload it. Returns the uid."""
        return self.adapters.unregister(name, timeout_s)

    def unregister_uid(self, uid: str, timeout_s: float = 30.0) -> bool:
        """Retire the registration ``uid`` (drain, then unload); a newer uid of the same name is untouched."""
        return self.adapters.unregister_uid(uid, timeout_s)

    def pin_adapter(self, name: str) -> int:
        return self.adapters.pin(name)

    def unpin_adapter(self, name: str) -> bool:
        return self.adapters.unpin(name)

    def keep_adapters(self, uids: Iterable[str]) -> None:
        """Evict these last (``LoRAMemoryPool.keep``): the placement plan's adapters on this replica."""
        self.adapters.keep(uids)

    def validate_adapter_files(self, uid: str, source: str, *, name: str,
                               revision: Optional[str] = None) -> AdapterRecord:
        """Read and validate an adapter as registration would, keeping nothing."""
        try:
            return self.adapters.validate_files(uid, source, name=name, revision=revision)
        finally:
            self._free_caller_team()

    def fetch_to_host(self, uid: str) -> None:
        """Bring a registered adapter into the host tier (a file read), so its slot load is a memory copy."""
        self.adapters.fetch_to_host(uid)

    # ------------------------------------------------------------------ requests

    @property
    def grammar(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
            return self._grammar

    def _sequence(self, request: GenerateRequest, uid: Optional[str], ids: list[int], sink) -> Sequence:
        seq = Sequence(request, uid, ids, IncrementalDetokenizer(self.tokenizer, request.stop_strings), sink)
        if request.response_format is not None:
            grammar = self.grammar.compile(request.response_format)  # cached: compiled at submission
            seq.matcher = None if grammar is None else self.grammar.matcher(grammar)
        return seq

    def submit(self, request: GenerateRequest, sink: Callable[[SinkItem], None]) -> Sequence:
        request, uid, ids = self.inputs.process(request)  # a copy, when the engine filled in max_tokens
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
            self.adapters.stage(uid)  # a file read, if the host tier dropped it: here, never on the engine thread
        with self._lock:
            if self._stopped:
                raise EngineShutdownError("the engine is shutting down")
            if not self.healthy():
                raise EngineUnhealthyError(f"{self.failed_steps_in_row} engine steps failed in a row on this replica")
            if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
                raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are waiting on this replica "
                                            f"(limit {self.config.max_waiting_requests}); retry later")
            self.adapters.acquire(uid)  # the uid is live (checked here, atomically), else refused
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
            if self.runner.graphs is not None:  # the captured graphs' private memory pool goes with them
                graphs, self.runner.graphs = self.runner.graphs, None
                graphs.release()
            self.cache.release()  # the KV cache is most of a replica's GPU memory: free it now, not at the next GC

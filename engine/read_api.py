"""What a replica reads from its engine: adapters (as ``ReplicaAdapters`` reports them), the pool's
snapshot and events, queue, health, stats.

A mixin of ``LoRAEngine``, so the worker (and metrics) use this narrow API instead of
reaching into the pool, the store or the step thread.
"""

from __future__ import annotations

from typing import Optional

from pool.events import PoolSnapshot
from pool.host_cache import HostAdapterCache
from pool.memory_pool import EventListener, LoRAMemoryPool
from pool.store import AdapterRecord

MAX_FAILED_STEPS = 3  # failed steps in a row that make the engine unhealthy


class EngineReadAPI:
    def current_uid(self, name: str) -> Optional[str]:
        return self.adapters.current_uid(name)

    def serves(self, uid: str) -> bool:
        """``uid`` is registered here and still live (not replaced, unregistered or retiring)."""
        return self.adapters.serves(uid)

    def adapter_record(self, uid: str) -> AdapterRecord:
        """The adapter's one record on this replica (source, folder, rank, bytes, content version)."""
        return self.adapters.record(uid)

    def is_resident(self, uid: str) -> bool:
        return self.adapters.is_resident(uid)

    def host_cached(self, uid: str) -> bool:
        return self.adapters.host_cached(uid)

    def host_cached_uids(self) -> list[str]:
        return self.adapters.host_cached_uids()

    def host_tier_bytes(self) -> tuple[int, int]:
        """(bytes the host tier holds, its budget)."""
        return self.adapters.host_tier_bytes()

    def pinned_uids(self) -> frozenset[str]:
        return self.adapters.pinned_uids()

    def pool_snapshot(self) -> PoolSnapshot:
        return self.pool.snapshot()

    def loads_by_adapter(self) -> dict[str, int]:
        """Slot loads per adapter uid on this replica (the pool's ``counters.loads``, by adapter)."""
        return self.pool.loads_by_adapter()

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
        """The step thread is alive and steps are not failing one after another.

        A failed step fails its batch, not the thread; but repeated failures mean the device or
        model is broken (on CUDA an illegal access poisons the context), so Serve should replace us.
        """
        return self._thread.is_alive() and self.failed_steps_in_row < MAX_FAILED_STEPS

    def stats(self) -> dict:
        with self._lock:
            return {
                "waiting": len(self.scheduler.waiting),
                "running": len(self.scheduler.running),
                "tokens_generated": self.tokens_generated,
                "steps": self.steps,
                "rows_stepped": self.rows_stepped,
                "engine_cpu_s": round(self.engine_cpu_s, 6),
                "cancelled": self.cancelled,
                "max_steps_after_cancel": self.max_steps_after_cancel,
                "adapters": self.adapters.names(),
                "name_lookups": self.adapters.name_lookups,  # requests that came with a name and no uid
                "host_cached": self.adapters.host_cached_uids(),
                "host_cache_bytes": self.store.host_cache.stats.bytes_used,
                "kv_blocks": self.cache.num_blocks,
                "kv_block_size": self.cache.block_size,
                "kv_blocks_used": self.cache.allocator.num_used,
                "kv_bytes_total": self.cache.total_bytes,
                "kv_bytes_peak": self.cache.peak_blocks_used * self.cache.bytes_per_block,
                "kv_prefix_hit_blocks": self.cache.allocator.prefix_hits,
                "max_running": self.scheduler.max_running,
                "preemptions": self.scheduler.preemptions,
                "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
                "long_prefill_tokens": self.scheduler.long_prefill_tokens,
                "long_prefill_chunk_tokens": self.scheduler.long_prefill_chunk_tokens,
                "context_span": self.scheduler.context_span,  # a long chunk shrinks by 1 + cached / span (None: never)
                "prefill_chunks": self.scheduler.prefill_chunks,  # prefill inputs the token budget cut short
                # each fast path's start-up decision: {name: {intended, used, reason, check_error}}
                "fast_paths": {name: path.as_dict() for name, path in self.fast_paths.items()},
                # decode steps replayed from a captured CUDA graph (``engine.decode_graphs``); the rest ran eagerly
                "graph_replays": self.runner.graphs.replays if self.runner.graphs is not None else 0,
            }


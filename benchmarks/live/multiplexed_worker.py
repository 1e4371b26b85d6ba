"""Baseline (b) of ``benchmarks.routing_live``: the same engine behind Ray Serve's own multiplexing.

Each replica runs the product's ``LoRAEngine`` with the same ``EngineConfig`` (same demo
model, same pool size) as ``deployments.worker.LoRAWorker``, but adapters are managed the
way Ray Serve's documentation suggests: ``@serve.multiplexed(max_num_models_per_replica=
slots)`` "loads a model" -- here: registers the adapter with the engine (reads and
validates the folder) -- and Serve's LRU unloads the oldest one when a replica already
holds ``slots`` of them -- here: unregisters it (after its in-flight requests drain), which
also frees its pool slot. Clients send ``handle.options(multiplexed_model_id=name)``, so
Serve's default router (power of two choices with its multiplexed-model preference)
places requests. No directory, no registry, no affinity router.

Loads are counted twice: ``mux_loads`` (calls of the multiplexed loader, i.e. Serve's
own view) and the engine pool's ``counters.loads`` (slot loads, as for the other variants).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import deque
from typing import Optional

import torch
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.config import AppArgs, resolve_demo_source
from engine.engine import LoRAEngine
from engine.request import GenerateRequest, GenerateResult
from pool.errors import AdapterNotFoundError


class _LoadedAdapter:
    """What the multiplexed loader returns; Serve calls ``__del__`` when its LRU drops it."""

    def __init__(self, owner: "MultiplexedAdapters", name: str):
        self.owner = owner
        self.name = name
        self.unloaded = False

    def __del__(self):
        # Serve's multiplexer runs this in a thread (and waits for it) before its next load;
        # the flag keeps a later garbage collection from unregistering a newer registration
        if not self.unloaded:
            self.unloaded = True
            self.owner.unload(self.name)


class MultiplexedAdapters:
    """Serve's multiplexing over one engine: a load registers the adapter (reads it), Serve's LRU of
    ``slots`` models unregisters the oldest (after its requests drain). Used by the baseline worker
    and, in ``benchmarks.fleet_live``, by the product's worker when it plays the baseline."""

    def __init__(self, engine: LoRAEngine, args: AppArgs, slots: int):
        self.engine, self.args, self.slots = engine, args, slots
        self.sources = {spec.name: (spec.source, spec.revision) for spec in args.startup_adapters()}
        self.loads = 0
        self.unloads = 0
        self.load_seconds = 0.0
        self.unload_seconds = 0.0
        # (model, wall time) each load began: the half of benchmarks.live.model_id_lag measured here
        self.load_starts: deque[tuple[str, float]] = deque(maxlen=10_000)

        async def load_adapter(name: str) -> _LoadedAdapter:
            return await self.load(name)

        # wired per instance so the slot count can follow the app args (Serve detects it at runtime)
        self.get_adapter = serve.multiplexed(max_num_models_per_replica=slots)(load_adapter)

    async def load(self, name: str) -> _LoadedAdapter:
        if name not in self.sources:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        source, revision = self.sources[name]
        self.load_starts.append((name, time.time()))
        started = time.perf_counter()
        path = await asyncio.to_thread(resolve_demo_source, source)
        await asyncio.to_thread(self.engine.register_adapter, name, path, revision=revision)
        self.loads += 1
        self.load_seconds += time.perf_counter() - started
        return _LoadedAdapter(self, name)

    def unload(self, name: str) -> None:
        """Blocking (Serve calls it off the event loop): drain the adapter's requests, then drop it."""
        started = time.perf_counter()
        try:
            self.engine.unregister_adapter(name, self.args.drain_timeout_s)
        except AdapterNotFoundError:
            pass
        self.unloads += 1
        self.unload_seconds += time.perf_counter() - started

    async def ensure(self, request: GenerateRequest) -> None:
        name = serve.get_multiplexed_model_id() or request.adapter
        if name is not None:
            if name != request.adapter:
                raise ValueError(f"multiplexed_model_id {name!r} differs from the request's adapter "
                                 f"{request.adapter!r}")
            await self.get_adapter(name)  # no await point between this and submit: no unload can intervene

    def counts(self) -> dict:
        return {"mux_loads": self.loads, "mux_unloads": self.unloads, "mux_load_seconds": self.load_seconds,
                "mux_unload_seconds": self.unload_seconds}


@serve.deployment(
    name="MultiplexedLoRAWorker",
    max_ongoing_requests=8,
    request_router_config=RequestRouterConfig(),  # Serve's default: power of two choices (+ multiplexing)
    health_check_period_s=5.0,
)
class MultiplexedLoRAWorker:
    def __init__(self, args: dict, slots: Optional[int] = None):
        self.args = AppArgs(**args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        if not torch.cuda.is_available():
            import ray

            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            torch.set_num_threads(max(1, int(cpus)) if cpus else (os.cpu_count() or 1))
        self.engine = LoRAEngine(self.args.engine_config(self.replica_id))
        self.mux = MultiplexedAdapters(self.engine, self.args, int(slots or self.args.max_loras_per_batch))
        self.get_adapter = self.mux.get_adapter  # where Serve looks for the multiplexed function

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self.mux.ensure(request)
        result = await self.engine.generate(request)
        return dataclasses.replace(result, replica_id=self.replica_id)  # results are frozen: a copy names us

    async def generate_stream(self, request: GenerateRequest):
        """As ``LoRAWorker.generate_stream``: deltas, then the result (TTFT measurements)."""
        await self.mux.ensure(request)
        async for item in self.engine.generate_stream(request, with_result=True):
            yield dataclasses.replace(item, replica_id=self.replica_id) if isinstance(item, GenerateResult) else item

    def stats(self) -> dict:
        """This replica's pool snapshot plus the multiplexer's own counts."""
        snap = self.engine.pool_snapshot().to_dict()
        snap.update(replica_id=self.replica_id, registered=sorted(self.engine.stats()["adapters"]),
                    **self.mux.counts())
        return snap

    def __del__(self):
        if hasattr(self, "engine"):
            self.engine.shutdown()


def build_multiplexed(parsed: AppArgs, options: Optional[dict] = None):
    """The baseline app: one multiplexed deployment, ``slots`` = the pool's ``max_loras_per_batch``."""
    opts = dict(max_ongoing_requests=parsed.max_batch_size, max_queued_requests=parsed.max_queued_requests)
    opts.update(options or {})
    return MultiplexedLoRAWorker.options(**opts).bind(parsed.model_dump())

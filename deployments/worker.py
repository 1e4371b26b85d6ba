"""LoRAWorker: one engine, one LoRAMemoryPool and one host tier per Serve replica.

Requests carry their adapter inside the request object (not Serve's
``multiplexed_model_id``, by which ``@serve.batch`` would split mixed batches), resolved
once at the ingress to a uid (``GenerateRequest.resolved``): the worker loads that uid if
its engine lacks it and never looks the name up again; a uid whose name was re-registered
meanwhile is refused (410), never served other weights.

This file is the deployment: serving requests and answering Serve. The replica's adapters
(loads by uid, retirements, pins) are ``worker_adapters.py``; following the directory's
placement (warm start, read-ahead) is ``worker_plan.py``; what the replica reports to the
directory is ``worker_reports.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import AsyncIterator, Optional

import torch
from ray import serve

from engine.engine import LoRAEngine
from engine.request import GenerateRequest, GenerateResult, ReplicaTarget, TokenDelta
from pool.errors import AdapterNotFoundError
from routing.autoscale import DemandWindow, working_set_sketch
from routing.replica_state import ReplicaState

from .autoscaling import LOADS_METRIC, PINNED_METRIC, SLOTS_METRIC, sketch_metric
from .config import AppArgs, resolve_demo_source
from .content_version import content_version
from .derived_options import check_deployment
from .registry import RegistryFollower
from .worker_adapters import WorkerAdapters
from .worker_plan import PlanFollower
from .worker_reports import DirectoryReporter

log = logging.getLogger("ray.serve")
REGISTRY_POLL_TIMEOUT_S = 5.0


def _torch_threads() -> int:
    """As many threads as whole CPUs Ray gave this replica (at least one)."""
    import ray

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else (os.cpu_count() or 1)


@serve.deployment(name="LoRAWorker", health_check_period_s=5.0)  # the options AppArgs decide: build_fleet's
class LoRAWorker:
    async def __init__(self, args: dict, directory=None, derived: Optional[dict] = None):
        """``derived``: the options build_fleet derived (``derived_options.expected``), checked against Serve's."""
        self.args = AppArgs(**args)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        check_deployment("LoRAWorker", context._deployment_config, derived)
        if not torch.cuda.is_available():
            torch.set_num_threads(_torch_threads())
        self.engine = await asyncio.to_thread(LoRAEngine, self.args.engine_config(self.replica_id))
        self.directory = directory
        self.registry = RegistryFollower(directory, poll_timeout_s=REGISTRY_POLL_TIMEOUT_S)
        self.adapters = WorkerAdapters(self.engine, self.registry, self.replica_id, self.args.drain_timeout_s)
        self.registry.on_change = self.adapters.registry_changed
        self.demand = DemandWindow(self.args.demand_window_s)
        self.demand.observe_loads(0, time.monotonic())  # warm-up loads count too
        self.plan = PlanFollower(self.adapters, directory, lambda: self.args.replicas_follow_plan,
                                 self.args.host_standby_share)
        self.reports = DirectoryReporter(self.adapters, self.plan, directory, self.demand, self.args.max_batch_size)
        self.warm_start: dict = {}
        self._left = False
        self._tasks: list[asyncio.Task] = []
        if directory is not None:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self.reports.loop()), loop.create_task(self.registry.run()),
                           loop.create_task(self.adapters.pin_loop()), loop.create_task(self.plan.departures_loop())]
            await self._warm_up()

    async def _warm_up(self) -> None:
        """Load what the directory says this replica should hold, bounded by ``warm_start_timeout_s``, then
        report the pool so routers see it with its adapters before Serve sends traffic (Serve routes to a
        replica once this returns)."""
        started = time.monotonic()
        plan: dict = {}
        if self.args.warm_start_timeout_s > 0:
            try:
                plan = await asyncio.wait_for(self.plan.warm_start(self.args.max_loras_per_batch),
                                              self.args.warm_start_timeout_s)
            except Exception as exc:  # a slow or failing source must not keep the replica from starting
                log.warning("lorafleet worker %s: warm start stopped after %.1f s (%r); starting with what is "
                            "loaded", self.replica_id, time.monotonic() - started, exc)
        snap = self.engine.pool_snapshot()
        self.warm_start = {"plan": plan, "seconds": round(time.monotonic() - started, 3),
                           "loads_at_ready": snap.counters.loads, "resident": sorted(snap.resident),
                           "loads_by_adapter_at_ready": self.engine.loads_by_adapter()}
        self.plan.ready = True
        await self.reports.first_report(snap)

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        request = await self.adapters.resolved(request)
        self._count_demand(request.served_name)
        started = time.monotonic()
        try:
            await self.adapters.ensure_uid(request.resolved)
            result = await self.engine.generate(request)
        finally:
            self.reports.count_busy(request.served_name, started)
        return dataclasses.replace(result, replica_id=self.replica_id)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenDelta | GenerateResult]:
        """Deltas as produced, then the ``GenerateResult`` (usage, finish reason)."""
        request = await self.adapters.resolved(request)
        self._count_demand(request.served_name)
        started = time.monotonic()
        try:
            await self.adapters.ensure_uid(request.resolved)
            async for item in self.engine.generate_stream(request, with_result=True):
                yield dataclasses.replace(item, replica_id=self.replica_id) if isinstance(item, GenerateResult) \
                    else item
        finally:
            self.reports.count_busy(request.served_name, started)

    def model_info(self) -> dict:
        """What the OpenAI routes say of the base model (its context window, as the KV cache fits it)."""
        return {"max_model_len": self.engine.max_model_len}

    def _count_demand(self, name: Optional[str]) -> None:
        if name is not None:
            self.demand.requested(name, time.monotonic())

    # ------------------------------------------------------------------ admin

    async def validate_adapter(self, name: str, source: str, revision: Optional[str], uid: str,
                               missing_ok: bool = False) -> dict:
        """Read and validate an adapter on this replica (registration's first step); returns its facts.

        ``missing_ok``: a source that does not exist answers ``{"missing": why}`` instead of raising. The
        first-request resolver asks with it: each bogus name it looks up would otherwise make Serve log a
        traceback on this replica, for a miss that is the expected answer."""
        try:
            path = await asyncio.to_thread(resolve_demo_source, source)
            record = await asyncio.to_thread(self.engine.validate_adapter_files, uid, path, name=name,
                                             revision=revision)
        except AdapterNotFoundError as exc:
            if not missing_ok:
                raise
            return {"missing": str(exc)}
        return {"rank": record.rank, "bytes": record.nbytes, "folder": str(record.folder),
                "content": await asyncio.to_thread(content_version, record)}

    def pool_state(self, target: Optional[ReplicaTarget] = None) -> dict:
        """This replica's pool, exactly; call it with a ``ReplicaTarget`` to ask one replica."""
        if target is not None and target.target_replica != self.replica_id:
            raise RuntimeError(f"pool_state for {target.target_replica} reached replica {self.replica_id}")
        snap = self.engine.pool_snapshot().to_dict()
        snap["host_cached"] = self.engine.host_cached_uids()
        snap["engine"] = {k: v for k, v in self.engine.stats().items() if k not in ("adapters", "host_cached")}
        snap["warm_start"] = self.warm_start  # what warm-up loaded: loads after it are the pool's since
        snap["loads_by_adapter"] = self.engine.loads_by_adapter()
        snap["registry_lookups"] = self.registry.lookups  # entries requests looked up here (by name or uid)
        return snap

    # ------------------------------------------------------------------ Serve hooks

    def record_routing_stats(self) -> dict:
        """What routers reconcile their view with every ``request_routing_stats_period_s``."""
        snap = self.engine.pool_snapshot()
        self.reports.observe_timings(snap)
        return ReplicaState.from_snapshot(snap, **self.reports.state_extras()).to_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (deployments/autoscaling.py reads them): slots, pinned slots,
        pool loads per second and the sketch of adapters requested over the last ``demand_window_s``."""
        now = time.monotonic()
        snap = self.engine.pool_snapshot()
        self.demand.observe_loads(snap.counters.loads, now)
        stats = {SLOTS_METRIC: float(snap.slots), PINNED_METRIC: float(len(snap.pinned)),
                 LOADS_METRIC: self.demand.loads_per_s(now)}
        for i, value in enumerate(working_set_sketch(self.demand.names(now))):
            stats[sketch_metric(i)] = value
        return stats

    def check_health(self) -> None:
        if not self.engine.healthy():
            raise RuntimeError("the engine is unhealthy: its thread died or its steps keep failing")
        for task in self._tasks:
            if task.done() and task.exception() is not None:
                raise RuntimeError(f"background task failed: {task.exception()!r}")

    def reconfigure(self, user_config: dict) -> None:
        """Live settings from ``user_config``: eviction_policy, max_batch_size, max_tokens_limit."""
        self.engine.apply_settings(user_config or {})

    def __del__(self):
        for task in getattr(self, "_tasks", []):
            task.cancel()
        if hasattr(self, "registry"):
            self.registry.withdraw()  # the directory stops only once our long poll is gone
        if getattr(self, "directory", None) is not None and not getattr(self, "_left", True):
            self._left = True  # Serve calls this on a graceful stop: say goodbye so pins move at once
            try:
                self.directory.forget_replica.remote(self.replica_id)
            except Exception as exc:  # the directory is gone too: it forgets silent replicas by itself
                log.warning("lorafleet worker %s: goodbye to the directory failed (%r)", self.replica_id, exc)
        if hasattr(self, "engine"):
            self.engine.shutdown()

"""Benchmark-only workers for ``benchmarks.fleet_live``: the product's and the multiplexing baseline's,
each with ``EmulatedCosts`` installed, and a timed call that reports when the first token came.

The emulation's settings reach every replica at construction through one environment
variable (``LORAFLEET_EMULATION``, JSON: the cost model's time scale and each adapter's
modelled rank), set in the deployment's ``runtime_env``, so no call has to find each of 16
replicas through a router afterwards.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from deployments.worker import LoRAWorker
from engine.request import GenerateRequest, GenerateResult, ReplicaTarget

from ..sim.costs import CostModel
from .emulated import EmulatedCosts
from .multiplexed_worker import MultiplexedLoRAWorker

ENV = "LORAFLEET_EMULATION"


def emulation_env(time_scale: float, ranks: dict[str, int]) -> dict:
    """The ``runtime_env`` that carries the emulation's settings to every replica."""
    return {"env_vars": {ENV: json.dumps({"time_scale": time_scale, "ranks": ranks})}}


def _install(engine) -> EmulatedCosts:
    spec = json.loads(os.environ[ENV])
    return EmulatedCosts(engine, CostModel().scaled(float(spec["time_scale"])), spec["ranks"])


async def _timed(stream) -> dict:
    """Consume a worker's stream: the result, and the wall-clock time of its first token."""
    first: Optional[float] = None
    result = None
    async for item in stream:
        if isinstance(item, GenerateResult):
            result = item
        elif first is None:
            first = time.time()
    return {"result": result, "first_token_at": first if first is not None else time.time()}


class EmulatedLoRAWorker(LoRAWorker.func_or_class):
    """The product's worker (deployed as ``LoRAWorker``) with the emulated forward and load costs."""

    async def __init__(self, args: dict, directory=None):
        await super().__init__(args, directory)
        self.emulation = _install(self.engine)

    async def generate_timed(self, request: GenerateRequest) -> dict:
        return await _timed(self.generate_stream(request))

    def emulation_stats(self) -> dict:
        return {"replica_id": self.replica_id, **self.emulation.stats(), "loads": self.engine.pool_snapshot().counters.loads}

    def reset_adapters(self, target: Optional[ReplicaTarget] = None, prefetch: bool = False) -> dict:
        """Drop every adapter from the slots and the host tier (the next variant starts as cold as the
        first); ``target`` first, so the affinity router delivers it to that replica. ``prefetch``: whether
        the plan's read-ahead stays on (off for routers that do not follow the plan: its loads are not theirs)."""
        if target is not None and target.target_replica != self.replica_id:
            raise RuntimeError(f"reset for {target.target_replica} reached replica {self.replica_id}")
        self.args = self.args.model_copy(update={"prefetch_planned_adapters": prefetch})
        uids = self.engine.store.uids()
        for uid in uids:
            self.engine.unregister_uid(uid, 0.0)
        return {"replica_id": self.replica_id, "dropped": len(uids)}


class EmulatedMultiplexedWorker(MultiplexedLoRAWorker.func_or_class):
    """Serve's multiplexing baseline (deployed as ``MultiplexedLoRAWorker``) with the same emulation."""

    def __init__(self, args: dict, slots=None):
        super().__init__(args, slots)
        self.emulation = _install(self.engine)

    async def generate_timed(self, request: GenerateRequest) -> dict:
        return await _timed(self.generate_stream(request))

    def emulation_stats(self) -> dict:
        return {"replica_id": self.replica_id, **self.emulation.stats(), "loads": self.engine.pool_snapshot().counters.loads}

"""Benchmark-only worker for ``benchmarks.fleet_live``: the product's, with ``EmulatedCosts`` installed,
able to play Serve's multiplexing baseline, and a timed call that reports when the first token came.

The emulation's settings reach every replica at construction through one environment
variable (``LORAFLEET_EMULATION``, JSON: the cost model's time scale and each adapter's
modelled rank), set in the deployment's ``runtime_env``, so no call has to find each of 16
replicas through a router afterwards.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import os
import time
from typing import Optional

from ray import serve

from deployments.worker import LoRAWorker
from engine.request import GenerateRequest, GenerateResult, ReplicaTarget
from routing.identity import name_of

from ..sim.costs import CostModel
from .emulated import EmulatedCosts
from .multiplexed_worker import MultiplexedAdapters

ENV = "LORAFLEET_EMULATION"
# the timed call's record of when its adapter was ready (set per request task; prefetches see None)
_READY_AT: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("lorafleet_ready_at", default=None)


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
    """The product's worker (deployed as ``LoRAWorker``) with the emulated forward and load costs.

    It also plays Serve's multiplexing baseline: a request that carries a ``multiplexed_model_id``
    goes through ``MultiplexedAdapters`` (Serve's multiplexed loader and LRU over this engine), the
    rest through the product's path; ``fleet_live`` runs one after the other, pools emptied between."""

    async def __init__(self, args: dict, directory=None, derived: Optional[dict] = None):
        await super().__init__(args, directory, derived)
        self.emulation = _install(self.engine)
        self.mux = MultiplexedAdapters(self.engine, self.args, self.args.max_loras_per_batch)
        self.get_adapter = self.mux.get_adapter  # where Serve looks for the multiplexed function
        ensure_uid = self.adapters.ensure_uid

        async def ensure_timed(ref) -> None:
            """The product's step that makes the request's adapter servable, noting when it was done."""
            await ensure_uid(ref)
            ready = _READY_AT.get()
            if ready is not None:
                ready["at"] = time.time()

        self.adapters.ensure_uid = ensure_timed

    async def generate_timed(self, request: GenerateRequest) -> dict:
        """The request's result with the wall-clock times it reached this replica (``arrived_at``: routing and
        Serve's dispatch before it), had its adapter ready (``ready_at``: a disk read or a wait for one) and
        got its first token: the live run's split of a TTFT, which the simulator's replay is checked against."""
        arrived = time.time()
        ready = {"at": arrived}
        if serve.get_multiplexed_model_id():
            await self.mux.ensure(request)
            ready["at"] = time.time()
            out = await _timed(self.engine.generate_stream(request, with_result=True))
            out["result"] = dataclasses.replace(out["result"], replica_id=self.replica_id)  # results are frozen
        else:
            token = _READY_AT.set(ready)
            try:
                out = await _timed(self.generate_stream(request))
            finally:
                _READY_AT.reset(token)
        return {**out, "arrived_at": arrived, "ready_at": ready["at"]}

    def emulation_stats(self, target: Optional[ReplicaTarget] = None) -> dict:
        """The emulation's charged times, the multiplexer's counts and the pool's slot loads (its own counter:
        the directory forgets the counts of a uid unloaded everywhere, which multiplexing does all the time)."""
        if target is not None and target.target_replica != self.replica_id:
            raise RuntimeError(f"stats for {target.target_replica} reached replica {self.replica_id}")
        return {"replica_id": self.replica_id, **self.emulation.stats(), **self.mux.counts(),
                "loads": self.engine.pool_snapshot().counters.loads}

    def adapter_contents(self, target: Optional[ReplicaTarget] = None) -> dict:
        """The adapter names in this replica's slots and host tier now: ``fleet_live`` records the fleet's at each
        segment's start, so a replay that disagrees can be traced to where its pools first differ."""
        if target is not None and target.target_replica != self.replica_id:
            raise RuntimeError(f"contents for {target.target_replica} reached replica {self.replica_id}")
        return {"replica_id": self.replica_id,
                "slots": sorted(name_of(u) for u in self.engine.pool_snapshot().resident),
                "host": sorted(name_of(u) for u in self.engine.host_cached_uids())}

    def take_mux_load_starts(self, target: Optional[ReplicaTarget] = None) -> list[tuple[str, str, float]]:
        """``(replica id, model, wall time)`` of each multiplexed load begun since the last call
        (``benchmarks.live.model_id_lag``)."""
        if target is not None and target.target_replica != self.replica_id:
            raise RuntimeError(f"load starts for {target.target_replica} reached replica {self.replica_id}")
        out = [(self.replica_id, name, at) for name, at in self.mux.load_starts]
        self.mux.load_starts.clear()
        return out

    def reset_adapters(self, target: Optional[ReplicaTarget] = None, follow_plan: bool = False) -> dict:
        """Drop every adapter from the slots and the host tier (the next variant starts as cold as the
        first); ``target`` first, so the affinity router delivers it to that replica. ``follow_plan``: whether
        the replicas follow the plan (read-ahead, evicting its adapters last): off for routers that do not
        follow it (its loads are not theirs)."""
        if target is not None and target.target_replica != self.replica_id:
            raise RuntimeError(f"reset for {target.target_replica} reached replica {self.replica_id}")
        self.args = self.args.model_copy(update={"replicas_follow_plan": follow_plan})
        if not follow_plan:
            self.engine.keep_adapters(())
        uids = self.engine.store.uids()
        for uid in uids:
            self.engine.unregister_uid(uid, 0.0)
        return {"replica_id": self.replica_id, "dropped": len(uids)}

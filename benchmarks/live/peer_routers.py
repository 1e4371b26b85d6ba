"""Benchmark-only routers for ``benchmarks.fleet_live``: a consistent-hashing peer, and one class that
becomes the router its client process asks for, so one deployment serves every variant.

``ConsistentHashRouter``: each adapter ranks the replicas by rendezvous score
(``routing.hashing``, the hash the product uses) and a request is offered to them in that
order, one tier each: Serve sends it to the first that is not at ``max_ongoing_requests``. No
load bound, no view of slots: the peer a serving engineer would write first
(``benchmarks.sim.routers.HashRouter`` is its simulated twin).

``VariantRouter``: Serve builds one router per handle-holding process from the deployment's
``request_router_class``. This one reads ``ROUTER_ENV`` in that process and builds the
product's ``AdapterAffinityRouter``, Serve's default (power of two choices) or
``ConsistentHashRouter`` instead. 16 replicas take minutes to start on two cores; switching
the router by client process measures three variants on one deployment.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import List, Optional

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from routing.hashing import rendezvous_order
from routing.ray_router import AdapterAffinityRouter
from routing.request_fields import request_adapter

ROUTER_ENV = "LORAFLEET_BENCH_ROUTER"


class ConsistentHashRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        adapter = request_adapter(pending_request) or ""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in _order(adapter, tuple(sorted(by_id)))]


@lru_cache(maxsize=1 << 14)
def _order(adapter: str, replica_ids: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(rendezvous_order(adapter, list(replica_ids)))


class _DefaultRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs) -> None:  # the affinity router's kwargs mean nothing here
        super().initialize_state()

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        """Serve's own update, after noting when each replica's multiplexed model ids reached this router
        (``benchmarks.live.model_id_lag``)."""
        # looked up by module name at call time: Serve ships this class to the client by value, with a copy of
        # any module global it names, and the client reads the module's own record
        from benchmarks.live.model_id_lag import SIGHTINGS

        SIGHTINGS.observe({r.replica_id.unique_id: r.multiplexed_model_ids for r in replicas})
        super().update_replicas(replicas)


class _HashRouter(ConsistentHashRouter):
    def initialize_state(self, **kwargs) -> None:
        super().initialize_state()


VARIANT_ROUTERS: dict[str, type[RequestRouter]] = {
    "affinity": AdapterAffinityRouter, "pow2": _DefaultRouter, "hash": _HashRouter,
}


class VariantRouter(RequestRouter):
    """Never an instance of its own: ``__new__`` returns the router ``ROUTER_ENV`` names (default affinity)."""

    def __new__(cls, *args, **kwargs):
        name = os.environ.get(ROUTER_ENV, "affinity")
        if name not in VARIANT_ROUTERS:
            raise ValueError(f"{ROUTER_ENV}={name!r}; choose one of {sorted(VARIANT_ROUTERS)}")
        return VARIANT_ROUTERS[name](*args, **kwargs)

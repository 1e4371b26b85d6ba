"""AdapterAffinityRouter: Ray Serve's RequestRouter for LoRA workers (the only Ray file in routing/).

Serve creates one per handle-holding process (each proxy, ingress replica, driver); they
share no memory. Each keeps a ``RouterView`` fed by a background long poll on the
AdapterDirectory deployment, by the replicas' ``routing_stats``, and by its own
decisions, and asks ``policy.choose_replicas`` for ranked tiers. Routing never waits on
the directory: with it down, the last view, the stats and rendezvous placement remain.

No ``FIFOMixin``: it hands a freed replica to the oldest waiting request whatever its
adapter (it matches only on ``multiplexed_model_id``, which we do not use), which would
send queued requests to replicas without their adapter. Each request gets the replica
chosen for it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import Counter
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .policy import RoutingConfig, choose_replicas
from .view import RouterView, replica_loads

log = logging.getLogger("ray.serve")
STATS_APPLY_INTERVAL_S = 0.1
MAX_TRACKED_DECISIONS = 10_000


def request_adapter(pending_request: Optional[PendingRequest]) -> Optional[str]:
    """The adapter name from the request object (``args[0].adapter``); None for the base model."""
    if pending_request is None or not pending_request.args:
        return None
    adapter = getattr(pending_request.args[0], "adapter", None)
    return adapter if isinstance(adapter, str) else None


class _RouterMetrics:
    """``lorafleet_router_*`` metrics via ``ray.util.metrics`` (routers also live in proxies and drivers)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        self._decisions = Counter("lorafleet_router_decisions_total",
                                  description="Routing decisions by kind (affinity, placement, spill, base, "
                                              "full_spill: the preferred replicas were full)",
                                  tag_keys=("kind",))
        self._lag = Gauge("lorafleet_router_view_lag_seconds",
                          description="Seconds since this router's view last heard from the directory")

    def decision(self, kind: str) -> None:
        self._decisions.inc(tags={"kind": kind})

    def view_lag(self, seconds: float) -> None:
        self._lag.set(seconds)


def check_router_kwargs(kwargs: dict) -> None:
    """Refuse ``request_router_kwargs`` the router does not take, naming them (called at deploy time)."""
    known = set(inspect.signature(AdapterAffinityRouter.initialize_state).parameters) - {"self"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown request_router_kwargs {unknown} for AdapterAffinityRouter; "
                         f"it takes {sorted(known)}")


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(self, load_bound_epsilon: float = 0.25, min_load_bound: int = 0, placement_lookahead: int = 2,
                         spill_wait_s: float = 1.0,
                         optimistic_ttl_s: float = 3.0, directory_deployment: str = "AdapterDirectory",
                         poll_timeout_s: float = 5.0, min_poll_interval_s: float = 0.05) -> None:
        self.routing_config = RoutingConfig(load_bound_epsilon=load_bound_epsilon, min_load_bound=min_load_bound,
                                            placement_lookahead=placement_lookahead, spill_wait_s=spill_wait_s)
        self.view = RouterView(ttl_s=optimistic_ttl_s)
        self.directory_deployment = directory_deployment
        self.poll_timeout_s = poll_timeout_s
        self.min_poll_interval_s = min_poll_interval_s  # batches bursts of deltas: one view rebuild each
        self.decisions: Counter = Counter()  # affinity | placement | spill | base | full_spill
        self._inflight: Counter = Counter()
        self._first_choice: dict[str, tuple[Optional[str], set[str]]] = {}
        self._poll_thread: Optional[threading.Thread] = None
        self._epoch_seen: Optional[str] = None
        self._stats_applied_at = float("-inf")
        self.metrics = _RouterMetrics()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not hasattr(self, "view"):
            self.initialize_state()
        self._ensure_polling()
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ids = tuple(sorted(by_id))
        now = time.monotonic()
        if now - self._stats_applied_at >= STATS_APPLY_INTERVAL_S:  # stats change once a period, not per request
            self._stats_applied_at = now
            for replica_id, replica in by_id.items():
                self.view.apply_routing_stats(replica_id, replica.routing_stats)
        cache = self.replica_queue_len_cache
        loads = replica_loads(ids, {r: cache.get(by_id[r].replica_id) for r in ids}, self._inflight, self.view)
        target = getattr(pending_request.args[0], "target_replica", None) if pending_request and pending_request.args \
            else None
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        adapter = request_adapter(pending_request)
        waited = time.time() - pending_request.created_at if pending_request is not None else 0.0
        decision = choose_replicas(adapter, self.view.fleet_view(ids, adapter), loads, self.routing_config, waited)
        if pending_request is not None:
            # every tier has been offered; if all are full, wait (back off) before asking again
            pending_request.routing_context.should_backoff = True
            first = {ids[i] for i in decision.tiers[0]} if decision.tiers else set()
            if len(self._first_choice) > MAX_TRACKED_DECISIONS:  # requests cancelled before routing leave entries
                self._first_choice.clear()
            self._first_choice[pending_request.metadata.internal_request_id] = (decision.kind, first)
        return [[by_id[ids[i]] for i in tier] for tier in decision.tiers]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        rid = replica_id.unique_id
        self._inflight[rid] += 1
        self.view.record_decision(request_adapter(pending_request), rid)
        kind, first = self._first_choice.pop(pending_request.metadata.internal_request_id, (None, set()))
        if kind is not None:
            if rid not in first:
                kind = "full_spill"  # the preferred replicas were at max_ongoing_requests
            self.decisions[kind] += 1
            self.metrics.decision(kind)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        if self._inflight[rid] > 0:
            self._inflight[rid] -= 1

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.view.states.pop(replica_id.unique_id, None)
        self.view._touch()

    # ------------------------------------------------------------------ directory feed

    def _ensure_polling(self) -> None:
        """Start the directory feed once, on its own thread.

        Creating and calling a DeploymentHandle inside the router's event loop would wait on
        that same loop, so the feed runs blocking calls on a thread and hands each reply to
        the loop with ``call_soon_threadsafe``.
        """
        if self._poll_thread is None or not self._poll_thread.is_alive():
            loop = asyncio.get_running_loop()
            self._poll_thread = threading.Thread(target=self._poll_directory, args=(loop,),
                                                 name="lorafleet-router-feed", daemon=True)
            self._poll_thread.start()

    def _poll_directory(self, loop: asyncio.AbstractEventLoop) -> None:
        from ray import serve

        handle = None
        version = -1
        while not loop.is_closed():
            try:
                if handle is None:
                    handle = serve.get_deployment_handle(self.directory_deployment, app_name=self.app_name)
                started = time.monotonic()
                reply = handle.get_changes.remote(version, self.poll_timeout_s).result(
                    timeout_s=self.poll_timeout_s + 10)
                version = reply["version"] if "full" in reply or reply.get("epoch") == self._epoch_seen else -1
                self._epoch_seen = reply.get("epoch")
                loop.call_soon_threadsafe(self.view.apply_directory_reply, reply)
                self.metrics.view_lag(0.0)
                time.sleep(max(0.0, self.min_poll_interval_s - (time.monotonic() - started)))
            except Exception as exc:  # keep routing on what we have; try again shortly
                log.debug("lorafleet router: directory poll failed: %r", exc)
                last = self.view.last_update
                self.metrics.view_lag(time.monotonic() - last if last else 0.0)
                version = -1
                time.sleep(1.0)

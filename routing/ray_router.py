"""AdapterAffinityRouter: Ray Serve's RequestRouter for LoRA workers (with its metrics, the only Ray files in routing/).

Serve creates one per handle-holding process (each proxy, ingress replica, driver); they
share no memory. Each keeps a ``RouterView`` fed by a background long poll on the
AdapterDirectory deployment, by the replicas' ``routing_stats``, and by its own
decisions, and the directory's placement plan (``routing.plan``), and asks
``policy.choose_replicas`` for the replica of the adapter's planned set where the request is
expected to complete first. Routing never waits on the directory: with it down, the
last view, the stats and rendezvous order remain.

Cheap by construction, because the router runs in the caller's process and on a small
machine shares cores with the engines:

- one replica per decision, from Serve's own queue-length cache: Serve never probes a
  replica we offer (a probe is an RPC that costs the caller and the replica);
- up to 64 waiting requests are in ``choose_replicas`` at once (``max_num_routing_tasks``), so a
  freed row goes to one that can use it; when the best replica is full, or the adapter
  could only wait for a slot there, the request waits for capacity (woken, oldest first, by
  a completion of this router's requests) instead of Serve's backoff loop, which sleeps
  while rows are free and probes full replicas on every attempt; only when other routers'
  requests fill the replica (completions this router cannot see) does its oldest waiting
  request for that replica offer it every ``capacity_poll_s`` so Serve asks it for its queue length;
- oldest first across routers (``routing.wait_exchange``): while requests wait, the router trades its
  oldest wait per replica for the other routers' through the directory, leaves a free row to another
  router's much older request, its oldest request for each replica polls it, and the fleet's oldest may
  wait in the replica's engine (``oldest_queue``), so rows do not stick to the router whose request freed them;
- metrics (``routing.router_metrics``) are counted locally and exported every
  ``metrics_export_interval_s`` from the feed thread, not one ``ray.util.metrics`` call per decision;
- the directory feed (``routing.directory_feed``) is paced by traffic (one poll per
  ``requests_per_poll`` routed requests at most, one per ``poll_timeout_s`` when idle), so its
  cost per request is bounded at any request rate;
- the candidate list, caps and view are cached until Serve's replica set or the view
  changes.

No ``FIFOMixin``: it hands a freed replica to the oldest waiting request whatever its
adapter (it matches only on ``multiplexed_model_id``, which we do not use), which would
send queued requests to replicas without their adapter. Each request gets the replica
chosen for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .directory_feed import DirectoryFeed, FeedClosed
from .request_fields import request_adapter, request_prompt_tokens
from .policy import choose_replicas
from .router_metrics import RouterMetrics
from .router_state import LocalRouterState
from .settings import RoutingSettings
from .view import RouterView
from .wait_exchange import FRESH_INTERVALS, OthersWaiting, WaitExchange
from .waiters import OldestFirstWaiters

log = logging.getLogger("ray.serve")


def check_router_kwargs(kwargs: dict) -> None:
    """Refuse ``request_router_kwargs`` the router does not take, or values out of range, naming them (called at
    deploy time, so a typo fails the deploy instead of every router's first request)."""
    settings = {k: v for k, v in kwargs.items() if k != "directory_deployment"}
    try:
        RoutingSettings.from_mapping(settings)
    except ValueError as exc:
        raise ValueError(f"request_router_kwargs for AdapterAffinityRouter: {exc}") from None


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(self, directory_deployment: str = "AdapterDirectory", **settings) -> None:
        """``settings``: any ``routing.settings.RoutingSettings`` field (the app passes those set in
        ``serve_config.yaml``'s ``args.routing``); ``directory_deployment``: where the view comes from."""
        self.settings = RoutingSettings.from_mapping(settings)
        s = self.settings
        self.view = RouterView(ttl_s=s.view_ttl_s)
        self.local = LocalRouterState(settings=s)
        self.directory_deployment = directory_deployment
        self.feed: Optional[DirectoryFeed] = None  # started at the first decision (it needs the running loop)
        self._directory_handle = None
        self._stats_applied_at = float("-inf")
        self._candidates_of: Optional[list] = None
        self._ids: tuple[str, ...] = ()
        self._by_id: dict[str, RunningReplica] = {}
        self._caps: list[float] = []
        self._queue_caps: list[float] = []
        self._queue_places = False
        self._waiters = OldestFirstWaiters()
        self._room = False  # the last decision saw a replica with a free row (``_decide``)
        self._waiting: Counter = Counter()  # adapter -> this router's requests waiting for a planned row
        self._kinds: dict[str, str] = {}  # request id -> decision kind, counted when routed
        self._first_seen: dict[str, float] = {}  # request id -> when it first asked for a replica
        self._last_call: tuple[Optional[str], float] = (None, 0.0)
        self.metrics = RouterMetrics()  # decisions by kind (affinity | spill | placement | base | wait | waited | yield)
        # oldest first across routers (routing.wait_exchange): this router's waiting requests and the others'
        self._waits: dict[str, tuple[float, str]] = {}  # request id -> (first seen, replica it waits for)
        self.others_waiting = OthersWaiting(fresh_s=FRESH_INTERVALS * s.wait_exchange_interval_s)
        self.wait_exchange = WaitExchange(uuid.uuid4().hex, s.wait_exchange_interval_s, self._own_ages,
                                          self.others_waiting, self._send_waits)

    @property
    def max_num_routing_tasks(self) -> int:
        """How many pending requests Serve routes at once: enough that a freed row can go to a waiting
        request whose adapter fits it, not only to the oldest few.

        Serve routes ``2 x replicas`` requests at a time and keeps the rest in a FIFO it does not
        show the policy. When the oldest few all wait for their adapter's busy holder, a row freed
        elsewhere stays empty although requests behind them could use it: under saturation that
        idles replicas. With up to 64 waiting requests in ``choose_replicas``, each completion wakes
        them and the first whose expected completion time is lowest there takes the row.
        """
        serve_default = 2 * len(self._replicas)
        settings = getattr(self, "settings", None)
        return max(serve_default, min(settings.max_routing_tasks if settings else serve_default, 1000))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not hasattr(self, "view"):
            self.initialize_state()
        self._ensure_polling()
        if not candidate_replicas:
            if pending_request is not None:
                pending_request.routing_context.should_backoff = True  # Serve's backoff, never a spin
            return []
        if candidate_replicas is not self._candidates_of:
            self._set_candidates(candidate_replicas)
        now = time.monotonic()
        if now - self._stats_applied_at >= self.settings.stats_apply_interval_s:  # stats change once a period, not per request
            self._stats_applied_at = now
            for replica_id, replica in self._by_id.items():
                self.view.apply_routing_stats(replica_id, replica.routing_stats)
            self.local.expire()
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        target = getattr(request, "target_replica", None)
        if target is not None:
            if target in self._by_id:
                return [[self._by_id[target]]]
            if pending_request is not None:  # a replica Serve does not run yet: let Serve back off, never spin
                pending_request.routing_context.should_backoff = True
            return []
        adapter = request_adapter(pending_request)
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        first_seen = self._first_seen.setdefault(request_id, now) if request_id is not None else now
        if len(self._first_seen) > 10_000:  # requests cancelled before routing leave entries
            self._first_seen = {request_id: first_seen}
        woken = False  # the last sleep ended in a wake-up (a relay: hand the room on if this request leaves it)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = False  # we wait for capacity ourselves
            if self._last_call[0] == request_id and now - self._last_call[1] < self.settings.repeat_window_s:
                woken = await self._wait_for_capacity(first_seen)  # Serve could not use the last choice: no spin
        deadline = time.monotonic() + self.settings.max_wait_per_call_s
        kind = None
        counted = False  # this request is in ``_waiting`` (the rows its planned replicas owe it)
        poll_at: Optional[float] = None  # when this request, polling for its replica, next offers it to Serve
        queue_at: Optional[int] = None  # the replica whose queue place kept for the fleet's oldest it may take
        try:
            while True:
                decision = self._decide(adapter, time.monotonic() - first_seen,
                                        counted and self._waiters.is_oldest(request_id or ""), queue_at)
                # a free place another router's request has waited for much longer is left to it (its oldest
                # request for that replica polls for it; ours takes it at its next poll if it is still free)
                yielded = not decision.wait and self._older_elsewhere(decision, first_seen)
                if not (decision.wait or yielded) or time.monotonic() >= deadline:
                    if (decision.wait or yielded) and woken and self._room:
                        self._waiters.hand_on(first_seen)  # leaves at its deadline without the room it was woken for
                    break
                waits_for = decision.tiers[0][0] if yielded else decision.best
                if not counted:
                    counted = True
                    self._waiting[adapter] += 1
                    self._waiters.join_line(first_seen, request_id or "")
                    self.wait_exchange.waiting(asyncio.get_running_loop())
                self.metrics.decision("yield" if yielded else "wait")
                if waits_for is None:
                    woken = await self._wait_for_capacity(first_seen, deadline - time.monotonic(),
                                                          handoff=woken and self._room)
                    continue
                self._waits[request_id or ""] = (first_seen, self._ids[waits_for])
                oldest_here = self._oldest_for(waits_for, request_id or "", first_seen)
                oldest = oldest_here and self.others_waiting.anyone() and \
                    not self.others_waiting.older_elsewhere(self._ids[waits_for], first_seen)
                # while other routers' requests wait too, the fleet's oldest request for a replica may wait in its
                # engine's queue (``oldest_queue``): it runs at the next free row, before newer ones of any router
                if oldest and queue_at != waits_for and self._queue_places:
                    queue_at = waits_for
                    retry = self._decide(adapter, time.monotonic() - first_seen,
                                         self._waiters.is_oldest(request_id or ""), queue_at)
                    if not retry.wait:
                        decision = retry
                        break
                elif not oldest:
                    queue_at = None
                # only other routers' completions go unseen: with none in the way, wait for ours (no polling);
                # with them, the oldest waiting request polls for all (the room a probe finds wakes the rest), and
                # while other routers' requests wait too, the oldest for each replica polls that one (the rows
                # they leave it are found within a poll), so probes grow with replicas only under contention
                poll = self._others_fill(waits_for) and (self._waiters.first_in_line(first_seen) or
                                                         (oldest_here and self.others_waiting.anyone()))
                if not poll:
                    poll_at = None
                elif poll_at is None:
                    poll_at = time.monotonic() + self.settings.capacity_poll_s
                timeout = (poll_at if poll_at is not None else deadline) - time.monotonic()
                woken = await self._wait_for_capacity(first_seen, timeout, handoff=woken and self._room)
                if poll_at is not None and time.monotonic() >= poll_at:
                    # other routers' requests fill the replica and their completions are invisible here: offer it
                    # every capacity_poll_s, whatever our own completions woke meanwhile (they came often enough to
                    # starve the poll), so Serve asks it for its queue length (offering every replica made Serve
                    # probe each in turn: slower, measured)
                    chosen, kind = waits_for, "waited"
                    if woken and self._room:
                        self._waiters.hand_on(first_seen)
                    break
        finally:
            self._waits.pop(request_id or "", None)
            if counted:
                self._waiters.leave_line(first_seen, request_id or "")
                self._waiting[adapter] -= 1
                if self._waiting[adapter] <= 0:
                    del self._waiting[adapter]
        self._last_call = (request_id, time.monotonic())
        if kind is None:
            if not decision.tiers:
                return []
            chosen, kind = decision.tiers[0][0], decision.kind
        if request_id is not None:
            rid = self._ids[chosen]
            self.local.chose(request_id, rid, request_prompt_tokens(request) * (
                self.view.prefill_s_per_token(rid) or self.settings.prefill_s_per_token))
            self._kinds[request_id] = kind
            if len(self._kinds) > 10_000:  # requests cancelled before routing leave entries
                self._kinds.clear()
        return [[self._by_id[self._ids[chosen]]]]

    def _set_candidates(self, candidate_replicas: List[RunningReplica]) -> None:
        """Serve passes the same list object until its replica set changes: derive ids and caps once."""
        self._candidates_of = candidate_replicas
        self._by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._ids = tuple(sorted(self._by_id))
        # a replica's rows: what it admits less the queue places kept for the fleet's oldest waiting requests
        # (``oldest_queue``: build_fleet adds them to max_ongoing_requests)
        admits = [float(self._by_id[r].max_ongoing_requests) for r in self._ids]
        self._caps = [max(1.0, a - self.settings.oldest_queue) for a in admits]
        self._queue_caps = admits
        self._queue_places = any(a > c for a, c in zip(admits, self._caps))

    def _decide(self, adapter: Optional[str], waited_s: float = 0.0, first_in_line: bool = False,
                queue_at: Optional[int] = None):
        """``queue_at``: the replica whose queue places this request may take (it is the fleet's oldest for it)."""
        ids, cache, local = self._ids, self.replica_queue_len_cache, self.local
        caps = self._caps
        if queue_at is not None:
            caps = list(caps)
            caps[queue_at] = self._queue_caps[queue_at]
        loads = []
        room = False
        for rid, cap in zip(ids, caps):
            probed = cache.get(self._by_id[rid].replica_id)
            q = probed if probed is not None else max(local.inflight.get(rid, 0), self.view.queue_len(rid))
            q += local.pending.get(rid, 0)
            if q >= cap:
                local.saw_full(rid)
            else:
                room = True
            loads.append(q)
        self._room = room  # some replica had a free row: a woken request that waits on hands it on
        return choose_replicas(adapter, self.view.fleet_view(ids, adapter), loads, self.settings,
                               caps=caps, request_s=local.request_s_by_index(ids),
                               active=local.active_by_index(ids), demand=local.demand,
                               last_used=local.last_used_by_index(ids), batch_slowdown=local.batch_slowdown(),
                               waited_s=waited_s, first_in_line=first_in_line, waiting=self._waiting,
                               full_at=local.full_at_by_index(ids), now=time.monotonic(),
                               prefill_wait=local.prefill_wait_by_index(ids))

    async def _wait_for_capacity(self, since: float, timeout: Optional[float] = None, handoff: bool = False) -> bool:
        """Until a request of ours completes or a replica reports room (True), or ``timeout`` (default
        ``capacity_poll_s``) passes (False: other routers' requests may have completed unseen).
        Woken requests decide again oldest first (``since``: when the request first asked); ``handoff``: this
        request was woken, saw room it did not take, and wakes the next in line (``routing.waiters``)."""
        return await self._waiters.wait(since, self.settings.capacity_poll_s if timeout is None else timeout,
                                        handoff=handoff)

    def _older_elsewhere(self, decision, since: float) -> bool:
        """Whether another router's request has waited for the replica ``decision`` would take longer than a
        request that first asked at ``since``, by more than ``fair_wait_margin_s`` (``routing.wait_exchange``)."""
        if not decision.tiers:
            return False
        return self.others_waiting.older_elsewhere(self._ids[decision.tiers[0][0]], since,
                                                   self.settings.fair_wait_margin_s)

    def _oldest_for(self, index: int, request_id: str, since: float) -> bool:
        """Whether no other request of this router waiting for replica ``index`` began waiting before ``since``."""
        rid = self._ids[index]
        return all(other_since >= since for other_id, (other_since, other_rid) in self._waits.items()
                   if other_rid == rid and other_id != request_id)

    def _own_ages(self) -> dict[str, float]:
        """Per replica, how long this router's oldest request waiting for it has waited (read on the exchange's
        thread: a copy of the table the event loop writes)."""
        for _ in range(3):
            try:
                entries = list(self._waits.values())
                break
            except RuntimeError:  # resized while copied
                continue
        else:
            return {}
        now, ages = time.monotonic(), {}
        for since, rid in entries:
            ages[rid] = max(ages.get(rid, 0.0), now - since)
        return ages

    def _others_fill(self, index: Optional[int]) -> bool:
        """Whether replica ``index`` looks full partly because of requests this router did not send."""
        if index is None:
            return False
        rid = self._ids[index]
        cached = self.replica_queue_len_cache.get(self._by_id[rid].replica_id)
        return cached is None or cached > self.local.inflight.get(rid, 0)

    def _capacity_freed(self) -> None:
        """A row freed: the waiting requests look at it oldest first until one takes it (``routing.waiters``)."""
        self._waiters.relay()

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self.local.sent(replica_id.unique_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        rid = replica_id.unique_id
        adapter = request_adapter(pending_request)
        request_id = pending_request.metadata.internal_request_id
        request = pending_request.args[0] if pending_request.args else None
        self.local.routed(request_id, rid, adapter, request_prompt_tokens(request),
                          self.view.prefill_s_per_token(rid) or self.settings.prefill_s_per_token)
        if self.feed is not None:
            self.feed.request_routed()
        self.view.record_decision(adapter, rid)
        self._first_seen.pop(request_id, None)
        kind = self._kinds.pop(request_id, None)
        if kind is not None:
            self.metrics.decision(kind)

    def on_new_queue_len_info(self, replica_id, num_ongoing_requests: int) -> None:
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        if num_ongoing_requests < getattr(self._by_id.get(replica_id.unique_id), "max_ongoing_requests", 0):
            self._capacity_freed()

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.local.completed(internal_request_id)
        self._capacity_freed()

    def decrement_queue_len_cache(self, replica_id) -> None:
        """Serve lowers its queue-length cache in a callback of its own, after or before
        ``on_request_completed``: waiters woken before it would see the row still taken and sleep
        until the next completion, so they are woken again once the cache says it is free."""
        super().decrement_queue_len_cache(replica_id)
        self._capacity_freed()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.view.states.pop(replica_id.unique_id, None)
        self.local.forget_replica(replica_id.unique_id)
        self.view._touch()
        self._waiters.wake_all()  # the fleet changed: every waiting request decides again

    # ------------------------------------------------------------------ directory feed

    def _ensure_polling(self) -> None:
        if self.feed is None:
            self.feed = DirectoryFeed(self.settings, self.view, self.metrics, self._send_poll)
        self.feed.ensure_running(asyncio.get_running_loop())

    def _send_poll(self, since_version: int, timeout_s: float, plan_version: int):
        """The directory's changes since ``since_version`` (a long poll of up to ``timeout_s``) in flight, sent from
        the feed's thread: a ``DeploymentResponse``, which the feed waits on and can withdraw."""
        return self._directory().get_changes.remote(since_version, timeout_s, plan_version)

    def _send_waits(self, router_id: str, ages: dict):
        """This router's oldest waits per replica to the directory, the others' back (``routing.wait_exchange``),
        sent from the exchange's thread."""
        return self._directory().exchange_waits.remote(router_id, ages)

    def _directory(self):
        import ray
        from ray import serve

        if not ray.is_initialized():  # a call now would reach a core worker that is gone, which ends the process
            raise FeedClosed("ray.shutdown() was called in this process")
        if self._directory_handle is None:
            self._directory_handle = serve.get_deployment_handle(self.directory_deployment, app_name=self.app_name)
        return self._directory_handle

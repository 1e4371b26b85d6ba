"""A trace on the fleet: replicas that step like the engine, a lagged directory feed, one router.

Per replica (``replica.SimReplica``): the real ``LoRAMemoryPool`` (no tensors), the real
``engine.scheduler.Scheduler`` with the token budget, a host tier, the worker's disk reads
off the engine thread (or the multiplexing baseline's serialized registrations), and an
engine that steps back to back under ``CostModel``'s times: the slot copies stall the step,
the forward takes ``step_s(prefill tokens)``, a token per fed request at the step's end. That
module's docstring is the time model; it is ``benchmarks/live/emulated.py``'s.

Routing. ``ongoing`` (dispatched, not finished, per replica: a request waiting for its disk
read holds its row) is what Serve's queue-length probes report, exact. A replica at
``max_ongoing`` (= ``max_batch``) is full; a router that finds nothing backs off (25 ms
doubling to 0.5 s, like Serve) and retries, or (the affinity router) waits for a completion.

Staleness. Every pool event is buffered with its simulated time; every ``lag_s`` the
events at least ``lag_s`` old go to a real ``AdapterDirectory`` in one batch, and the
router's ``RouterView`` takes the directory's ``changes_since`` delta, so a router sees an
event between ``lag_s`` and ``2 * lag_s`` after it happened.

Time advances on ``events.EventLoop``, the loop ``cpu_fleet`` runs on too.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional

import numpy as np

from pool.adapter import AdapterConfig, LoRAAdapterWeights
from routing.directory import AdapterDirectory

from ..traces import Trace, adapter_uid
from .config import SimConfig, SimRequest
from .events import EventLoop
from .feed import DirectoryFeed, PollPacing
from .replica import SimReplica
from .routers import ROUTERS

__all__ = ["SimReplica", "SimResult", "Simulator", "run_sim"]


@dataclass
class SimResult:
    router: str
    replicas: int
    adapters: int
    requests: int            # measured (after warm-up)
    loads: int               # adapter loads caused by measured requests
    loads_total: int         # every load in the run (pool counters), warm-up included
    hit_ratio: float         # measured requests whose adapter was resident (or loaded for an earlier one)
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    queue_p99: float         # arrival -> admitted into a batch (router wait + disk read + waiting for a row or slot), p99
    slot_waited: float       # share of measured requests that waited in the engine's queue (rows or adapter slots)
    imbalance: float         # max / mean measured requests per replica
    load_seconds: float      # modelled load seconds the measured requests caused: disk reads (their own wait) + slot copies (the batch's stall)
    disk_loads: int
    retries: int
    evictions: int
    kinds: dict[str, int]
    sim_seconds: float
    wall_seconds: float
    settings: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("kinds")
        d.pop("settings")
        d["loads_per_req"] = self.loads / max(1, self.requests)
        return d


SERVE_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"  # ray._common.utils.RANDOM_STRING_ALPHABET


def replica_ids(n: int, seed: Optional[int] = None) -> tuple[str, ...]:
    """``n`` replica ids, sorted. ``seed``: random 8-character ids as Serve draws them
    (``deployment_state``: ``ReplicaID(get_random_string())``), since hashing routers and the plan's ties
    depend on the ids (a replay of a live run uses its ids, ``SimConfig.replica_ids``); None: ``replica-0000``, ``replica-0001``, ..."""
    if seed is None:
        return tuple(f"replica-{i:04d}" for i in range(n))
    rng = np.random.default_rng(seed)
    letters = np.array(list(SERVE_ID_ALPHABET))
    return tuple(sorted("".join(rng.choice(letters, 8)) for _ in range(n)))


class Simulator(EventLoop):
    routers: Mapping[str, type] = ROUTERS  # what ``config.router`` may name (a replay of recorded placements adds its own)

    def __init__(self, trace: Trace, config: SimConfig):
        super().__init__()
        if config.router not in self.routers:
            raise ValueError(f"unknown router {config.router!r}; choose one of {sorted(self.routers)}")
        self.trace, self.config = trace, config
        self.ids = (tuple(sorted(config.replica_ids)) if config.replica_ids is not None  # sorted, as Serve's router
                    else replica_ids(config.replicas, config.replica_id_seed))
        if len(self.ids) != config.replicas:
            raise ValueError(f"{len(self.ids)} replica ids for {config.replicas} replicas")
        self.max_ongoing = config.max_batch
        self.ongoing = np.zeros(config.replicas, dtype=np.float64)
        self.router = self.routers[config.router](self)
        # adapter i's name: the plan breaks ties by name, so a replay of a live run names them as it did
        self.uid_of: Callable[[int], str] = adapter_uid if config.adapter_names is None else config.adapter_names.format
        self.ranks = {self.uid_of(a): int(r) for a, r in enumerate(trace.ranks.tolist())}
        self._configs: dict[int, AdapterConfig] = {}
        self.feed: Optional[DirectoryFeed] = None
        self._plan_followed = -1  # the plan version the replicas last followed
        self.directory: Optional[AdapterDirectory] = None
        self._listener = None
        if self.router.uses_view:
            self.feed = DirectoryFeed(lambda: self.now, config.lag_s, config.max_batch,
                                      registered=[self.uid_of(a) for a in range(trace.num_adapters)],
                                      pacing=PollPacing.of(config.routing) if config.paced_feed else None,
                                      settings=config.routing)
            self.directory = self.feed.directory
            self._listener = self.feed.on_pool_event
        self.replicas = [self._replica(i, rid) for i, rid in enumerate(self.ids)]
        if self.feed is not None:
            for replica in self.replicas:
                self.feed.join(replica.rid, replica.pool.snapshot())
        self.routable = list(range(config.replicas))  # replica index per position in ``ids``
        self.retries = 0
        self.waiting: deque[SimRequest] = deque()  # requests waiting for capacity (routers that wait)
        self.routing_tasks = max(config.routing_tasks_per_replica * config.replicas, config.routing_tasks_min)
        self.requests: list[SimRequest] = []
        self.done = 0
        self._started = False

    # ------------------------------------------------------------------ plumbing

    accepts_later = False  # every send is accepted: Serve's refusals are not modelled here

    @property
    def seen_ongoing(self) -> np.ndarray:
        """The counts the product's router decides on: exact here (Serve's cache is ``cpu_fleet``'s model only)."""
        return self.ongoing

    def _fetch(self, uid: str) -> LoRAAdapterWeights:
        rank = self.ranks[uid]
        cfg = self._configs.get(rank)
        if cfg is None:
            cfg = self._configs[rank] = AdapterConfig(rank=rank, alpha=2.0 * rank, use_rslora=False,
                                                      target_modules=())
        return LoRAAdapterWeights(name=uid, config=cfg, a={}, bt={})

    def _replica(self, idx: int, rid: str) -> SimReplica:
        return SimReplica(idx, rid, self.config, self._fetch, self._listener, self, self.ranks,
                          multiplexed=self.router.multiplexed_worker)

    def _sync_tick(self) -> None:
        """Every ``lag_s``: the directory feed (below), then the next tick."""
        self._sync()
        self.at(self.now + self.config.lag_s, self._sync_tick)

    def _sync(self) -> None:
        """Deliver events at least ``lag_s`` old to the directory (and, once a second, the routable
        replicas' heartbeats with the busy seconds since the last: ``LoRAWorker._heartbeat``); the
        router pulls the delta."""
        due = self.feed.heartbeat_due()
        if due:
            for i in self.routable:
                replica = self.replicas[i]
                self.feed.heartbeat(replica.rid, replica.heartbeat())
        self.feed.sync(self.router, busy=due)
        plan = self.directory.plan
        if self.router.follows_plan and plan.version != self._plan_followed:
            self._plan_followed = plan.version  # the live worker hears it in its next report's reply
            for i in self.routable:
                replica = self.replicas[i]
                replica.follow_plan([name for name, holders in plan.holders.items() if replica.rid in holders],
                                    list(plan.slotted.get(replica.rid, ())))

    def followed_plan(self, version: int) -> None:
        """The replicas follow plan ``version`` already (a deploy's warm start made them): the next sync
        hands them only a newer one."""
        self._plan_followed = version

    def _push_model_ids(self) -> None:
        """Every ``lag_s`` (Serve's ``PUSH_MULTIPLEXED_MODEL_IDS_INTERVAL_S``, 100 ms) each replica pushes its
        model ids to the controller, which broadcasts them to the routers: they arrive ``model_id_delay_s``
        later (default one more ``lag_s``, the controller's loop; a live run measures it,
        ``benchmarks.live.model_id_lag``)."""
        cfg = self.config
        now_ids = [self.replicas[i].model_ids() for i in self.routable]
        delay = cfg.lag_s if cfg.model_id_delay_s is None else cfg.model_id_delay_s
        self.at(self.now + delay, lambda: self.router.model_ids_pushed(now_ids))
        self.at(self.now + cfg.lag_s, self._push_model_ids)

    # ------------------------------------------------------------------ membership

    def new_replica(self) -> SimReplica:
        """A replica that exists (its pool can load) but takes no traffic until ``set_routable`` names it."""
        idx = len(self.replicas)
        replica = self._replica(idx, f"replica-{idx:04d}")
        self.replicas.append(replica)
        if self.feed is not None:
            self.feed.join(replica.rid, replica.pool.snapshot())
        return replica

    def set_routable(self, indices) -> None:
        """The replicas routers choose from (sorted by id, as the Serve router sorts). One left out keeps
        running what it was sent (Serve drains a replica it stops)."""
        order = sorted(set(indices))
        if not order or not all(0 <= i < len(self.replicas) for i in order):
            raise ValueError(f"routable replicas must be a non-empty subset of 0..{len(self.replicas) - 1}, "
                             f"got {sorted(set(indices))}")
        if self.feed is not None:
            for i in set(self.routable) - set(order):
                self.feed.leave(self.replicas[i].rid)
        self.routable = order
        self.ids = tuple(self.replicas[i].rid for i in order)
        self.ongoing = np.array([self.replicas[i].ongoing for i in order], dtype=np.float64)
        self.routing_tasks = max(self.config.routing_tasks_per_replica * len(order), self.config.routing_tasks_min)
        self.router.replicas_changed()
        if self.waiting:  # a replica joined or left: requests waiting for capacity decide again
            self._retry_waiting()

    # ------------------------------------------------------------------ replica

    def _dispatch(self, req: SimRequest, pos: int) -> None:
        replica = self.replicas[self.routable[pos]]
        req.replica = replica.idx
        self.ongoing[pos] += 1
        if self.feed is not None:
            self.feed.routed += 1
        if self.config.dispatch_s > 0:
            self.at(self.now + self.config.dispatch_s, lambda: self._arrive(req, replica))
        else:
            self._arrive(req, replica)

    def _arrive(self, req: SimRequest, replica) -> None:
        """The request reaches its replica (``t_dispatch``: from here it counts as the replica's, as the live
        worker counts its busy time from the call's start)."""
        req.t_dispatch = self.now
        replica.dispatch(req)

    def request_finished(self, req: SimRequest) -> None:
        """``req``'s last token came on its replica (which has done its own accounting): free its row."""
        replica = self.replicas[req.replica]
        if len(self.routable) == len(self.replicas):  # every replica routable: position = index
            self.ongoing[replica.idx] -= 1
        elif replica.idx in self.routable:
            self.ongoing[self.routable.index(replica.idx)] -= 1
        self.done += 1
        if self.feed is not None:
            self.feed.record_busy(replica.rid, req.uid, self.now - req.t_dispatch)
        self.router.finished(req)
        if self.waiting:
            self._retry_waiting()

    def _route(self, req: SimRequest) -> None:
        if req.replica >= 0:
            return  # a poll for a request that a completion already placed
        cfg = self.config
        if self.router.waits_for_capacity and not req.waiting and len(self.waiting) >= self.routing_tasks:
            req.waiting = True  # Serve routes only the oldest few waiting requests at a time
            self.waiting.append(req)
            return
        idx = self.router.route(req, self.now)
        if idx is not None:
            if req.waiting:
                req.waiting = False
                self.waiting.remove(req)
            self._dispatch(req, idx)
            return
        req.attempt += 1
        self.retries += 1
        if self.router.waits_for_capacity:  # one router: woken by completions, as live (no polling)
            if not req.waiting:
                req.waiting = True
                self.waiting.append(req)
        else:
            delay = min(cfg.backoff_initial_s * (2 ** (req.attempt - 1)), cfg.backoff_max_s)
            self.at(self.now + delay, self._route, req)

    def _retry_waiting(self) -> None:
        """A completion freed a row: the oldest waiting requests (as many as Serve routes at once) decide again."""
        for req in list(self.waiting)[: self.routing_tasks]:
            self._route(req)

    # ------------------------------------------------------------------ loop

    def run(self) -> SimResult:
        """The whole trace from ``t = 0``, then its statistics."""
        started = time.perf_counter()
        self.serve(self.trace)
        return self._result(time.perf_counter() - started)

    def serve(self, trace: Trace, t0: float = 0.0) -> list[SimRequest]:
        """Replay ``trace`` (arrivals shifted by ``t0``) on the fleet as it stands, until every request so
        far has finished; returns its requests. Called again, it continues the same fleet (pools, views
        and routers keep their state): a benchmark's segments one after another."""
        if t0 < self.now:
            raise ValueError(f"a trace cannot start at {t0} s, before the simulator's clock ({self.now} s)")
        base = len(self.requests)
        adapters = trace.adapters.tolist()
        arrivals = [t0 + a for a in trace.arrivals.tolist()]
        ins, outs = trace.input_lens.tolist(), trace.output_lens.tolist()
        reqs = [SimRequest(base + k, uid, arrivals[k], ins[k], outs[k], self.ranks[uid])
                for k, uid in enumerate(self.uid_of(a) for a in adapters)]
        self.requests += reqs
        if not self._started:
            self._started = True
            if self.feed is not None:
                self.at(self.config.lag_s, self._sync_tick)
                self.feed.start(self.router)
            if self.router.wants_model_ids:
                self._push_model_ids()
        total = len(self.requests)
        if not self.run_until(lambda: self.done >= total, arrivals, lambda k: self._route(reqs[k])):
            raise RuntimeError(f"nothing left to simulate with {total - self.done} requests unfinished")
        return reqs

    def _result(self, wall: float) -> SimResult:
        cfg = self.config
        first = int(len(self.requests) * cfg.warmup_fraction)
        measured = self.requests[first:]
        ttft = np.array([r.t_first - r.arrival for r in measured])
        e2e = np.array([r.t_done - r.arrival for r in measured])
        queue = np.array([r.t_admit - r.arrival for r in measured])
        waited = sum(1 for r in measured if r.t_admit > r.t_submit)
        loads = sum(1 for r in measured if r.loaded)
        disk = sum(1 for r in measured if r.disk)
        per_replica = np.bincount([r.replica for r in measured], minlength=len(self.replicas))
        pools = [r.pool for r in self.replicas]
        q = lambda a, p: float(np.percentile(a, p)) if len(a) else float("nan")
        return SimResult(
            router=cfg.router, replicas=cfg.replicas, adapters=self.trace.num_adapters, requests=len(measured),
            loads=loads, loads_total=sum(p.counters.loads for p in pools),
            hit_ratio=1.0 - loads / max(1, len(measured)),
            ttft_p50=q(ttft, 50), ttft_p99=q(ttft, 99), e2e_p50=q(e2e, 50), e2e_p99=q(e2e, 99),
            queue_p99=q(queue, 99), slot_waited=waited / max(1, len(measured)),
            imbalance=float(per_replica.max() / per_replica.mean()) if per_replica.mean() else float("nan"),
            load_seconds=float(sum(r.load_s for r in measured)), disk_loads=disk, retries=self.retries,
            evictions=sum(p.counters.evictions for p in pools), kinds=dict(self.router.kinds),
            sim_seconds=self.now, wall_seconds=wall,
            settings={k: v for k, v in asdict(cfg).items() if k != "costs"},
        )


def run_sim(trace: Trace, config: SimConfig) -> SimResult:
    return Simulator(trace, config).run()

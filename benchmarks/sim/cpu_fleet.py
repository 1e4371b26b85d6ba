"""``routing_live``'s fleet in simulation: closed-loop clients, engines and control plane on shared cores.

Why: the simulator may tune routing only once it reproduces what the live fleet does.
This model is ``benchmarks.routing_live``'s setup (replicas x slots, ``max_ongoing`` =
``max_batch``, S-LoRA traces, closed-loop clients at each concurrency) with:

- the project's own ``LoRAMemoryPool`` (slots, LRU) and ``engine.scheduler.Scheduler``
  (admission while the batch's adapters fit) per replica;
- the routers of ``benchmarks.sim.routers``: ``affinity`` (the product's policy, view and
  local state, fed by a lagged directory), ``multiplex`` (Serve's multiplexing) and
  ``pow2`` (Serve's default);
- an engine that steps: each step costs ``step_base_s + step_per_seq_s * batch +
  step_per_adapter_s * (distinct adapters - 1)`` CPU seconds (measured on the demo engine,
  ``measure_engine_steps``: each adapter in a batch is one more LoRA segment per module)
  plus the loads it makes (host-tier copies, disk reads), and gives every running request
  one token;
- the control plane's CPU, charged per request from a live run: the client process
  hosting the router (as latency before the request is routed, and as CPU), the
  directory and the metrics agent -- all on the same ``cores`` as the engines: while they
  run, each busy engine gets ``(cores - control-plane CPU rate) / busy engines`` of a
  core; and the workers' own per-request work (Serve's request handling), which runs in
  the replica's process and so lengthens the step that admits the request;
- with Serve's cache modelled, the replica's CPU for each send it refuses and each probe
  it answers (``ServeTimes.refusal_cpu_s``, ``probe_cpu_s``: measured by
  ``benchmarks.serve_release``), which lengthens the replica's next step the same way.

Loads: a variant on the product's worker reads an adapter from disk the first time a
replica uses it and copies it from the host tier after; the multiplexing baseline's
every load is a registration (a disk read), and Serve's LRU drops a replica's
least recently used model when it holds more than ``slots``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from engine.scheduler import Scheduler
from pool.adapter import AdapterConfig, LoRAAdapterWeights
from pool.memory_pool import LoRAMemoryPool, batch_order
from pool.shapes import LoRAModelShape

from routing.settings import DEFAULT_SETTINGS

from .config import SimConfig, SimRequest
from .costs import CostModel
from .events import EventLoop
from .feed import DirectoryFeed
from .routers import ROUTERS
from .serve_cache import ServeQueueCache, ServeTimes
from .serve_routing import ServeRoutingTasks

VARIANT_ROUTER = {"affinity": "affinity", "multiplexed": "multiplex", "pow2": "pow2"}


@dataclass(frozen=True)
class StepCost:
    """CPU seconds of one engine step: ``base_s + per_seq_s * rows + per_adapter_s * (distinct adapters - 1)``."""

    base_s: float
    per_seq_s: float
    per_adapter_s: float = 0.0

    def seconds(self, rows: float, adapters: float = 1.0) -> float:
        return self.base_s + self.per_seq_s * rows + self.per_adapter_s * max(0.0, adapters - 1.0)

    def scaled(self, factor: float) -> "StepCost":
        return StepCost(self.base_s * factor, self.per_seq_s * factor, self.per_adapter_s * factor)


@dataclass(frozen=True)
class ControlPlaneCpu:
    """CPU seconds per request outside the engines, for one variant (from a live run)."""

    router_s: float = 0.0        # the client process that hosts the router
    directory_s: float = 0.0
    metrics_agent_s: float = 0.0
    replica_s: float = 0.0       # the workers' per-request work besides engine steps (on that replica's core)

    @property
    def total_s(self) -> float:
        return self.router_s + self.directory_s + self.metrics_agent_s  # replica_s runs in the replica's process


@dataclass(frozen=True)
class CpuFleetConfig:
    variant: str = "affinity"
    replicas: int = 2
    slots: int = 4
    max_batch: int = 8
    cores: float = 2.0
    step_base_s: float = 0.004       # CPU seconds of one engine step ...
    step_per_seq_s: float = 0.002    # ... plus this per running request
    step_per_adapter_s: float = 0.0  # ... plus this per distinct adapter in the batch beyond the first

    @property
    def step(self) -> StepCost:
        return StepCost(self.step_base_s, self.step_per_seq_s, self.step_per_adapter_s)
    host_load_s: float = 0.0001      # a host-tier copy into a slot (wall seconds: the step waits for it)
    disk_load_s: float = 0.002       # a read from disk into the host tier (wall seconds: its requester waits)
    # the CPU part of each: the demo adapters' own copy and read; the rest of a load's seconds is waiting (a GPU
    # copy, storage), as routing_live injects it (benchmarks.live.load_cost sleeps)
    host_load_cpu_s: float = 0.0001
    disk_load_cpu_s: float = 0.002
    control: ControlPlaneCpu = field(default_factory=ControlPlaneCpu)
    lag_s: float = 0.05              # pool event -> router view
    rate_window_s: float = 2.0       # the control plane's CPU rate is averaged over this
    load_bound_epsilon: float = 0.25
    seed: int = 0
    serve_times: Optional[ServeTimes] = None  # Serve's own routers decide on its queue-length cache (serve_cache)


@dataclass
class CpuFleetResult:
    variant: str
    concurrency: int
    requests: int
    req_per_s: float
    p50_ms: float
    p99_ms: float
    loads: int
    engine_share: float   # mean share of a core each busy engine got
    workers_cpu_ms: float = 0.0  # the workers' CPU per request (steps, loads, per-request work): live's column
    refusals_per_request: float = 0.0  # sends a replica refused at its limit (Serve's cache model only)
    idle_share: float = float("nan")   # mean share of the run a replica had no request (its own count)
    sends_at_full_cache: float = float("nan")  # sends where the router's cache already counted the limit
    probe_p50_ms: float = float("nan")
    probe_timeouts: float = float("nan")


class _Client:
    __slots__ = ("queue",)

    def __init__(self, queue: deque):
        self.queue = queue


class _Replica:
    __slots__ = ("idx", "rid", "pool", "sched", "registered", "busy", "tokens", "side_cpu_s")

    def __init__(self, idx: int, rid: str, cfg: CpuFleetConfig, fetch, listener):
        self.idx, self.rid = idx, rid
        self.pool = LoRAMemoryPool(LoRAModelShape(num_layers=0, modules={}), cfg.slots, 64, fetch,
                                   replica_id=rid)
        if listener is not None:
            self.pool.subscribe(listener)
        pool = self.pool
        self.sched: Scheduler[SimRequest] = Scheduler(pool.validate_lora_batch, lambda u: u in pool.pinned,
                                                      cfg.max_batch, 16)
        self.registered: OrderedDict[str, float] = OrderedDict()  # adapter -> when its read is done (LRU order)
        self.busy = False
        self.tokens: dict[int, int] = {}  # request index -> tokens still to generate
        self.side_cpu_s = 0.0  # CPU besides steps (refusals, probes, disk reads) not yet charged to a step


class CpuFleet(EventLoop):
    """One variant, one concurrency level, one request list (``(adapter, prompt chars, max_tokens)``), on the
    simulators' event loop (``events.EventLoop``); clients issue a request when their last one finishes."""

    def __init__(self, requests: list[tuple[str, str, int]], concurrency: int, cfg: CpuFleetConfig):
        super().__init__()
        self.cfg = cfg
        self.ids = tuple(f"replica-{i:04d}" for i in range(cfg.replicas))
        self.step_cost = cfg.step
        self.max_ongoing = cfg.max_batch
        self.ongoing = np.zeros(cfg.replicas, dtype=np.float64)
        self.config = SimConfig(replicas=cfg.replicas, router=VARIANT_ROUTER[cfg.variant], slots=cfg.slots,
                                max_batch=cfg.max_batch, lag_s=cfg.lag_s, load_bound_epsilon=cfg.load_bound_epsilon,
                                seed=cfg.seed, costs=CostModel(), warmup_fraction=0.0,
                                prior_load_s=(cfg.host_load_s, cfg.disk_load_s),
                                prior_request_s=8 * cfg.step.seconds(1))
        self.router = ROUTERS[self.config.router](self)
        self.feed: Optional[DirectoryFeed] = None
        listener = None
        if self.router.uses_view:
            self.feed = DirectoryFeed(lambda: self.now, cfg.lag_s, cfg.max_batch, settings=self.config.routing)
            listener = self.feed.on_pool_event
        self.replicas = [_Replica(i, rid, cfg, self._fetch, listener) for i, rid in enumerate(self.ids)]
        if self.feed is not None:
            for replica in self.replicas:
                self.feed.join(replica.rid, replica.pool.snapshot())
        self.requests = [SimRequest(i, a, 0.0, len(p), n, 16) for i, (a, p, n) in enumerate(requests)]
        self.concurrency = concurrency
        self.pending: deque[SimRequest] = deque()   # arrived, not yet being routed
        self.active: list[SimRequest] = []          # being routed (Serve's routing tasks), oldest first
        # Serve routes 2 x replicas waiting requests at once; the affinity router asks for more
        self.routing_tasks = 2 * cfg.replicas
        if self.router.waits_for_capacity:
            self.routing_tasks = max(self.routing_tasks, DEFAULT_SETTINGS.max_routing_tasks)
            self.serve_tasks: Optional[ServeRoutingTasks] = None
        self.serve_cache: Optional[ServeQueueCache] = None
        if cfg.serve_times is not None:  # every router's sends go through Serve's cache and may be refused
            self.serve_cache = ServeQueueCache(self, cfg.serve_times, self.max_ongoing,
                                               lambda i: int(self.ongoing[i]), np.random.default_rng(cfg.seed + 31),
                                               on_probe=self._probed_replica)
        if not self.router.waits_for_capacity:  # Serve's own routers: its routing loop, backoff and hand-over
            self.serve_tasks = ServeRoutingTasks(
                self, cfg.replicas, lambda req: self.router.route(req, self.now), self._dispatch,
                self.config.backoff_initial_s, self.config.backoff_max_s,
                model_id=(lambda req: req.uid) if cfg.variant == "multiplexed" else None, cache=self.serve_cache,
                candidates=(lambda req: self.router.candidates(req, self.now)[0]) if self.serve_cache else None)
        self.refusals = 0
        self.idle_s = np.zeros(cfg.replicas)     # time each replica spent with no request (its own count) ...
        self.counted_since = np.zeros(cfg.replicas)  # ... up to here
        self.cpu_log: deque[tuple[float, float]] = deque()  # (time, control-plane CPU seconds spent)
        self.share_sum = self.share_n = 0.0
        self.workers_cpu_s = 0.0
        self.loads = 0
        self.done = 0
        self._model_ids: Optional[list[frozenset[str]]] = None

    # ------------------------------------------------------------------ plumbing

    def _fetch(self, uid: str) -> LoRAAdapterWeights:
        return LoRAAdapterWeights(name=uid, config=AdapterConfig(rank=16, alpha=32.0, use_rslora=False,
                                                                 target_modules=()), a={}, bt={})

    def _control_rate(self) -> float:
        """Control-plane CPU seconds per second over the last ``rate_window_s``."""
        window = self.cfg.rate_window_s
        log = self.cpu_log
        while log and log[0][0] < self.now - window:
            log.popleft()
        return sum(c for _, c in log) / window

    def _engine_share(self) -> float:
        busy = sum(1 for r in self.replicas if r.busy) or 1
        spare = max(0.05, self.cfg.cores - self._control_rate())
        return min(1.0, spare / busy)

    # ------------------------------------------------------------------ clients and routing

    def _issue(self, req: SimRequest) -> None:
        """A client sends ``req``: its router's CPU is latency before routing (and load on the cores)."""
        req.arrival = self.now
        cpu = self.cfg.control
        self.cpu_log.append((self.now, cpu.total_s))
        contention = max(1.0, (self._control_rate() + sum(r.busy for r in self.replicas)) / self.cfg.cores)
        self.at(self.now + cpu.router_s * contention, self._arrive, req)

    def _arrive(self, req: SimRequest) -> None:
        """Serve's own routers queue the request in their routing loop (``ServeRoutingTasks``); the affinity
        router takes at most ``routing_tasks`` requests at a time."""
        if self.serve_tasks is not None:
            self.serve_tasks.arrive(req)
            return
        self.pending.append(req)
        self._pump()

    def _pump(self) -> None:
        while self.pending and len(self.active) < self.routing_tasks:
            req = self.pending.popleft()
            self.active.append(req)
            self._route(req)

    def _route(self, req: SimRequest) -> None:
        if req.replica >= 0 or req not in self.active:
            return  # a poll or retry for a request already placed
        idx = self.router.route(req, self.now)
        if idx is not None:
            self.active.remove(req)
            self._dispatch(req, idx)
            self._pump()
            return
        req.attempt += 1
        # the affinity router waits: woken by a completion (``_finish``), as live; no polling (Serve's own
        # routers never come here: ``serve_routing.ServeRoutingTasks`` places their requests)

    @property
    def accepts_later(self) -> bool:
        return self.serve_cache is not None

    @property
    def seen_ongoing(self) -> np.ndarray:
        """The product's router's counts: Serve's cached count where it has one (its own sends counted at once,
        as the live router adds the ones it chose and Serve has not sent), else the replica's own."""
        cache = self.serve_cache
        if cache is None:
            return self.ongoing
        seen = self.ongoing.copy()
        for i, q in cache.cached.items():
            seen[i] = q
        return seen

    def _dispatch(self, req: SimRequest, idx: int) -> None:
        req.replica = idx
        cache = self.serve_cache
        if cache is None:
            self._accept(req, idx)
            return
        if self.serve_tasks is None:  # the product's router: its choice counts against the replica at once
            self._send(req, idx)
            return
        # the request's own coroutine sends it (and Serve's cache counts it) on the event loop's next turn: a
        # routing task that goes on choosing in this turn still sees the count without it
        self.at(self.now, self._send, req, idx)

    def _send(self, req: SimRequest, idx: int) -> None:
        self.serve_cache.sent(idx)
        self.at(self.now + self.serve_cache.rpc_s(idx) / 2, self._deliver, req, idx)

    def _deliver(self, req: SimRequest, idx: int) -> None:
        """A send reaches replica ``idx``: accepted below its limit, else refused and routed again (its count
        goes back either way)."""
        cache = self.serve_cache
        if self.ongoing[idx] < self.max_ongoing:
            self._accept(req, idx)
        else:
            self.refusals += 1
            self._replica_work(idx, cache.times.refusal_cpu_s)
            self.at(self.now + cache.rpc_s(idx) / 2, self._refused, req)
        self.at(self.now + cache.rpc_s(idx) / 2, cache.replied, idx, int(self.ongoing[idx]))

    def _probed_replica(self, idx: int) -> None:
        self._replica_work(idx, self.serve_cache.times.probe_cpu_s)

    def _replica_work(self, idx: int, seconds: float) -> None:
        """Replica ``idx``'s process spends ``seconds`` of CPU besides its steps (a Serve message, a read from
        disk): a busy replica's next step waits for it (one core: the engine thread and the replica's other
        threads share it); an idle one has the core to itself."""
        replica = self.replicas[idx]
        if replica.busy:
            replica.side_cpu_s += seconds
        else:
            self.workers_cpu_s += seconds

    def _refused(self, req: SimRequest) -> None:
        if self.serve_tasks is not None:
            self.serve_tasks.retry(req)
            return
        req.replica = -1  # the product's router decides again (Serve hands the request back to it)
        k = len(self.active)
        while k > 0 and self.active[k - 1].arrival > req.arrival:
            k -= 1
        self.active.insert(k, req)
        self._route(req)

    def _count_change(self, idx: int, delta: int) -> None:
        if self.ongoing[idx] == 0:
            self.idle_s[idx] += self.now - self.counted_since[idx]
        self.counted_since[idx] = self.now
        self.ongoing[idx] += delta

    def _accept(self, req: SimRequest, idx: int) -> None:
        req.replica = idx
        req.t_dispatch = self.now
        self._count_change(idx, +1)
        if self.accepts_later and self.router.waits_for_capacity:
            self.router.accepted(req, idx)
        replica = self.replicas[idx]
        ready = self._read(replica, req.uid)
        if ready > self.now:
            self.at(ready, self._admit, replica, req)
        else:
            self._admit(replica, req)

    def _admit(self, replica: _Replica, req: SimRequest) -> None:
        """``req``'s adapter is in the replica's host tier: into its engine's queue."""
        replica.sched.add(req)
        if not replica.busy:
            replica.busy = True
            self.at(self.now, self._step, replica)

    # ------------------------------------------------------------------ engine

    def _step(self, replica: _Replica) -> None:
        """A step boundary: requests whose last token came in the step that just ended complete;
        then admit, load what the batch lacks, and give every running request a token."""
        cfg = self.cfg
        for req in [r for r in replica.sched.running if replica.tokens.get(r.i, 1) <= 0]:
            self._finish(replica, req)
        admitted = replica.sched.admit()
        for req in admitted:
            replica.tokens[req.i] = req.out_len
        running = replica.sched.running
        if not running:
            replica.busy = False
            replica.pool.release_batch()
            return
        uids = replica.sched.running_uids()
        missing = [u for u in batch_order(uids) if u is not None and not replica.pool.is_resident(u)]
        replica.pool.prepare_lora_batch(uids)
        self.loads += len(missing)
        stall = cfg.host_load_s * len(missing)  # host-tier copies at the step boundary: the batch waits
        share = self._engine_share()
        self.share_sum += share
        self.share_n += 1
        for req in running:
            replica.tokens[req.i] -= 1
        adapters = len({u for u in uids if u is not None})
        cpu = (self.step_cost.seconds(len(running), adapters) + cfg.control.replica_s * len(admitted)
               + replica.side_cpu_s)
        replica.side_cpu_s = 0.0
        self.workers_cpu_s += cpu + cfg.host_load_cpu_s * len(missing)
        self.at(self.now + cpu / share + stall, self._step, replica)

    def _read(self, replica: _Replica, uid: str) -> float:
        """When ``uid`` is in the replica's host tier: at once if it is (or when the read under way ends); else a
        read from disk starts now, off the engine thread, as the live worker reads before it submits (the
        requester waits, the batch does not). The multiplexing baseline's Serve LRU unregisters the least
        recently used adapter beyond ``slots`` (host copy and all)."""
        registered = replica.registered
        if uid in registered:
            registered.move_to_end(uid)
            return registered[uid]
        ready = self.now + max(self.cfg.disk_load_s, self.cfg.disk_load_cpu_s)
        registered[uid] = ready
        self._replica_work(replica.idx, self.cfg.disk_load_cpu_s)
        if self.cfg.variant == "multiplexed":
            while len(registered) > self.cfg.slots:
                registered.popitem(last=False)
        return ready

    def _sync_tick(self) -> None:
        """Every ``lag_s``: the pushes below, then the next tick."""
        self._sync()
        self.at(self.now + self.cfg.lag_s, self._sync_tick)

    def _sync(self) -> None:
        """The directory's delta to a view router; to the multiplexing router, each replica's model ids
        (its multiplexer's registered adapters) as they were one push earlier (Serve's 100 ms push,
        then the controller's broadcast)."""
        if self.feed is not None:
            self.feed.sync(self.router)
        if self.router.wants_model_ids:
            if self._model_ids is not None:
                self.router.model_ids_pushed(self._model_ids)
            self._model_ids = [frozenset(r.registered) for r in self.replicas]

    def _finish(self, replica: _Replica, req: SimRequest) -> None:
        req.t_done = self.now
        replica.sched.finish(req)
        replica.tokens.pop(req.i, None)
        replica.pool.retain_batch(replica.sched.running_uids())
        self.done += 1
        if self.feed is not None:
            self.feed.record_busy(replica.rid, req.uid, self.now - req.t_dispatch)
        times = self.cfg.serve_times if self.serve_cache is not None else None
        if times is None:
            self._count_change(replica.idx, -1)
            self._heard(req)
            return
        # the replica releases its count a moment after the result leaves; the client (and Serve's cache) hear
        # of the result a moment after it leaves, in either order (benchmarks.serve_release)
        cache = self.serve_cache
        self.at(self.now + cache.busy_scaled(times.release, replica.idx), self._count_change, replica.idx, -1)
        req.t_done = self.now + cache.busy_scaled(times.client, replica.idx)
        self.at(req.t_done, self._heard, req)

    def _heard(self, req: SimRequest) -> None:
        """The client has ``req``'s result: the router's bookkeeping, then the client's next request."""
        if self.serve_cache is not None:
            self.serve_cache.result(req.replica)
        self.router.finished(req)
        if self.router.waits_for_capacity:
            for waiting in list(self.active):
                self._route(waiting)
        self._next(req)

    # ------------------------------------------------------------------ loop

    def _next(self, finished: Optional[SimRequest]) -> None:
        if self._cursor < len(self.requests):
            req = self.requests[self._cursor]
            self._cursor += 1
            self._issue(req)

    def run(self) -> CpuFleetResult:
        started = time.perf_counter()
        self._cursor = 0
        if self.feed is not None:
            self.feed.start(self.router)
        if self.feed is not None or self.router.wants_model_ids:
            self.at(self.cfg.lag_s, self._sync_tick)
        for _ in range(min(self.concurrency, len(self.requests))):
            self._next(None)
        n = len(self.requests)
        self.run_until(lambda: self.done >= n)
        for idx in range(self.cfg.replicas):
            self._count_change(idx, 0)  # the idle time up to now
        lat = np.array([r.t_done - r.arrival for r in self.requests]) * 1000.0
        first = min(r.arrival for r in self.requests)
        wall = max(r.t_done for r in self.requests) - first
        del started
        return CpuFleetResult(self.cfg.variant, self.concurrency, n, n / wall if wall > 0 else float("nan"),
                              float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), self.loads,
                              self.share_sum / max(1, self.share_n), 1000.0 * self.workers_cpu_s / max(1, n),
                              **self._serve_stats(n))

    def _serve_stats(self, n: int) -> dict:
        """Refusals per request and the replicas' idle share; with Serve's cache modelled, its sends and probes."""
        out = {"refusals_per_request": self.refusals / max(1, n),
               "idle_share": float(np.mean(self.idle_s)) / self.now if self.now > 0 else float("nan")}
        cache = self.serve_cache
        if cache is not None:
            out.update(sends_at_full_cache=cache.sends_at_full_cache / max(1, cache.sends),
                       probe_p50_ms=1000.0 * float(np.median(cache.probe_call_s)) if cache.probe_call_s else float("nan"),
                       probe_timeouts=cache.probe_timeouts / max(1, cache.probes))
        return out


def run_cpu_fleet(requests: list[tuple[str, str, int]], concurrency: int, cfg: CpuFleetConfig,
                  warmup: Optional[list[tuple[str, str, int]]] = None) -> CpuFleetResult:
    """Warm-up pass (not counted) then the measured pass, on one fleet (pools stay warm between them)."""
    fleet = CpuFleet((warmup or []) + requests, concurrency, cfg)
    result = fleet.run()
    if warmup:
        measured = fleet.requests[len(warmup):]
        lat = np.array([r.t_done - r.arrival for r in measured]) * 1000.0
        wall = max(r.t_done for r in measured) - min(r.arrival for r in measured)
        result = replace(result, requests=len(measured), req_per_s=len(measured) / wall,
                         p50_ms=float(np.percentile(lat, 50)), p99_ms=float(np.percentile(lat, 99)))
    return result


def measure_engine_steps(batch_sizes: tuple[int, ...] = (1, 2, 4, 8), tokens: int = 24,
                         repeats: int = 3, adapter_counts: tuple[int, ...] = (1, 2, 4)) -> StepCost:
    """The demo engine's seconds per step, measured here with one torch thread (as each worker replica runs):
    against the batch size on one adapter (least squares: base and per running request), and at the largest
    batch against the number of distinct adapters in it (least squares: per adapter beyond the first).

    Why the adapter term: a batch over k adapters runs k LoRA segments per module; the affinity router's
    batches hold fewer adapters than a spreading router's, and a model without the term prices both alike."""
    import asyncio

    import torch

    from deployments.config import AppArgs
    from engine.demo import ensure_demo_assets
    from engine.engine import LoRAEngine
    from engine.request import GenerateRequest

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assets = ensure_demo_assets()
    slots = max(adapter_counts)
    engine = LoRAEngine(AppArgs(base_model=str(assets.model_dir), max_loras_per_batch=slots, max_lora_rank=16,
                                max_batch_size=max(batch_sizes), max_model_len=256).engine_config())
    names = list(assets.adapters)[:slots]

    async def batch(size: int, adapters: int) -> tuple[float, int]:
        started = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(GenerateRequest(adapter=names[i % adapters],
                                                                         prompt="hello there", max_tokens=tokens))
                                         for i in range(size)))
        return time.perf_counter() - started, max(r.completion_tokens for r in results) + 1  # + the prefill step

    def per_step(size: int, adapters: int) -> float:
        wall, steps = min(asyncio.run(batch(size, adapters)) for _ in range(repeats))  # the fastest
        return wall / steps

    try:
        for name in names:
            engine.register_adapter(name, str(assets.adapters[name]))
        asyncio.run(batch(max(batch_sizes), slots))  # every adapter resident, every path warm
        xs = np.array(batch_sizes, dtype=float)
        slope, intercept = np.polyfit(xs, np.array([per_step(size, 1) for size in batch_sizes]), 1)
        counts = [k for k in adapter_counts if k <= max(batch_sizes)]
        per_adapter = 0.0
        if len(counts) > 1:
            per_adapter = float(np.polyfit(np.array(counts, dtype=float),
                                           np.array([per_step(max(batch_sizes), k) for k in counts]), 1)[0])
        return StepCost(max(float(intercept), 1e-4), max(float(slope), 0.0), max(per_adapter, 0.0))
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)

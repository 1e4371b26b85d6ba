"""One simulated replica: the live worker's and engine's time semantics under the one cost model.

Why: the simulator may stand in for the live fleet only if it prices a load as the live
worker pays it; ``benchmarks/live/emulated.py`` is the exact definition of that time model
(the forward, the slot copy and the disk read are sleeps of ``CostModel``'s times), and this
module charges the same times at the same points:

- **Disk read** (the adapter is in neither a slot nor the host tier): before the request
  reaches the engine, off the engine thread (``deployments/worker_adapters.py`` ``ensure_entry``).
  The requester waits ``disk_read_s(rank)``, holding its Serve row; the batch does not.
  Reads of different adapters overlap; a second request for an adapter being read waits for
  that read (the worker's per-uid lock).
- **Multiplexing baseline** (``benchmarks/live/multiplexed_worker.py`` under Serve's
  ``_ModelMultiplexWrapper``): a model not among the replica's ``slots`` models waits for the
  wrapper's lock (one load or unload at a time per replica); at ``slots`` models the least
  recently requested one is unloaded first, which drains that adapter's submitted requests
  (``unregister_adapter``) and drops its slot and host copy; then the registration (a disk read).
- **Engine steps** (``engine/engine.py`` ``_step``), back to back while there is work: the
  real ``Scheduler`` admits at the step's start; slots for newly needed adapters are copied
  from the host tier, ``host_copy_s(rank)`` each, on the engine thread (the whole step
  stalls); then the forward takes ``step_s(prefill tokens)``, the prefill chunked under the
  token budget exactly as ``Scheduler.plan_step`` plans it (decode rows are not prefill, as
  the emulated forward counts). At the step's end every fed request whose tokens are all
  computed gets a token (the first ends its prompt: its TTFT); one with ``out_len`` tokens ends.

Decode-only stretches (no prefill, no copy, nothing admissible) are identical steps, so they
are simulated as one event of ``k`` steps, cut at the next step boundary when the engine's
state changes meanwhile (a request submitted, a slot freed): the same times as stepping one by
one, at a fraction of the events.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from engine.scheduler import Scheduler
from engine.step_loop import PREFILL_TIMED_MIN_TOKENS
from pool.host_cache import HostAdapterCache
from pool.memory_pool import LoRAMemoryPool, batch_order
from pool.shapes import LoRAModelShape
from routing.load_timings import LoadTimings
from routing.prefetch import prefetches

from .config import SimConfig, SimRequest
from .costs import CostModel


class Loop(Protocol):
    """What a replica needs from the event loop (``fleet.Simulator``)."""

    now: float

    def at(self, t: float, action: Callable[[], None]) -> None: ...

    def request_finished(self, req: SimRequest) -> None: ...


@dataclass(frozen=True)
class SimulatedAdapter:
    """A host-tier entry with no tensors: its size is all ``pool.host_cache.HostAdapterCache`` reads, so
    the simulated replica keeps its host tier in that same class and evicts exactly as a live one."""

    nbytes: float


class SimReplica:
    """A worker replica: its Serve rows, disk reads, multiplexer (baseline only) and stepping engine."""

    def __init__(self, idx: int, rid: str, config: SimConfig, fetch, listener, loop: Loop,
                 ranks: dict[str, int], multiplexed: bool):
        self.idx, self.rid, self.loop, self.ranks = idx, rid, loop, ranks
        self.costs: CostModel = config.costs
        self.multiplexed = multiplexed
        self.slots = config.slots
        self.pool = LoRAMemoryPool(LoRAModelShape(num_layers=0, modules={}), config.slots, config.max_lora_rank,
                                   fetch, eviction_policy=config.eviction_policy, replica_id=rid)
        if listener is not None:
            self.pool.subscribe(listener)
        pool = self.pool
        self.sched: Scheduler[SimRequest] = Scheduler(pool.validate_lora_batch, lambda u: u in pool.pinned,
                                                      config.max_batch, config.max_bypass_steps,
                                                      max_num_batched_tokens=self.costs.token_budget)
        self.host: HostAdapterCache[SimulatedAdapter] = HostAdapterCache(self.costs.host_cache_bytes,
                                                                         pin_memory=False)
        self.reading: dict[str, list[SimRequest]] = {}   # uid -> requests waiting for its disk read
        self.read_threads: Optional[int] = config.read_threads  # reads at once (None: no limit)
        self._reads_running = 0
        self._reads_queued: deque[tuple[str, float]] = deque()  # (uid, asked at) waiting for a thread
        self.planned: set[str] = set()     # what the plan puts here, as this replica last heard it
        self.inflight: Counter = Counter()               # uid -> requests submitted to the engine, not finished
        self.models: OrderedDict[str, None] = OrderedDict()  # multiplexer's loaded models, LRU first
        self.mux_queue: deque[SimRequest] = deque()      # requests waiting for the multiplexer's lock
        self.mux_loading: Optional[SimRequest] = None    # the request whose model load holds the lock
        self.mux_draining: Optional[str] = None          # the unloaded model whose requests must finish first
        self.served = 0
        self.ongoing = 0  # dispatched here, not finished (Serve's count, routable or not)
        self.copies = 0
        self.disk_reads = 0
        self.copy_s = 0.0
        self.disk_s = 0.0
        self.steps = 0
        self.timings = LoadTimings()  # the worker's measured load seconds, reported in its heartbeat
        self.prefill_timed = (0, 0.0)  # as the engine times its prefill-heavy steps (engine.step_loop)
        self.max_batch = config.max_batch
        self._gen = 0                      # bumps when a scheduled step end is superseded
        self._stepping = False
        self._plan: list[tuple[SimRequest, int]] = []
        self._macro: Optional[tuple[float, int]] = None  # (start, steps) of a decode-only stretch
        self._aged: Optional[SimRequest] = None  # the request this step's admission found blocked

    # ------------------------------------------------------------------ arrival at the worker

    def dispatch(self, req: SimRequest) -> None:
        """Serve delivered ``req`` here (it holds a row from now until it finishes)."""
        self.ongoing += 1
        if self.multiplexed:
            if req.uid in self.models:
                self.models.move_to_end(req.uid)
                self.submit(req)
            else:
                self.mux_queue.append(req)
                self._mux_pump()
            return
        uid = req.uid
        if uid in self.reading:
            self.reading[uid].append(req)
        elif self.pool.is_resident(uid) or self.host.get(uid) is not None:
            self.submit(req)
        else:
            self.reading[uid] = [req]
            self._read(uid, req)

    def follow_plan(self, planned: list[str], kept: Optional[list[str]] = None, at_once: bool = False) -> None:
        """As a live worker with ``replicas_follow_plan`` (``PlanFollower.changed``): the pool evicts last
        the adapters the plan gives a slot here (``kept``; None: all planned), and what the plan newly puts
        here (``routing.prefetch.prefetches``: not planned before, not resident, not staged) is read into the
        host tier ahead of traffic, off the step.

        ``at_once``: the reads are done before traffic (a deploy: no simulated time passes), and, as live,
        the first of them go into free slots too (the worker's one-token warm request). During traffic the
        reads take their time and stay in the host tier: the live worker would also copy one into a free
        slot, but a pool under traffic has none (the difference is left out)."""
        self.pool.keep(planned if kept is None else kept)
        todo = prefetches(planned, self.planned, resident={u for u in planned if self.pool.is_resident(u)},
                          staged={u for u in planned if u in self.host or u in self.reading},
                          free_slots=self.pool.snapshot().free_slots if at_once else 0)
        for item in todo:
            if at_once:
                self.warm(item.name, into_slot=item.into_slot)
            elif item.name not in self.reading and item.name not in self.host:
                self.reading[item.name] = []
                self._read(item.name, None)
        self.planned = set(planned)

    def warm(self, uid: str, into_slot: bool) -> None:
        """Before traffic (a warm start or a deploy-time prefetch): read ``uid`` into the host tier and, with
        ``into_slot``, copy it into a slot, at once; timed as the live worker times them (its load prices)."""
        rank = self.ranks[uid]
        if uid not in self.host:
            self.timings.observe_disk(self.costs.disk_read_s(rank))
            self.keep_on_host(uid)
        if into_slot and not self.pool.is_resident(uid):
            self.pool.prepare_lora_batch({uid})
            self.pool.release_batch()
            self.copies += 1
            self.copy_s += self.costs.host_copy_s(rank)

    def keep_on_host(self, uid: str) -> None:
        """``uid`` was read from disk: the host tier keeps it (evicting its least recently used)."""
        self.host.put(uid, SimulatedAdapter(self.costs.adapter_bytes(self.ranks[uid])))

    def fetch_to_host(self, uid: str) -> bool:
        """Whether ``uid`` was in the host tier (a use); a miss reads it in at once (a warm start or rehoming)."""
        if self.host.get(uid) is not None:
            return True
        self.keep_on_host(uid)
        return False

    def _read(self, uid: str, req: Optional[SimRequest]) -> None:
        """A disk read into the host tier, off the engine thread; its waiters are submitted when it ends.
        The live worker reads in ``asyncio.to_thread``, on its event loop's default executor: with every
        thread busy reading, the next read waits for one (``read_threads``)."""
        seconds = self.costs.disk_read_s(self.ranks[uid])
        self.disk_reads += 1
        self.disk_s += seconds
        if req is not None:
            req.disk, req.load_s = True, req.load_s + seconds
        if self.read_threads is not None and self._reads_running >= self.read_threads:
            self._reads_queued.append((uid, self.loop.now))
            return
        self._start_read(uid, self.loop.now)

    def _start_read(self, uid: str, asked: float) -> None:
        self._reads_running += 1
        seconds = self.costs.disk_read_s(self.ranks[uid])
        self.loop.at(self.loop.now + seconds, lambda: self._read_done(uid, asked))

    def _read_done(self, uid: str, asked: float) -> None:
        self._reads_running -= 1
        self.timings.observe_disk(self.loop.now - asked)  # as the worker times it: the wait for a thread too
        self.keep_on_host(uid)
        waiters = self.reading.pop(uid, ())
        for req in waiters:
            self.submit(req)
        if not waiters:  # a background re-read: the requeued requests may go now
            self._wake()
        if self._reads_queued:
            self._start_read(*self._reads_queued.popleft())

    def heartbeat(self) -> dict:
        """What the live worker's heartbeat tells the directory besides busy seconds
        (``LoRAWorker._state_extras``): routers price a load on this replica by it (a host copy
        where the adapter is host-cached or being read, else a disk read; both as measured here)."""
        self.timings.observe_pool(self.copies, self.copy_s)
        self.timings.observe_prefill(*self.prefill_timed)
        return {"queue_len": len(self.sched), "host_cached": sorted(self.host.uids()),
                "loading": sorted(self.reading), "rows": self.max_batch, "load_s": self.timings.report()}

    # ------------------------------------------------------------------ multiplexing baseline

    def model_ids(self) -> frozenset[str]:
        """The multiplexer's loaded models plus those loading or waiting for its lock (Serve pushes both)."""
        loading = {r.uid for r in self.mux_queue}
        if self.mux_loading is not None:
            loading.add(self.mux_loading.uid)
        return frozenset(self.models).union(loading)

    def _mux_pump(self) -> None:
        """Serve's wrapper: one load at a time, FIFO; a model loaded meanwhile is used at once."""
        while self.mux_loading is None and self.mux_queue:
            req = self.mux_queue.popleft()
            if req.uid in self.models:
                self.models.move_to_end(req.uid)
                self.submit(req)
                continue
            self.mux_loading = req
            if len(self.models) >= self.slots:
                victim, _ = self.models.popitem(last=False)
                if self.inflight[victim] > 0:
                    self.mux_draining = victim  # resumed by the victim's last finish
                    return
                self._unload(victim)
            self._mux_register(req)

    def _unload(self, uid: str) -> None:
        self.pool.remove(uid)
        self.host.remove(uid)
        self._wake()  # a freed slot: the next step boundary may admit a request it blocked

    def _mux_register(self, req: SimRequest) -> None:
        uid = req.uid
        seconds = self.costs.disk_read_s(self.ranks[uid])
        self.disk_reads += 1
        self.disk_s += seconds
        req.disk, req.load_s = True, req.load_s + seconds
        self.loop.at(self.loop.now + seconds, lambda: self._mux_registered(req))

    def _mux_registered(self, req: SimRequest) -> None:
        self.models[req.uid] = None
        self.keep_on_host(req.uid)
        self.mux_loading = None
        self.submit(req)
        self._mux_pump()

    # ------------------------------------------------------------------ engine

    def submit(self, req: SimRequest) -> None:
        """``engine.submit``: queued for admission at the next step boundary."""
        req.t_submit = self.loop.now
        self.inflight[req.uid] += 1
        self.sched.add(req)
        self._wake()

    def _wake(self) -> None:
        """New work: start a step if idle; cut a decode-only stretch at its next step boundary."""
        if not self._stepping:
            self._start_step()
            return
        if self._macro is None:
            return
        start, k = self._macro
        d = self.costs.step_wall_s(0)
        done = max(1, math.ceil((self.loop.now - start) / d - 1e-9))
        if done < k:
            self._schedule_end(start + done * d, done)

    def _schedule_end(self, t: float, macro_steps: int) -> None:
        self._gen += 1
        gen = self._gen
        if macro_steps:
            self._macro = (self._macro[0] if self._macro else self.loop.now, macro_steps)
        self.loop.at(t, lambda: self._end_step(gen))

    def _start_step(self) -> None:
        sched, pool, costs, now = self.sched, self.pool, self.costs, self.loop.now
        before = [(r, r.blocked_steps) for r in sched.waiting]
        admitted = sched.admit()
        self._aged = next((r for r, b in before if r.blocked_steps > b), None)  # the blocked head, if any
        for req in admitted:
            req.t_admit = now
        if admitted:
            self._restage(admitted)
        if not sched.running:
            self._stepping = False
            self._macro = None
            pool.release_batch()
            return
        self._stepping = True
        uids = sched.running_uids()
        missing = [u for u in batch_order(uids) if u is not None and not pool.is_resident(u)]
        pool.prepare_lora_batch(uids)
        stall = 0.0
        for uid in missing:
            seconds = costs.host_copy_s(self.ranks[uid])
            stall += seconds
            self.copies += 1
            self.copy_s += seconds
            self.host.get(uid)  # the copy is a use of its host copy (LRU order), as live
            first = next((r for r in admitted if r.uid == uid), None)  # the request whose admission needed it
            if first is not None:
                first.loaded, first.load_s = True, first.load_s + seconds
        plan = sched.plan_step()
        sched.note_plan(plan)
        self._plan = plan
        prefill = sum(n for seq, n in plan if n > 1 or seq.num_computed == 0)
        if not prefill and not missing and not admitted:
            k = min(r.out_len - r.generated for r in sched.running)
            if k > 1:
                self._macro = (now, k)
                self._schedule_end(now + k * costs.step_wall_s(0), k)
                return
        self._macro = None
        if prefill >= PREFILL_TIMED_MIN_TOKENS:
            tokens, seconds = self.prefill_timed
            self.prefill_timed = (tokens + prefill, seconds + costs.step_wall_s(prefill))
        self._schedule_end(now + stall + costs.step_wall_s(prefill), 0)

    def _restage(self, admitted: list[SimRequest]) -> None:
        """An admitted adapter the host tier dropped since its submission: the request goes back to the
        queue's front and the adapter is read in the background (``LoRAEngine._prepare_slots``)."""
        lost = {r.uid for r in admitted if not self.pool.is_resident(r.uid) and r.uid not in self.host}
        if not lost:
            return
        culprits = [r for r in admitted if r.uid in lost]
        for r in culprits:
            admitted.remove(r)
        self.sched.requeue_front(culprits)
        for uid in lost:
            if uid not in self.reading:
                self.reading[uid] = []
                self._read(uid, None)

    def _end_step(self, gen: int) -> None:
        if gen != self._gen:
            return  # superseded: a submission cut the stretch short
        now = self.loop.now
        finished: list[SimRequest] = []
        if self._macro is not None:
            steps = self._macro[1]
            self.steps += steps
            if self._aged is not None and self._aged in self.sched.waiting:
                self._aged.blocked_steps += steps - 1  # each step of the stretch found it blocked again
            for req in self.sched.running:
                req.generated += steps
                req.num_computed += steps
                if req.generated >= req.out_len:
                    finished.append(req)
        else:
            self.steps += 1
            for req, n in self._plan:
                req.num_computed += n
                if req.num_computed < req.num_tokens:
                    continue  # a prefill chunk cut short by the budget: no token yet
                req.generated += 1
                if req.generated == 1:
                    req.t_first = now
                if req.generated >= req.out_len:
                    finished.append(req)
        self._macro = None
        self._plan = []
        for req in finished:
            self.sched.finish(req)
            self.inflight[req.uid] -= 1
            req.t_done = now
            self.served += 1
            self.ongoing -= 1
        if finished:
            self.pool.retain_batch(self.sched.running_uids())
        for req in finished:
            self.loop.request_finished(req)
            if self.mux_draining == req.uid and not self.inflight[req.uid]:
                self.mux_draining = None
                self._unload(req.uid)
                self._mux_register(self.mux_loading)
        self._start_step()

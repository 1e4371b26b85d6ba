"""Replicas joining and leaving the simulated fleet mid-trace, cold or warm.

Why: Serve adds a replica with empty slots and routes to it at once; the live warm start
(``routing.warm_start``) loads what the directory says the replica should hold first. This
runs both on the same trace so the minute after a scale event can be compared with the
steady state before it.

- Join, cold: the replica takes traffic at the decision (model start-up is the same either
  way and left out), holding nothing.
- Join, warm: the replica first loads ``warm_start_plan`` over the new replica set (hot
  adapters whose next copy belongs on it by rendezvous order, at most ``slots - 1`` in slots;
  the rest of its share into its host tier, up to ``slots``, as the live worker asks), each
  a disk read of the modelled seconds, one after another; then it takes traffic. The
  directory's holder counts are what the plan reads, so a router that keeps no view
  (none of the baselines) warm-starts from the pools themselves.
- Leave: the newest routable replica stops taking traffic and drains what it was sent
  (Serve's graceful shutdown). Warm: its slot residents are prefetched into the host tier of
  the survivor ``rehome_targets`` names for each (a background read; the next load there is
  a host copy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Optional

from routing.directory import AdapterDirectory
from routing.plan import PlacementPlan, planned_on
from routing.warm_start import AdapterPlacement, WarmStartPlan, rehome_targets, standby_names, warm_start_plan

from .fleet import SimReplica, Simulator


@dataclass(frozen=True)
class Join:
    """One replica added: when it was decided, when it took traffic, what it held by then."""

    replica: int
    decided: float
    joined: float
    warm_slots: int
    warm_host: int


def _holders(sim: Simulator) -> dict[str, set[str]]:
    """Adapter -> routable replicas holding it in a slot: the directory's view (a departed replica's
    reports are left out, as the live directory forgets it), or the pools without one."""
    if sim.directory is not None:
        live = set(sim.ids)
        held = {uid: set(rids) & live for uid, rids in sim.directory.holders.items()}
        return {uid: rids for uid, rids in held.items() if rids}
    held: dict[str, set[str]] = {}
    for i in sim.routable:
        replica = sim.replicas[i]
        for uid in replica.pool.uid_to_slot:
            held.setdefault(uid, set()).add(replica.rid)
    return held


def add_replica(sim: Simulator, warm: bool, joins: list[Join]) -> SimReplica:
    """A new replica; routable now (cold) or once its warm start's reads are done (warm)."""
    replica = sim.new_replica()
    slots, host = (), ()
    seconds = 0.0
    if warm:
        held = Counter({uid: len(rids) for uid, rids in _holders(sim).items()})
        placements = [AdapterPlacement(uid, 0, n) for uid, n in sorted(held.items())]
        planned = (sim.directory.planned_for(replica.rid, sim.config.slots, sim.config.max_batch)
                   if sim.directory is not None else None)  # the placement plan, where the router has one
        plan = warm_start_plan(replica.rid, sim.ids, placements, sim.config.slots, sim.config.slots, planned)
        slots, host = plan.slots, plan.host
        costs = sim.config.costs
        if slots:
            replica.pool.prepare_lora_batch(set(slots))
            replica.pool.release_batch()
        for uid in (*slots, *host):
            rank = sim.ranks[uid]
            replica.fetch_to_host(uid)
            seconds += costs.load_seconds(rank, from_host=False)
    joins.append(Join(replica.idx, sim.now, sim.now + seconds, len(slots), len(host)))
    joined = sim.now + seconds
    if seconds > 0:
        sim.at(joined, lambda: sim.set_routable([*sim.routable, replica.idx]))
    else:
        sim.set_routable([*sim.routable, replica.idx])
    if warm and sim.config.host_standby_share > 0 and sim.router.follows_plan and sim.feed is not None:
        _stage_standby_after_join(sim, replica, joined)
    return replica


def _stage_standby_after_join(sim: Simulator, replica: SimReplica, joined: float) -> None:
    """As the live worker once up (``PlanFollower.stage_standby``, its next pass after the replica set changed,
    ~1 s): the joiner's standby copies, read one after another in the background from then on."""
    costs, share = sim.config.costs, sim.config.host_standby_share
    rids = sorted({sim.replicas[i].rid for i in sim.routable} | {replica.rid})
    t = joined + 1.0
    for uid in standby_names(replica.rid, rids, sim.feed.registered):
        t += costs.disk_read_s(sim.ranks[uid])

        def stage(uid: str = uid) -> None:
            if not replica.pool.is_resident(uid) and uid not in replica.host \
                    and replica.host.stats.bytes_used < share * replica.host.budget_bytes:
                replica.warm(uid, into_slot=False)
        sim.at(t, stage)


def warm_start_at_deploy(sim: Simulator, order: Optional[Sequence[int]] = None) -> list[WarmStartPlan]:
    """A fresh deployment as the live one comes up: the replicas start one at a time (Serve starts
    replica processes a few at a time; 16 took 200 s on two cores in ``fleet_live``), and each, as
    ``LoRAWorker.__init__`` runs:

    1. reports its empty pool (its report loop starts before its warm-up), so the directory knows it;
    2. warm-starts (``LoRAWorker._warm_up`` via ``AdapterDirectoryActor.warm_start_plan``): with a plan
       in place, what the directory's trial plan would give it (``planned_for``), else the rendezvous
       rule over the adapters held so far (nothing, for the first replica: no plan has been made yet);
       ``warm_start_plan`` puts the first ``slots - 1`` in slots, the next ``slots`` in its host tier;
    3. reports that pool; the directory's next plan tick (``update_plan``, once a second, seconds
       between two joins) places adapters on it, moving placements off the earlier replicas;
    4. the replicas already warm follow that plan change (``PlanFollower.changed``: read ahead what
       it newly gives them, into a free slot first, evict the plan's adapters last); the one joining
       only notes its placements if its warm-up is still running (its reads take seconds: no read-ahead
       until it ends), and follows the change like the others if it had nothing to read (the first
       replica: it is up within ~0.1 s, before the tick, and then reads ahead all the tick gives it).

    Traffic starts once the last replica is up (Serve's deploy returns then). No simulated time passes:
    no traffic, so no demand, and the plan's timers do not move it. Not known from the live run: the
    order the replicas came up in (taken here as their index order), and whether the first replica
    asked for its warm start before the directory's first plan tick (taken as before: ~20 ms after its
    first report, against a 1 s tick). Without a directory (a router with no view) nothing is loaded."""
    if sim.directory is None or sim.feed is None:
        return []
    cfg, d = sim.config, sim.directory
    for i in sim.routable:
        d.forget_replica(sim.replicas[i].rid)  # none has reported yet
    plans, up = [], []
    for i in (sim.routable if order is None else order):
        replica = sim.replicas[i]
        d.apply_snapshot(replica.pool.snapshot())
        planned = d.planned_for(replica.rid, cfg.slots) if d.plan.holders else None
        placements = [AdapterPlacement(uid, 0, len(d.holders.get(uid, ()))) for uid in sim.feed.registered]
        plan = warm_start_plan(replica.rid, list(d.replicas), placements, cfg.slots, cfg.slots, planned)
        for uid in plan.slots:
            replica.warm(uid, into_slot=True)
        for uid in plan.host:
            replica.warm(uid, into_slot=False)
        d.apply_snapshot(replica.pool.snapshot(), **replica.heartbeat())
        warming = bool(plan.slots or plan.host)
        if not warming:  # nothing to read: up before the next plan tick, which it follows like the others
            replica.follow_plan(planned_on(d.plan, replica.rid), _slotted(d, replica.rid), at_once=True)
            up.append(replica)
        d.update_plan(registered=sim.feed.registered)
        for other in up:
            other.follow_plan(planned_on(d.plan, other.rid), _slotted(d, other.rid), at_once=True)
            d.apply_snapshot(other.pool.snapshot(), **other.heartbeat())
        if warming:  # its reads take seconds: the tick's reply comes during its warm-up (noted, not read ahead)
            replica.planned = set(planned_on(d.plan, replica.rid))
            replica.pool.keep(_slotted(d, replica.rid))
            up.append(replica)
        plans.append(plan)
    sim.followed_plan(d.plan.version)
    if sim.config.host_standby_share > 0 and sim.router.follows_plan:
        rids = [sim.replicas[i].rid for i in sim.routable]
        for replica in up:
            stage_standby(replica, rids, sim.feed.registered, sim.config.host_standby_share)
    return plans


def deployed_as_recorded(sim: Simulator, pools: Mapping[str, Mapping[str, Sequence[str]]], plan: Mapping) -> None:
    """The fleet as a live deploy left it, before any traffic: each replica's slots and host tier (``pools``:
    replica id -> ``{"slots", "host"}`` adapter names) and the directory's placement plan (``PlacementPlan.to_dict``),
    as ``fleet_live`` records them when its warm-up segment begins. Instead of ``warm_start_at_deploy``'s model of
    the deploy, whose outcome depends on the order the replicas came up in, which only the live run knows.
    The replicas' ids must be the live run's. The reads and copies are timed as a warm start's (the live workers
    made them too, and report their times)."""
    by_id = {sim.replicas[i].rid: sim.replicas[i] for i in sim.routable}
    unknown = sorted(set(pools) - set(by_id))
    if unknown:
        raise ValueError(f"recorded pools name replicas the simulated fleet does not have: {unknown[:3]}")
    d = sim.directory
    recorded = PlacementPlan.from_dict(plan)
    if not recorded.slotted:  # a plan recorded without its slot budgets: what each replica held in its slots
        recorded = replace(recorded, slotted={rid: tuple(sorted(p["slots"])) for rid, p in pools.items()})
    d.planner.resume(recorded)
    for rid, replica in by_id.items():
        contents = pools.get(rid, {"slots": (), "host": ()})
        for uid in contents["host"]:
            replica.warm(uid, into_slot=False)
        for uid in contents["slots"]:
            replica.warm(uid, into_slot=True)
        replica.planned = set(planned_on(recorded, rid))
        replica.pool.keep(list(recorded.slotted.get(rid, ())))
        d.apply_snapshot(replica.pool.snapshot(), **replica.heartbeat())
    sim.followed_plan(recorded.version)


def stage_standby(replica: SimReplica, replica_ids: Sequence[str], registered: Sequence[str], share: float) -> int:
    """As ``PlanFollower.stage_standby`` once the fleet is up: the registered adapters whose rendezvous order
    starts at ``replica`` go into its host tier while it is under ``share`` of its budget (before traffic: the
    live workers read theirs during the deploy, seconds before the replay's first request)."""
    staged = 0
    for uid in standby_names(replica.rid, replica_ids, registered):
        if replica.pool.is_resident(uid) or uid in replica.host:
            continue
        if replica.host.stats.bytes_used >= share * replica.host.budget_bytes:
            break
        replica.warm(uid, into_slot=False)
        staged += 1
    return staged


def _slotted(directory: AdapterDirectory, replica_id: str) -> list[str]:
    """What the plan gives a slot on ``replica_id`` (the worker keeps those: ``PlanFollower.changed``)."""
    return list(directory.plan.slotted.get(replica_id, ()))


def remove_replica(sim: Simulator, warm: bool) -> SimReplica:
    """The newest routable replica stops taking traffic; warm: survivors prefetch what it held."""
    if len(sim.routable) < 2:
        raise ValueError("cannot remove the last routable replica")
    gone = sim.replicas[sim.routable[-1]]
    sim.set_routable(sim.routable[:-1])
    if warm:
        by_rid = {sim.replicas[i].rid: sim.replicas[i] for i in sim.routable}
        held = _holders(sim)
        for rid, uids in rehome_targets(list(gone.pool.uid_to_slot), list(by_rid), held).items():
            for uid in uids:
                by_rid[rid].fetch_to_host(uid)
    return gone


@dataclass(frozen=True)
class ScaleEvent:
    """At ``t`` seconds, ``delta`` replicas join (> 0) or leave (< 0)."""

    t: float
    delta: int


def schedule(sim: Simulator, events: list[ScaleEvent], warm: bool) -> list[Join]:
    """Put ``events`` on the simulator's clock; the returned list fills with joins as they happen."""
    joins: list[Join] = []

    def action(delta: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(abs(delta)):
                if delta > 0:
                    add_replica(sim, warm, joins)
                else:
                    remove_replica(sim, warm)
        return run

    for event in events:
        if event.delta == 0 or event.t < 0:
            raise ValueError(f"a scale event needs t >= 0 and a non-zero delta, got {event}")
        sim.at(event.t, action(event.delta))
    return joins

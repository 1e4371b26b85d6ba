"""AdapterDirectory: ordered, idempotent event application; resync on gaps; deltas; expiry."""

from pool.events import PoolEvent
from routing.directory import AdapterDirectory

from pool_helpers import make_pool


def ev(kind, uid, slot, seq, replica="r0"):
    return PoolEvent(kind, uid, slot, replica, seq, 0.0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_events_apply_in_order_and_duplicates_are_ignored():
    d = AdapterDirectory()
    assert d.apply_events("r0", [ev("load", "a", 0, 1), ev("load", "b", 1, 2), ev("pin", "a", 0, 3)])
    assert d.apply_events("r0", [ev("load", "b", 1, 2), ev("evict", "b", 1, 4)])  # seq 2 again: ignored
    state = d.replicas["r0"]
    assert state.resident == {"a": 0} and state.pinned == {"a"} and state.seq == 4
    assert d.replicas_holding("a") == {"r0"} and d.replicas_holding("b") == set()
    assert d.adapter_counts["b"] == {"load": 1, "evict": 1}


def test_out_of_order_batches_are_sorted_by_seq():
    d = AdapterDirectory()
    assert d.apply_events("r0", [ev("evict", "a", 0, 2), ev("load", "a", 0, 1)])
    assert d.replicas["r0"].resident == {}


def test_a_gap_asks_for_a_snapshot_and_the_snapshot_repairs_the_view():
    pool, _ = make_pool(slots=3)
    events = []
    pool.subscribe(events.append)
    pool.prepare_lora_batch({"A", "B"})
    pool.prepare_lora_batch({"C"})
    d = AdapterDirectory()
    assert not d.apply_events("r0", [events[0], events[2]])  # event 2 lost
    assert d.needs_resync("r0")
    assert not d.apply_events("r0", [events[1]])  # still waiting for the snapshot
    d.apply_snapshot(pool.snapshot())
    assert not d.needs_resync("r0")
    assert d.replicas["r0"].resident == pool.snapshot().resident
    assert d.replicas["r0"].seq == pool.snapshot().seq


def test_view_built_from_a_real_pool_equals_the_pool_after_random_work():
    pool, _ = make_pool(slots=3)
    events = []
    pool.subscribe(events.append)
    for batch in [{"A"}, {"B", None}, {"C", "D"}, {"E"}, {"A", "F"}]:
        pool.prepare_lora_batch(batch)
    pool.release_batch()
    pool.pin("A")
    pool.remove("F")
    d = AdapterDirectory()
    assert d.apply_events("r0", events)
    snap = pool.snapshot()
    assert d.replicas["r0"].resident == snap.resident and d.replicas["r0"].pinned == set(snap.pinned)


def test_an_older_snapshot_does_not_roll_back_newer_events():
    d = AdapterDirectory()
    d.apply_events("r0", [ev("load", "a", 0, 1), ev("load", "b", 1, 2)])
    d.apply_snapshot({"replica_id": "r0", "seq": 1, "slots": 2, "resident": {"a": 0}, "pinned": []})
    assert d.replicas["r0"].resident == {"a": 0, "b": 1}


def test_deltas_are_replica_granular_and_versioned():
    d = AdapterDirectory()
    d.apply_events("r0", [ev("load", "a", 0, 1)])
    v1 = d.version
    d.apply_events("r1", [ev("load", "b", 0, 1, "r1")])
    d.heartbeat("r0", queue_len=3)  # stored, but a queue length alone wakes no router
    version, changes = d.changes_since(v1)
    assert version == d.version and set(changes) == {"r1"}
    assert changes["r1"]["resident"] == {"b": 0} and d.full_view()["r0"]["queue_len"] == 3
    d.heartbeat("r0", queue_len=3, host_cached=["h@1"])
    version, changes = d.changes_since(version)
    assert set(changes) == {"r0"} and changes["r0"]["queue_len"] == 3
    assert d.changes_since(version) == (version, {})
    assert d.changes_since(version + 10)[1] is None  # from before a restart: take a full view
    d.forget_replica("r1")
    _, changes = d.changes_since(version)
    assert changes == {"r1": {"replica_id": "r1", "removed": True}}


def test_a_log_that_no_longer_reaches_back_asks_for_a_full_view():
    d = AdapterDirectory(max_log=2)
    for seq in range(1, 6):
        d.apply_events("r0", [ev("load", f"u{seq}", 0, seq)])
    assert d.changes_since(0)[1] is None
    assert d.full_view()["r0"]["seq"] == 5


def test_silent_replicas_are_forgotten():
    clock = Clock()
    d = AdapterDirectory(replica_timeout_s=10, clock=clock)
    d.apply_events("r0", [ev("load", "a", 0, 1)])
    d.apply_events("r1", [ev("load", "a", 0, 1, "r1")])
    clock.now = 8
    d.heartbeat("r1")
    clock.now = 12
    assert d.expire() == ["r0"]
    assert set(d.replicas) == {"r1"} and d.replicas_holding("a") == {"r1"}


def test_a_replica_first_heard_of_mid_stream_is_asked_for_a_snapshot():
    """After a directory restart, a worker's next report may be a bare heartbeat or later events."""
    d = AdapterDirectory()
    assert not d.heartbeat("r0", queue_len=1)
    assert d.needs_resync("r0")
    assert not d.apply_events("r1", [ev("load", "a", 0, 7, "r1")])
    assert d.needs_resync("r1") and d.replicas["r1"].resident == {}
    d.apply_snapshot({"replica_id": "r1", "seq": 7, "slots": 3, "resident": {"a": 0}, "pinned": []})
    assert not d.needs_resync("r1") and d.replicas["r1"].free_slots == 2
    assert d.apply_events("r2", [ev("load", "b", 0, 1, "r2")])  # a replica's very first event: no snapshot needed


def test_load_timings_reach_the_view_and_only_real_changes_bump_the_version():
    d = AdapterDirectory()
    d.heartbeat("r0", queue_len=1, load_s={"host": 0.0048, "disk": 0.088})
    assert d.full_view()["r0"]["load_s"] == {"host": 0.0048, "disk": 0.088}
    version = d.version
    d.heartbeat("r0", queue_len=1, load_s={"host": 0.0048, "disk": 0.088})
    assert d.version == version  # nothing moved: routers are not woken
    d.heartbeat("r0", queue_len=1, load_s={"host": 0.0051, "disk": 0.088})
    assert d.version == version + 1


def test_load_timings_are_ewmas_of_pool_counters_and_timed_reads_rounded_to_two_digits():
    from routing.load_timings import LoadTimings

    t = LoadTimings(alpha=0.5)
    assert t.report() == {"host": None, "disk": None, "prefill": None}
    t.observe_pool(0, 0.0)
    t.observe_pool(2, 0.01)            # two loads, 5 ms each
    t.observe_pool(2, 0.01)            # no new loads: unchanged
    t.observe_pool(3, 0.02)            # one load of 10 ms: 5 + 0.5 * (10 - 5)
    t.observe_disk(0.1)
    t.observe_disk(0.2)
    assert t.report() == {"host": 0.0075, "disk": 0.15, "prefill": None}
    with t.disk_read():
        pass
    assert t.disk_s < 0.15


def test_plan_moves_are_counted_per_adapter_and_forgotten_with_the_adapter():
    """A demand that outlasts the plan's hysteresis gives the hot adapter a second holder: one move."""
    clock = Clock()
    d = AdapterDirectory(clock=clock)
    for r in ("r0", "r1"):
        d.apply_snapshot({"replica_id": r, "seq": 0, "slots": 4, "resident": {}, "pinned": []}, rows=4)
    first = d.update_plan(registered=["a", "b"])
    assert first.holders["a"] and d.plan_moves_total == 0  # first placements are not moves
    for t in range(1, 40):
        clock.now = float(t)
        d.heartbeat("r0", busy_s={"a": 7.0})  # 'a' keeps almost two replicas' rows busy
        plan = d.update_plan(registered=["a", "b"])
    assert len(plan.holders["a"]) == 2
    assert d.plan_moves == {"a": 1} and d.plan_moves_total == 1


def test_per_uid_counts_stay_at_their_bound_through_10000_registrations_and_removals():
    from routing.directory import MAX_COUNTED_UIDS

    d = AdapterDirectory()
    seq = 0
    for i in range(10_000):     # registered, loaded, evicted (counted), unloaded when removed: dropped
        uid = f"a{i}@0000{i % 10}"
        events = [ev("load", uid, 0, seq + 1, "r1"), ev("evict", uid, 0, seq + 2, "r1"),
                  ev("unload", uid, -1, seq + 3, "r1")]
        d.apply_events("r1", events)
        seq += 3
    assert len(d.adapter_counts) == 0 and len(d.holders) == 0
    for i in range(10_000):     # loaded and evicted, never removed: the oldest are dropped past the budget
        d.apply_events("r1", [ev("load", f"k{i}", 0, seq + 1, "r1"), ev("evict", f"k{i}", 0, seq + 2, "r1")])
        seq += 2
    assert len(d.adapter_counts) == MAX_COUNTED_UIDS and "k9999" in d.adapter_counts and "k0" not in d.adapter_counts

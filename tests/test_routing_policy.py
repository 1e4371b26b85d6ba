"""The routing decision: within the plan by expected completion time, spills, bounded waits, base, agreement."""

import numpy as np
import pytest

from routing.hashing import rendezvous_order, rendezvous_scores, stable_hash
from routing.policy import FleetView, choose_replicas
from routing.settings import DEFAULT_SETTINGS, RoutingSettings

IDS = tuple(f"replica-{i}" for i in range(8))
CAPS = [8.0] * 8


def view(holders=None, warm=None, free=None, slots=4, residents=None, pinned=None, host_s=None, disk_s=None,
         ids=IDS):
    n = len(ids)
    return FleetView(ids, holders=holders or {}, warm=warm or {},
                     free_slots=np.array(free if free is not None else [1] * n), slots=[slots] * n,
                     residents=residents, pinned=pinned,
                     host_load_s=[host_s] * n if host_s is not None else None,
                     disk_load_s=[disk_s] * n if disk_s is not None else None)


def order_of(adapter, ids=IDS):
    return [ids.index(r) for r in rendezvous_order(adapter, list(ids))]


def planned_view(planned, holders=None, **kw):
    ids = kw.get("ids", IDS)
    v = view(holders, **kw)
    v.planned = {a: tuple(sorted(r)) for a, r in planned.items()}
    v.planned_on = [tuple(a for a, r in planned.items() if i in r) for i in range(len(ids))]
    return v


def test_a_holder_with_room_wins():
    decision = choose_replicas("a", view({"a": {2, 5}}), np.zeros(8), caps=CAPS)
    assert decision.kind == "affinity" and decision.tiers[0][0] in {2, 5}


def test_the_less_loaded_holder_wins():
    loads = np.zeros(8)
    loads[2] = 6  # 6 * 1% of a request's time: more than the tie (a quarter of T / cap)
    decision = choose_replicas("a", view({"a": {2, 5}}), loads, caps=CAPS)
    assert decision.tiers == [[5]]
    loads[2] = 1  # within the tie: the adapter's rendezvous order decides, whichever holder is less loaded
    first = [i for i in order_of("a") if i in (2, 5)][0]
    assert choose_replicas("a", view({"a": {2, 5}}), loads, caps=CAPS).tiers == [[first]]


def test_a_cold_adapter_goes_to_its_rendezvous_replica():
    decision = choose_replicas("cold", view(), np.zeros(8), caps=CAPS)
    assert decision.kind == "placement" and decision.tiers == [[order_of("cold")[0]]]
    busy = np.zeros(8)
    busy[order_of("cold")[0]] = 5  # not in the plan yet: a queue there does not spread it
    assert choose_replicas("cold", view(), busy, caps=CAPS).tiers == [[order_of("cold")[0]]]


def test_a_copy_outside_the_plan_serves_when_no_planned_replica_holds_the_adapter():
    """The plan says where a load goes; a replica that holds the adapter needs none. Sent to the planned
    replica, the request would load a second copy there for one stream of traffic."""
    decision = choose_replicas("a", planned_view({"a": {3}}, {"a": {6}}), np.zeros(8), caps=CAPS)
    assert decision.kind == "affinity" and decision.tiers == [[6]]


def test_a_copy_in_a_slot_the_plan_gives_another_adapter_does_not_serve():
    """Replica 6's four slots are all planned for other adapters: its copy of ``a`` keeps one of them out, so the
    request goes to the plan (a load there) and the copy ages out, instead of keeping it alive."""
    planned = {"a": {3}, **{f"p{k}": {6} for k in range(4)}}
    full = planned_view(planned, {"a": {6}})
    assert choose_replicas("a", full, np.zeros(8), caps=CAPS).tiers == [[3]]
    planned.pop("p3")  # a slot of 6 the plan gives no one: the copy there serves
    spare = planned_view(planned, {"a": {6}})
    assert choose_replicas("a", spare, np.zeros(8), caps=CAPS).tiers == [[6]]


def test_the_plan_wins_over_a_copy_outside_it_once_a_planned_replica_holds_the_adapter():
    """With a planned holder resident, the copy outside the plan gets no traffic, so its slot's LRU frees it:
    copies outside the plan are what a spill leaves behind."""
    decision = choose_replicas("a", planned_view({"a": {3}}, {"a": {3, 6}}), np.zeros(8), caps=CAPS)
    assert decision.kind == "affinity" and decision.tiers == [[3]]
    loads = np.zeros(8)
    loads[3] = 4  # the planned holder busier than the copy: still within the plan (it has rows)
    assert choose_replicas("a", planned_view({"a": {3}}, {"a": {3, 6}}), loads, caps=CAPS).tiers == [[3]]


def test_a_full_planned_replica_does_not_spill_for_a_blip():
    """One request more than the holder's rows is a one-row wait, less than the spill margin: it waits."""
    order = order_of("hot")
    loads = np.zeros(8)
    loads[order[0]] = 8
    decision = choose_replicas("hot", view({"hot": {order[0]}}, host_s=0.001, disk_s=0.002), loads, caps=CAPS,
                               request_s=[0.2] * 8)
    assert decision.wait and decision.tiers == [] and decision.best == order[0]


def test_a_sustained_queue_at_the_planned_replica_spills_to_an_idle_one():
    order = order_of("hot")
    loads = np.zeros(8)
    loads[order[0]] = 8
    v = planned_view({"hot": {order[0]}}, {"hot": {order[0]}}, host_s=0.001, disk_s=0.002)
    decision = choose_replicas("hot", v, loads, caps=CAPS, request_s=[0.2] * 8, waiting={"hot": 12})
    assert decision.kind == "spill" and not decision.wait  # 13 rows' wait (0.33 s) > a load + one request time
    expensive = planned_view({"hot": {order[0]}}, {"hot": {order[0]}}, host_s=0.5, disk_s=1.0)
    assert choose_replicas("hot", expensive, loads, caps=CAPS, request_s=[0.2] * 8, waiting={"hot": 12}).wait


def test_no_spill_takes_a_row_owed_to_the_targets_own_adapters():
    """At saturation every replica's free row belongs to requests planned there: nothing spills."""
    ids = IDS[:2]
    v = planned_view({"a": {0}, "b": {1}}, {"a": {0}, "b": {1}}, ids=ids, host_s=0.001, disk_s=0.002)
    owed = choose_replicas("a", v, [8, 6], caps=[8, 8], request_s=[0.2, 0.2], waiting={"a": 20, "b": 1})
    assert owed.wait
    one_row = choose_replicas("a", v, [8, 7], caps=[8, 8], request_s=[0.2, 0.2], waiting={"a": 20})
    assert one_row.wait  # a single free row is a blip (a completion), not idle capacity
    idle = choose_replicas("a", v, [8, 6], caps=[8, 8], request_s=[0.2, 0.2], waiting={"a": 20})
    assert idle.kind == "spill" and idle.tiers == [[1]]


def test_a_free_row_behind_a_long_prefill_queue_loses_to_an_idle_replica_elsewhere():
    """The planned replica has a row, but 2 s of prompts queued ahead of it (a 0.2 s request, 8 rows: the margin
    is ``spill_margin`` x 0.025 s): an idle replica outside the plan, where a load costs 2 ms, takes it. A queue within
    the margin, or a load dearer than the wait saved, keeps it on the plan; so does a replica the plan keeps busy."""
    ids = IDS[:3]
    v = planned_view({"a": {0}}, {"a": {0}}, ids=ids, host_s=0.002, disk_s=0.002)
    kw = dict(caps=[8, 8, 8], request_s=[0.2] * 3)
    moved = choose_replicas("a", v, [1, 2, 0], **kw, prefill_wait=[2.0, 0.5, 0.0])
    assert moved.kind == "prefill_spill" and moved.tiers == [[2]]
    margin_s = DEFAULT_SETTINGS.spill_margin * 0.2 / 8
    assert choose_replicas("a", v, [1, 2, 0], **kw, prefill_wait=[0.9 * margin_s, 0.0, 0.0]).tiers == [[0]]
    assert choose_replicas("a", v, [1, 2, 0], **kw, prefill_wait=[1.1 * margin_s + 0.002, 0.0, 0.0]).tiers == [[2]]
    dear = planned_view({"a": {0}}, {"a": {0}}, ids=ids, host_s=3.0, disk_s=3.0)
    assert choose_replicas("a", dear, [1, 2, 0], **kw, prefill_wait=[2.0, 0.5, 0.0]).tiers == [[0]]
    v.busy = frozenset({2})
    assert choose_replicas("a", v, [1, 2, 0], **kw, prefill_wait=[2.0, 0.5, 0.0]).tiers == [[1]]
    assert choose_replicas("a", v, [1, 2, 0], **kw).tiers == [[0]]  # not priced: the plan's row


def test_no_spill_evicts_an_adapter_the_plan_gives_a_slot_where_it_would_land():
    """The demo's shape: every slot of the idle replica holds an adapter the plan keeps there. An overdue request
    (any free row would do) still waits rather than evict one of them (it would reload there and evict in turn);
    once a resident there is not kept (the spare slot's churn) or a slot is free, it spills."""
    ids = IDS[:2]
    kw = dict(caps=[8, 8], request_s=[0.2, 0.2], waited_s=5.0)
    full = planned_view({"a": {0}, "x": {1}, "y": {1}}, {"a": {0}, "x": {1}, "y": {1}}, ids=ids, free=[0, 0],
                        residents=[("a",), ("x", "y")], host_s=0.001, disk_s=0.002)
    full.slotted_on = [frozenset({"a"}), frozenset({"x", "y"})]
    assert choose_replicas("a", full, [8, 0], **kw).wait
    full.slotted_on = [frozenset({"a"}), frozenset({"x"})]  # y is resident on demand there: its slot churns
    assert choose_replicas("a", full, [8, 0], **kw).tiers == [[1]]
    full.slotted_on = [frozenset({"a"}), frozenset({"x", "y"})]
    full.free, full.free_slots = [0, 1], np.array([0, 1])
    assert choose_replicas("a", full, [8, 0], **kw).tiers == [[1]]


def test_a_request_waits_in_the_router_at_most_its_bound():
    """Past ``max_router_wait`` rows' waits (4 x 0.2 s / 8 = 0.1 s) any idle row takes it."""
    ids = IDS[:2]
    v = planned_view({"a": {0}}, {"a": {0}}, ids=ids)
    cfg = RoutingSettings(max_router_wait=4.0)
    assert choose_replicas("a", v, [8, 0], cfg, caps=[8, 8], request_s=[0.2, 0.2], waited_s=0.05).wait
    late = choose_replicas("a", v, [8, 0], cfg, caps=[8, 8], request_s=[0.2, 0.2], waited_s=0.12)
    assert late.tiers == [[1]] and late.kind == "spill"
    assert choose_replicas("a", v, [8, 8], cfg, caps=[8, 8], request_s=[0.2, 0.2], waited_s=5.0).wait  # no row


def test_work_conserving_within_the_planned_set():
    loads = np.zeros(8)
    loads[1] = 8
    decision = choose_replicas("a", planned_view({"a": {1, 4}}, {"a": {1}}), loads, caps=CAPS)
    assert decision.tiers == [[4]] and decision.kind == "placement"


def test_a_free_row_costs_no_wait_and_a_full_replica_one_rows_worth():
    v = view({"a": {0}}, ids=IDS[:2])
    cfg = RoutingSettings(batch_slowdown=0.0)
    assert choose_replicas("a", v, [7, 0], cfg, caps=[8, 8], request_s=[0.4, 0.4]).ect[0] == 0.0
    assert choose_replicas("a", v, [8, 0], cfg, caps=[8, 8], request_s=[0.4, 0.4]).ect[0] == pytest.approx(0.05)


def test_a_free_slot_beats_an_eviction_and_a_host_copy_beats_a_disk_read():
    order = order_of("x")
    free = [0] * 8
    free[order[2]] = 1
    both = {"x": {order[0], order[2]}}
    decision = choose_replicas("x", planned_view(both, free=free), np.zeros(8), caps=CAPS)
    assert decision.tiers == [[order[2]]]
    warm = choose_replicas("x", planned_view({"x": {order[0], order[3]}}, warm={"x": {order[3]}}, free=[0] * 8,
                                             host_s=0.001, disk_s=0.5), np.zeros(8), caps=CAPS)
    assert warm.tiers == [[order[3]]]


def test_an_adapter_that_cannot_join_the_running_batch_goes_where_it_can():
    ids = IDS[:2]
    slots_busy = [{"b": 2, "c": 1}, {}]  # replica 0 runs two other adapters in its 2 slots
    v = planned_view({"a": {0, 1}}, {"a": {0}}, slots=2, free=[0, 1], residents=[("b", "c"), ()], ids=ids)
    decision = choose_replicas("a", v, [3, 3], caps=[8, 8], active=slots_busy, request_s=[0.4, 0.4])
    assert decision.tiers == [[1]]
    joinable = [{"a": 1, "c": 1}, {}]
    assert choose_replicas("a", v, [3, 3], caps=[8, 8], active=joinable, request_s=[0.4, 0.4]).tiers == [[0]]


def test_a_pinned_adapter_always_joins_its_own_slot():
    ids = IDS[:2]
    v = planned_view({"p": {0}}, {"p": {0}}, slots=3, free=[0, 0], residents=[("p", "b", "c"), ()],
                     pinned=[frozenset({"p"}), frozenset()], ids=ids)
    decision = choose_replicas("p", v, [2, 0], caps=[8, 8], active=[{"b": 1, "c": 1}, {}], request_s=[0.4, 0.4])
    assert decision.tiers == [[0]] and decision.kind == "affinity"


def test_a_request_that_could_not_join_any_batch_waits_instead_of_holding_a_row():
    """Both planned replicas' slots serve other adapters: sent anywhere, the request would hold a row its
    batch cannot use; it waits in the router, and goes as soon as a slot frees."""
    ids = IDS[:2]
    busy = [{"b": 2, "c": 1}, {"d": 1, "e": 1}]
    v = planned_view({"a": {0, 1}}, {"a": {0}}, slots=2, free=[0, 0], residents=[("b", "c"), ("d", "e")], ids=ids)
    decision = choose_replicas("a", v, [3, 2], caps=[8, 8], active=busy, request_s=[0.4, 0.4])
    assert decision.wait and decision.tiers == []
    patient = choose_replicas("a", v, [3, 2], caps=[8, 8], active=busy, request_s=[0.4, 0.4], waited_s=0.7)
    assert patient.wait
    starving = choose_replicas("a", v, [3, 2], caps=[8, 8], active=busy, request_s=[0.4, 0.4], waited_s=0.9)
    assert starving.tiers == [[0]]  # past 2 request times: the holder's engine queues it for a slot
    oldest = choose_replicas("a", v, [3, 2], caps=[8, 8], active=busy, request_s=[0.4, 0.4], waited_s=0.1,
                             first_in_line=True)
    assert oldest.tiers == [[0]]  # the oldest waiting request is never passed over by younger ones that fit
    freed = [{"b": 2, "c": 1}, {"d": 1}]  # replica 1's "e" finished: a slot the request can take
    assert choose_replicas("a", v, [3, 1], caps=[8, 8], active=freed, request_s=[0.4, 0.4]).tiers == [[1]]


def test_evicting_an_adapter_in_demand_costs_its_reload():
    ids = IDS[:2]
    v = planned_view({"new": {0, 1}}, free=[0, 0], residents=[("busy",), ("idle",)], host_s=0.01, disk_s=0.01,
                     ids=ids)
    cfg = RoutingSettings(tie_epsilon=0.0)
    decision = choose_replicas("new", v, [0, 0], cfg, caps=[8, 8], demand={"busy": 5.0, "idle": 0.0})
    assert decision.tiers == [[1]] and decision.ect[0] > decision.ect[1]
    flipped = choose_replicas("new", v, [0, 0], cfg, caps=[8, 8], demand={"busy": 0.0, "idle": 5.0})
    assert flipped.tiers == [[0]]


def test_pinned_adapters_are_never_victims():
    """Replica 0's idle adapter is pinned, so its victim is the one in demand: both replicas cost a reload."""
    ids = IDS[:2]
    v = planned_view({"new": {0, 1}}, free=[0, 0], slots=2, residents=[("p", "r"), ("q", "s")],
                     pinned=[frozenset({"p"}), frozenset()], host_s=0.01, disk_s=0.01, ids=ids)
    decision = choose_replicas("new", v, [0, 0], RoutingSettings(tie_epsilon=0.0), caps=[8, 8], active=[{}, {}],
                               demand={"p": 0.0, "r": 5.0, "q": 5.0, "s": 5.0})
    assert decision.ect[0] == pytest.approx(decision.ect[1]) == pytest.approx(0.02)


def test_base_model_requests_go_least_loaded():
    loads = np.array([3, 1, 2, 0, 5, 4, 6, 7], dtype=float)
    decision = choose_replicas(None, view(), loads, caps=CAPS)
    assert decision.kind == "base" and decision.tiers == [[3]]


def test_all_full_means_wait():
    decision = choose_replicas("a", view({"a": {1}}), np.full(8, 8.0), caps=CAPS)
    assert decision.wait and decision.kind == "wait" and decision.tiers == []


def test_expected_completion_time_grows_with_the_queue():
    v = view({"a": {0}})
    ects = [choose_replicas("a", v, np.array([q, 7, 7, 7, 7, 7, 7, 7.0]), caps=CAPS).ect[0] for q in range(8)]
    assert ects == sorted(ects) and ects[0] < ects[-1]


DECISIONS = """
import json
import numpy as np
from routing.policy import FleetView, choose_replicas
rng = np.random.default_rng(0)
ids = tuple(f"replica-{i}" for i in range(8))
out = []
for _ in range(300):
    loads = rng.integers(0, 9, 8).astype(float)
    holders = {f"a{i}": set(rng.choice(8, 2, replace=False).tolist()) for i in range(5)}
    warm = {f"a{i}": set(rng.choice(8, 1).tolist()) for i in range(3, 8)}
    planned = {f"a{i}": tuple(sorted(rng.choice(8, 2, replace=False).tolist())) for i in range(0, 10, 2)}
    view = FleetView(ids, holders=holders, warm=warm, free_slots=rng.integers(0, 2, 8), slots=[4] * 8,
                     host_load_s=[0.01] * 8, disk_load_s=[rng.choice([0.001, 1.0])] * 8, planned=planned,
                     planned_on=[tuple(a for a, r in planned.items() if i in r) for i in range(8)])
    waiting = {f"a{i}": int(rng.integers(0, 30)) for i in range(10)}
    d = choose_replicas(f"a{rng.integers(0, 10)}", view, loads, caps=[8] * 8,
                        request_s=rng.uniform(0.1, 0.5, 8).tolist(), waiting=waiting)
    out.append([d.kind, [[int(i) for i in tier] for tier in d.tiers]])
print(json.dumps(out))
"""


def test_routers_in_processes_with_different_hash_seeds_agree():
    """Each handle's router runs in its own process: from the same view they must all choose alike,
    so nothing in the decision may depend on Python's per-process string hashing or set order."""
    import json
    import os
    import subprocess
    import sys

    runs = []
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", DECISIONS], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout))
    assert runs[0] == runs[1]
    assert {kind for kind, _ in runs[0]} >= {"affinity", "placement", "spill", "wait"}  # every path was exercised


def test_slightly_different_estimates_still_agree_within_the_tie():
    """Two routers whose measured request times differ a little choose the same cold placement."""
    v = view()
    loads = np.array([1, 1, 1, 1, 2, 2, 2, 2], dtype=float)
    first = choose_replicas("cold", v, loads, caps=CAPS, request_s=[0.30] * 8)
    second = choose_replicas("cold", v, loads + np.array([0, 0, 0, 0, 0, 0, 0, 0.0]), caps=CAPS,
                             request_s=[0.33] * 8)
    assert first.tiers == second.tiers


def test_rendezvous_is_stable_when_replicas_join():
    before = rendezvous_order("adapter-7", [f"r{i}" for i in range(10)])
    after = rendezvous_order("adapter-7", [f"r{i}" for i in range(11)])
    assert [r for r in after if r != "r10"] == before  # only the newcomer can move ahead


def test_stable_hash_is_process_independent():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from routing.hashing import stable_hash; print(stable_hash('x'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert int(out) == stable_hash("x")


def test_empty_fleet():
    assert choose_replicas("a", FleetView(()), np.zeros(0)).tiers == []


@pytest.mark.parametrize("n", [1, 2, 64, 1024])
def test_the_choice_is_a_valid_index_and_a_decision_scores_only_the_planned_set(n):
    ids = tuple(f"r{i}" for i in range(n))
    loads = np.arange(n, dtype=float) % 8
    decision = choose_replicas("a", FleetView(ids, holders={"a": {n - 1}}), loads, caps=[8] * n)
    assert decision.tiers and all(0 <= i < n for t in decision.tiers for i in t)
    assert set(decision.ect) == {n - 1}  # the holder is the (fallback) plan, however large the fleet


def test_a_loads_cost_to_the_running_batch_is_its_copy_not_its_disk_read():
    """The requester waits for the whole load; the co-running batch waits only for the host-to-slot copy at a
    step boundary (the worker reads the file off the engine thread first). A cold replica with five running
    requests: the load costs the read plus five copies' stall, not six reads."""
    from routing.scoring import Scoring

    settings = RoutingSettings()
    loads = [5.0] * len(IDS)
    ctx = Scoring("a", view(host_s=0.01, disk_s=0.5, warm={"a": {1}}), loads, settings, CAPS, None, None, None,
                  None, settings.batch_slowdown, None)
    ctx.score(0)  # cold: a disk read, then the copy
    ctx.score(1)  # in its host tier: the copy alone
    assert ctx.load_cost[0] == pytest.approx(0.5 + 0.01 * 5)
    assert ctx.load_cost[1] == pytest.approx(0.01 + 0.01 * 5)


def test_a_version_not_in_the_plan_yet_goes_where_its_adapter_is_planned():
    """Between a version's registration and the next plan (up to ``plan_interval_s``) its requests go to its
    adapter's planned replica, where the rollout's pre-warm put it, not to a rendezvous guess."""
    old_first = int(np.argmax(rendezvous_scores(stable_hash("support@v2"), view().hashes)))
    target = next(i for i in reversed(order_of("support")) if i != old_first)   # neither rendezvous-first
    decision = choose_replicas("support@v2", planned_view({"support": {target}}), np.zeros(8), caps=CAPS)
    assert decision.tiers == [[target]]

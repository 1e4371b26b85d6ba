"""The routing decision: affinity, bounded-load rendezvous placement and spill, base, determinism."""

import numpy as np
import pytest

from routing.hashing import rendezvous_order, stable_hash
from routing.policy import FleetView, RoutingConfig, choose_replicas, load_bound

IDS = tuple(f"replica-{i}" for i in range(8))


def view(holders=None, warm=None, free=None):
    return FleetView(IDS, holders=holders or {}, warm=warm or {},
                     free_slots=np.array(free if free is not None else [0] * len(IDS)))


def test_holder_under_the_bound_wins():
    loads = np.zeros(8)
    decision = choose_replicas("a", view({"a": {2, 5}}), loads)
    assert decision.kind == "affinity" and set(decision.tiers[0]) == {2, 5}


def test_least_loaded_holder_first():
    loads = np.array([0, 0, 2, 0, 0, 1, 0, 0], dtype=float)
    decision = choose_replicas("a", view({"a": {2, 5}}), loads, RoutingConfig(load_bound_epsilon=10))
    assert decision.tiers[0] == [5, 2]


def test_cold_adapter_goes_to_its_rendezvous_replica():
    decision = choose_replicas("cold", view(), np.zeros(8), RoutingConfig(placement_lookahead=1))
    assert decision.kind == "placement"
    assert IDS[decision.tiers[0][0]] == rendezvous_order("cold", list(IDS))[0]


def test_overloaded_holders_spill_to_the_next_free_rendezvous_replica():
    order = [IDS.index(r) for r in rendezvous_order("hot", list(IDS))]
    loads = np.zeros(8)
    loads[order[0]] = 10  # the hot adapter's holder is far above the mean
    free = [1] * 8
    decision = choose_replicas("hot", view({"hot": {order[0]}}, free=free), loads)
    assert decision.kind == "spill"
    assert decision.tiers[0] == [order[1]]  # the next in its hash order: replicas of a hot adapter stay few
    assert decision.tiers[1] == [order[0]]  # the holder stays as a fallback tier


def test_without_a_free_slot_overloaded_holders_stay_first():
    """No eviction to relieve load: Serve moves on only when the holder is at max_ongoing_requests."""
    order = [IDS.index(r) for r in rendezvous_order("hot", list(IDS))]
    loads = np.zeros(8)
    loads[order[0]] = 10
    decision = choose_replicas("hot", view({"hot": {order[0]}}), loads)
    assert decision.kind == "affinity" and decision.tiers == [[order[0]]]  # nowhere to go without evicting
    waited = choose_replicas("hot", view({"hot": {order[0]}}), loads, waited_s=5.0)
    assert waited.tiers[1] == [order[1]]  # after spill_wait_s: its rendezvous replica, then the least loaded


def test_placement_prefers_a_free_slot_or_host_copy_within_the_lookahead():
    order = [IDS.index(r) for r in rendezvous_order("x", list(IDS))]
    free = [0] * 8
    free[order[1]] = 1
    decision = choose_replicas("x", view(free=free), np.zeros(8), RoutingConfig(placement_lookahead=2))
    assert decision.tiers[0] == [order[1]]
    warm = choose_replicas("x", view(warm={"x": {order[1]}}), np.zeros(8), RoutingConfig(placement_lookahead=2))
    assert warm.tiers[0] == [order[1]]
    beyond = choose_replicas("x", view(warm={"x": {order[3]}}), np.zeros(8), RoutingConfig(placement_lookahead=2))
    assert beyond.tiers[0] == [order[0]]


def test_base_model_requests_go_least_loaded():
    loads = np.array([3, 1, 2, 0, 5, 4, 6, 7], dtype=float)
    decision = choose_replicas(None, view(), loads)
    assert decision.kind == "base" and decision.tiers[0] == [3, 1]


DECISIONS = """
import json
import numpy as np
from routing.policy import FleetView, choose_replicas
rng = np.random.default_rng(0)
ids = tuple(f"replica-{i}" for i in range(8))
out = []
for _ in range(300):
    loads = rng.integers(0, 6, 8).astype(float)
    holders = {f"a{i}": set(rng.choice(8, 2, replace=False).tolist()) for i in range(5)}
    warm = {f"a{i}": set(rng.choice(8, 1).tolist()) for i in range(5, 8)}
    view = FleetView(ids, holders=holders, warm=warm, free_slots=rng.integers(0, 2, 8))
    d = choose_replicas(f"a{rng.integers(0, 10)}", view, loads, waited_s=float(rng.choice([0.0, 5.0])))
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
    assert {kind for kind, _ in runs[0]} >= {"affinity", "placement", "spill"}  # every path was exercised


def test_first_choice_always_respects_the_load_bound():
    rng = np.random.default_rng(1)
    for _ in range(300):
        loads = rng.integers(0, 10, 8).astype(float)
        decision = choose_replicas(f"a{rng.integers(0, 50)}", view({"a1": {0, 1}}), loads)
        bound = load_bound(loads, 0.25)
        if decision.kind == "affinity":
            assert set(decision.tiers[0]) <= {0, 1}  # holders, however loaded
        else:
            assert all(loads[i] + 1 <= bound for i in decision.tiers[0])


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
def test_every_tier_index_is_valid(n):
    ids = tuple(f"r{i}" for i in range(n))
    decision = choose_replicas("a", FleetView(ids, holders={"a": {0}}), np.arange(n, dtype=float))
    flat = [i for t in decision.tiers for i in t]
    assert flat and all(0 <= i < n for i in flat) and len(flat) == len(set(flat))


def test_min_load_bound_keeps_low_load_requests_on_their_holder():
    loads = np.zeros(8)
    loads[2] = 2  # above (1+eps)*mean at this low load, but far from a full batch
    holders = view({"a": {2}}, free=[1] * 8)
    assert choose_replicas("a", holders, loads).kind == "spill"
    floored = choose_replicas("a", holders, loads, RoutingConfig(min_load_bound=8))
    assert floored.kind == "affinity" and floored.tiers[0] == [2]


def test_full_holders_spill_only_to_free_slots_until_the_request_has_waited():
    order = [IDS.index(r) for r in rendezvous_order("a", list(IDS))]
    loads = np.zeros(8)
    free = [0] * 8
    free[order[3]] = 1
    fresh = choose_replicas("a", view({"a": {order[0]}}, free=free), loads)
    assert fresh.tiers[0] == [order[0]]
    assert [i for t in fresh.tiers[1:] for i in t] == [order[3]]  # no evicting fallback yet
    waited = choose_replicas("a", view({"a": {order[0]}}, free=free), loads, RoutingConfig(spill_wait_s=1.0), 1.5)
    assert waited.tiers[1] == [order[1]] and len([i for t in waited.tiers[1:] for i in t]) > 1

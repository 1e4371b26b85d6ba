"""The fleet lower bound: exact (equals the optimum by exhaustive search) and below every router."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_benchmarks_pool import brute_force_min_misses

from benchmarks.sim import ROUTERS, SimConfig, run_sim
from benchmarks.sim.fleet import Simulator
from benchmarks.policies import replay_online
from benchmarks.sim.fleet_bound import FleetBound, fleet_bound, global_lru_misses, warm_min
from benchmarks.traces import Popularity, make_trace


def optimum(seq: tuple[int, ...], slots: int, free_start: bool) -> int:
    """Fewest loads over every possible cache history; with ``free_start`` the cache may start
    holding any ``slots`` of the adapters: the best over every such start, each loaded first
    (exactly ``len(start)`` loads, no evictions) and taken off again."""
    if not free_start:
        return brute_force_min_misses(seq, slots)
    names = sorted(set(seq))
    starts = itertools.combinations(names, min(slots, len(names)))
    return min(brute_force_min_misses(start + seq, slots) - len(start) for start in starts)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_equals_the_exhaustive_optimum_on_every_short_sequence(slots: int) -> None:
    for n in range(1, 7):
        for seq in itertools.product(range(4), repeat=n):
            ids = np.array(seq)
            assert fleet_bound(ids, 1, slots).total == optimum(seq, slots, False), seq
            assert warm_min(ids, slots) == optimum(seq, slots, True), seq


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=14), st.integers(1, 2), st.integers(1, 2),
       st.integers(0, 14))
def test_fleet_slots_add_up_and_match_the_optimum(seq, replicas, slots, first) -> None:
    first = min(first, len(seq))
    bound = fleet_bound(np.array(seq), replicas, slots, first)
    k = replicas * slots
    assert bound.fleet_slots == k
    assert bound.total == optimum(tuple(seq), k, False)
    assert bound.measured == (optimum(tuple(seq[first:]), k, True) if seq[first:] else 0)
    assert bound.measured <= bound.total


@pytest.mark.parametrize("load,slots,alpha,seed,n", [(0.4, 8, 0.3, 0, 800), (0.9, 2, 0.3, 1, 300),
                                                     (0.7, 4, 1.0, 2, 400), (0.95, 1, 0.1, 3, 200)])
def test_no_router_loads_less_than_the_bound(load: float, slots: int, alpha: float, seed: int, n: int) -> None:
    replicas = 4
    trace = make_trace(n, 40, Popularity("power", alpha), rate=replicas * 16 * load / 6.5, cv=2.0, seed=seed)
    for router in sorted(ROUTERS):
        if ROUTERS[router].waits_for_capacity:
            continue  # it holds requests for their planned replica: served out of arrival order, Belady's
            # MIN over the arrival order is no bound for it (test_a_router_that_reorders_serves_everything)
        config = SimConfig(replicas=replicas, router=router, slots=slots, seed=seed)
        result = run_sim(trace, config)
        bound = fleet_bound(trace.adapters, replicas, slots, int(n * config.warmup_fraction))
        assert bound.total <= result.loads_total, router
        assert bound.measured <= result.loads, router


def test_a_router_that_reorders_serves_everything() -> None:
    """The affinity router holds a request until a planned replica has a row, so requests of one
    adapter run together and a saturated fleet can load less than the arrival-order bound; it must
    still serve every request."""
    replicas, n = 4, 300
    trace = make_trace(n, 40, Popularity("power", 0.3), rate=replicas * 16 * 0.9 / 6.5, cv=2.0, seed=1)
    config = SimConfig(replicas=replicas, router="affinity", slots=2, seed=1)
    sim = Simulator(trace, config)
    result = sim.run()
    assert sim.done == n and all(r.t_done > 0 for r in sim.requests) and result.loads_total > 0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="replicas >= 1"):
        fleet_bound(np.array([1, 2]), 0, 4)
    with pytest.raises(ValueError, match="first_measured"):
        fleet_bound(np.array([1, 2]), 1, 4, first_measured=3)
    assert fleet_bound(np.array([], dtype=np.int64), 2, 2) == FleetBound(4, 0, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=60), st.integers(1, 4), st.integers(0, 20))
def test_the_global_lru_reference_is_the_pools_lru_over_every_slot_and_never_below_the_bound(seq, slots, first) -> None:
    """``global_lru``: the pool's own LRU policy (``benchmarks.policies.replay_online``) on one cache of every slot,
    counted over the measured requests; no online policy loads less than MIN."""
    ids = np.array(seq, dtype=np.int64)
    first = min(first, len(seq))
    bound = fleet_bound(ids, 1, slots, first)
    assert global_lru_misses(ids, slots) == replay_online(seq, slots, "lru")
    assert bound.global_lru == replay_online(seq, slots, "lru") - replay_online(seq[:first], slots, "lru")
    assert bound.global_lru >= bound.measured

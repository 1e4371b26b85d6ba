"""The online floor (A0 under independent requests): exact on small traces, above Belady's bound, below LRU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.sim.fleet_bound import global_lru_misses, warm_min
from benchmarks.sim.online_floor import online_floor
from benchmarks.traces import Popularity, zipf_adapters, zipf_probabilities


def test_holds_the_most_probable_and_counts_every_other_request() -> None:
    probabilities = np.array([0.1, 0.5, 0.3, 0.1])  # most probable: 1, then 2; 0 and 3 tie (0 first, by id)
    adapters = np.array([3, 1, 0, 2, 3, 1, 0])
    floor = online_floor(adapters, probabilities, slots=2)  # keeps 1; the turn slot starts with 2
    assert floor.realized == 5  # 3, 0, 2, 3, 0
    q = 0.5
    assert floor.expected == pytest.approx(7 * (q - (0.1 ** 2 + 0.3 ** 2 + 0.1 ** 2) / q))
    three = online_floor(adapters, probabilities, slots=3)  # keeps 1 and 2; the turn slot starts with 0 (tie by id)
    assert three.realized == 4  # 3, 0, 3, 0: 0 and 3 take the turn slot in turn
    assert online_floor(adapters, probabilities, slots=2, first_measured=4).realized == 2  # 3 and 0 among the last 3
    assert online_floor(adapters, probabilities, slots=4).realized == 0


def test_expected_is_the_mean_of_realized_draws() -> None:
    p = zipf_probabilities(64, 1.0)
    rng = np.random.default_rng(7)
    draws = [online_floor(zipf_adapters(500, 64, 1.0, rng), p, 16).realized for _ in range(200)]
    expected = online_floor(np.zeros(500, dtype=int), p, 16).expected
    assert abs(np.mean(draws) - expected) < 3 * np.std(draws) / np.sqrt(len(draws))


def test_an_lru_cache_of_the_same_slots_loads_more() -> None:
    p = zipf_probabilities(256, 1.0)
    adapters = zipf_adapters(20_000, 256, 1.0, np.random.default_rng(3))
    floor = online_floor(adapters, p, 128, first_measured=2_000)
    assert global_lru_misses(adapters, 128, first_measured=2_000) > 1.2 * floor.realized


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=40), st.integers(1, 6), st.integers(0, 40), st.integers(0, 9))
def test_never_below_the_clairvoyant_bound(seq, slots, first, seed) -> None:
    first = min(first, len(seq))
    p = np.random.default_rng(seed).dirichlet(np.ones(8))
    floor = online_floor(np.array(seq), p, slots, first)
    assert warm_min(np.array(seq[first:]), slots) <= floor.realized  # A0 is one cache history MIN could choose


def test_a_power_law_popularity_works_too() -> None:
    p = Popularity("power", 0.3).probabilities(100)
    adapters = Popularity("power", 0.3).sample(3_000, 100, np.random.default_rng(0))
    floor = online_floor(adapters, p, 64, first_measured=300)
    assert 0 < floor.realized < 2_700 and floor.expected > 0


@pytest.mark.parametrize("kwargs,message", [
    ({"adapters": np.array([0, 5]), "probabilities": np.ones(4)}, "adapter ids"),
    ({"adapters": np.array([0]), "probabilities": np.array([])}, "probabilities"),
    ({"adapters": np.array([0]), "probabilities": np.array([-1.0, 2.0])}, "probabilities"),
    ({"adapters": np.array([0]), "probabilities": np.ones(2), "slots": 0}, "slots"),
    ({"adapters": np.array([0]), "probabilities": np.ones(2), "first_measured": 3}, "first_measured"),
])
def test_bad_input_is_refused_naming_it(kwargs, message) -> None:
    kwargs.setdefault("slots", 1)
    with pytest.raises(ValueError, match=message):
        online_floor(**kwargs)

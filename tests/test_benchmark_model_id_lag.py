"""The multiplexing baseline's measured model-id lag: sightings and their pairing with loads."""

from __future__ import annotations

from benchmarks.live.model_id_lag import ModelIdSightings, push_lags


def test_a_model_id_is_sighted_when_it_appears_and_again_after_it_left():
    seen = ModelIdSightings()
    seen.observe({"r1": ["a"], "r2": []}, now=1.0)
    seen.observe({"r1": ["a", "b"], "r2": []}, now=2.0)   # a already seen: only b is new
    seen.observe({"r1": ["b"], "r2": ["a"]}, now=3.0)     # a left r1, appeared on r2
    seen.observe({"r1": ["a", "b"], "r2": ["a"]}, now=4.0)  # a back on r1: a new sighting
    assert seen.take() == [("r1", "a", 1.0), ("r1", "b", 2.0), ("r2", "a", 3.0), ("r1", "a", 4.0)]
    assert seen.take() == []


def test_each_load_pairs_with_the_first_sighting_of_its_replica_and_model_after_it_began():
    sightings = [("r1", "a", 1.25), ("r2", "a", 1.5), ("r1", "a", 5.4)]
    loads = [("r1", "a", 1.0), ("r2", "a", 1.2), ("r1", "a", 5.0), ("r1", "b", 2.0), ("r1", "a", 6.0)]
    lags = push_lags(loads, sightings)
    # r1/a at 1.0 -> 1.25; r2/a at 1.2 -> 1.5; r1/a at 5.0 -> 5.4; r1/b never seen; r1/a at 6.0: nothing after
    assert [round(x, 3) for x in lags] == [0.25, 0.3, 0.4]

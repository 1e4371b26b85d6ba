"""``benchmarks.sim.worker_replay``: a live run's routing replayed onto the simulated workers.

The check is only worth something if replaying a run's own routing reproduces it: a run the simulator
made (its rows say where each request went and when it got there) must come back request for request,
and a run whose workers were slower than the model must show up as requests outside the tolerance.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import fleet_live
from benchmarks.sim.costs import CostModel
from benchmarks.sim.fleet_replay import replay_variant, segments_of
from benchmarks.sim.worker_replay import replay_cell


def tiny_settings() -> dict:
    """A fleet_live run's settings, as its JSON carries them, small enough to simulate in well under a second."""
    args = fleet_live.make_parser().parse_args(["--replicas", "3", "--slots", "2", "--rows", "4", "--adapters", "16",
                                                "--requests", "40", "--loads", "0.6", "--arrivals", "trace"])
    segments = fleet_live.make_segments(args)
    return json.loads(json.dumps(fleet_live._settings(args, segments, CostModel().scaled(args.time_scale))))


def _warmup(settings: dict, variant: str) -> dict:
    """The variant's cold warm-up segment as the simulator ran it, shaped as a live row (empty pools at its start)."""
    warm = replay_variant(settings, variant)[0]
    assert warm["segment"] == "warmup"
    return {**warm, "pools_at_start": {}, "plan_at_start": None}


@pytest.mark.parametrize("variant", ["hash", "pow2", "multiplexed"])
def test_replaying_a_runs_own_routing_gives_back_each_requests_ttft_and_loads(variant):
    settings = tiny_settings()
    row = _warmup(settings, variant)
    segment = {s.name: s for s in segments_of(settings)}["warmup"]
    cell = replay_cell(settings, row, segment)
    assert cell.sim_loads == row["loads"]
    np.testing.assert_allclose(cell.sim_ttft, row["ttft_s"], atol=2e-4)  # the rows round to 0.1 ms
    np.testing.assert_allclose(cell.sim_ready, row["ready_s"], atol=2e-4)
    assert cell.row()["requests_within"] == "100%"


def test_workers_slower_than_the_model_fall_outside_the_tolerance():
    settings = tiny_settings()
    row = _warmup(settings, "hash")
    segment = {s.name: s for s in segments_of(settings)}["warmup"]
    slow = {**row, "ttft_s": [t * 1.5 + 0.1 for t in row["ttft_s"]]}
    cell = replay_cell(settings, slow, segment)
    assert cell.row()["requests_within"] == "0%"
    assert cell.row()["p99_live"] > 1.4 * cell.row()["p99_replayed"]


def test_a_row_without_each_requests_hop_is_refused():
    settings = tiny_settings()
    row = _warmup(settings, "hash")
    segment = {s.name: s for s in segments_of(settings)}["warmup"]
    with pytest.raises(ValueError, match="arrive_s"):
        replay_cell(settings, {**row, "arrive_s": row["arrive_s"][:-1]}, segment)


def test_two_live_runs_are_compared_over_the_variants_both_ran():
    from benchmarks.sim.fleet_agreement import live_repeatability

    settings = tiny_settings()
    rows = [r for v in ("hash", "pow2") for r in replay_variant(settings, v) if r["measured"]]
    assert live_repeatability(rows, rows)["agrees"]
    other = [{**r, "loads": r["loads"] * 2 + 5} if r["variant"] == "pow2" else r for r in rows]
    assert not live_repeatability(rows, other)["agrees"]
    only_hash = [r for r in rows if r["variant"] == "hash"]
    assert live_repeatability(rows, only_hash)["cells"] == len(only_hash)

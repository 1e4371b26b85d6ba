"""The fleet benchmarks' workload: the vendored Azure trace, rescaled to an offered load of the cost model's capacity."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fleet_workload import azure_trace, capacity_req_s, fleet_workload
from benchmarks.sim.costs import CostModel

COSTS = CostModel()


def test_the_vendored_trace_reads_in_time_order_with_its_lengths():
    t, prompt, output = azure_trace()
    assert len(t) == 8819 and t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert prompt.min() >= 1 and output.min() >= 1 and 1500 < prompt.mean() < 2500


@pytest.mark.parametrize("arrivals", ["trace", "gamma"])
def test_the_mean_rate_is_the_offered_share_of_capacity(arrivals):
    trace = fleet_workload(2000, num_adapters=128, zipf_s=1.0, offered_load=0.8, arrivals=arrivals, costs=COSTS,
                           replicas=16, rows=8, seed=3)
    capacity = capacity_req_s(COSTS, trace.input_lens, trace.output_lens, 16, 8)
    observed = (len(trace) - 1) / (trace.arrivals[-1] - trace.arrivals[0])
    assert observed == pytest.approx(0.8 * capacity, rel=0.15)
    assert trace.meta["rate"] == pytest.approx(0.8 * capacity)
    assert set(np.unique(trace.ranks)) <= {8, 16, 32, 64} and trace.adapters.max() < 128


def test_gamma_arrivals_have_the_asked_burstiness_and_lengths_stay_the_traces():
    kw = dict(num_adapters=128, zipf_s=1.0, offered_load=0.4, costs=COSTS, replicas=16, rows=8, seed=1, offset=100)
    replayed = fleet_workload(3000, arrivals="trace", **kw)
    gamma = fleet_workload(3000, arrivals="gamma", **kw)
    gaps = np.diff(gamma.arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.15)
    assert np.array_equal(replayed.input_lens, gamma.input_lens)
    assert np.array_equal(replayed.adapters, gamma.adapters)  # the same requests, only the times differ


def test_lengths_are_capped_and_bad_arguments_refused():
    trace = fleet_workload(500, num_adapters=8, zipf_s=1.0, offered_load=0.5, arrivals="trace", costs=COSTS,
                           replicas=2, rows=4, max_prompt=1000, max_output=16)
    assert trace.input_lens.max() <= 1000 and trace.output_lens.max() <= 16 and trace.output_lens.min() >= 1
    with pytest.raises(ValueError, match="arrivals"):
        fleet_workload(10, num_adapters=8, zipf_s=1.0, offered_load=0.5, arrivals="poisson", costs=COSTS,
                       replicas=2, rows=4)
    with pytest.raises(ValueError, match="trace has"):
        fleet_workload(9000, num_adapters=8, zipf_s=1.0, offered_load=0.5, arrivals="trace", costs=COSTS,
                       replicas=2, rows=4)


def test_the_cost_model_prices_a_step_and_loads_as_the_engine_pays_them():
    assert COSTS.step_s(0) == COSTS.decode_s_per_token
    assert COSTS.step_s(1000) == pytest.approx(COSTS.decode_s_per_token + 1000 * COSTS.prefill_s_per_token)
    for rank in (8, 16, 32, 64):
        assert 0 < COSTS.host_copy_s(rank) < COSTS.disk_read_s(rank)
        assert COSTS.host_copy_s(rank) + COSTS.disk_read_s(rank) == pytest.approx(COSTS.load_seconds(rank, False))
    slow = COSTS.scaled(2.0)
    assert slow.step_s(500) == pytest.approx(2 * COSTS.step_s(500))
    assert slow.disk_read_s(64) == pytest.approx(2 * COSTS.disk_read_s(64))
    with pytest.raises(ValueError):
        COSTS.scaled(0)

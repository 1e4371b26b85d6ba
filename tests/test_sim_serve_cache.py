"""The simulator's model of what Serve's own routers know of a replica's queue (``benchmarks/sim/serve_cache.py``)
and the refusals it leads to in ``routing_live``'s simulated fleet (``benchmarks/sim/cpu_fleet.py``)."""

from __future__ import annotations

import numpy as np

from benchmarks.sim.config import SimRequest
from benchmarks.sim.cpu_fleet import CpuFleetConfig, run_cpu_fleet
from benchmarks.sim.events import EventLoop
from benchmarks.sim.serve_cache import LogNormal, ServeQueueCache, ServeTimes
from benchmarks.sim.serve_routing import ServeRoutingTasks


class Loop(EventLoop):
    def run_for(self, seconds: float) -> None:
        end = self.now + seconds
        self.at(end, lambda: None)
        self.run_until(lambda: self.now >= end)


def cache_with(counts: list[int], rpc_s: float, max_ongoing: int = 8) -> tuple[Loop, ServeQueueCache]:
    """A cache whose replicas all answer in ``rpc_s`` (when full; scaled by their share of rows taken)."""
    loop = Loop()
    times = ServeTimes(rpc=LogNormal(rpc_s, 0.0))
    return loop, ServeQueueCache(loop, times, max_ongoing, lambda i: counts[i], np.random.default_rng(0))


def test_a_cached_count_with_room_is_chosen_at_once_the_least_loaded_and_the_full_one_probed_behind():
    loop, cache = cache_with([8, 3, 5], rpc_s=0.05)
    cache.cached.update({0: 8, 1: 6, 2: 2})
    chosen = []
    cache.select([0, 1, 2], 0, chosen.append)
    assert chosen == [2] and cache.probes == 1  # replica 0's full count is asked again, in the background
    loop.run_for(0.1)
    assert cache.cached[0] == 8 and chosen == [2]


def test_with_no_room_in_the_cache_the_router_waits_for_the_probes_and_takes_the_least_loaded_answer():
    loop, cache = cache_with([8, 4], rpc_s=0.08)  # replica 1 answers in 0.08 * 4/8 = 0.04 s
    cache.cached.update({0: 8, 1: 8})
    chosen = []
    cache.select([0, 1], 0, lambda i: chosen.append((round(loop.now, 6), i)))
    loop.run_for(0.2)
    assert chosen == [(0.08, 1)]  # after the slower answer (replica 0's, 0.08 s, within the 0.1 s deadline)
    assert cache.cached == {0: 8, 1: 4}


def test_an_answer_later_than_the_deadline_counts_as_none_and_the_deadline_doubles_with_each_failed_try():
    loop, cache = cache_with([7], rpc_s=0.15)  # 0.15 * 7/8 = 0.131 s
    chosen = []
    cache.select([0], 0, lambda i: chosen.append((round(loop.now, 6), i)))
    loop.run_for(0.5)
    assert chosen == [(0.1, None)] and cache.probe_timeouts == 1 and 0 not in cache.cached
    cache.select([0], 1, lambda i: chosen.append((round(loop.now, 6), i)))  # deadline 0.2 s
    loop.run_for(0.5)
    assert chosen[-1] == (0.63125, 0) and cache.cached[0] == 7


def test_sends_count_before_any_reply_and_replies_and_results_correct_the_count():
    loop, cache = cache_with([0, 0], rpc_s=0.01)
    cache.sent(0)
    cache.sent(0)
    assert cache.cached[0] == 2
    cache.replied(0, 5)
    cache.result(0)
    assert cache.cached[0] == 4
    cache.result(1)  # nothing cached for replica 1: nothing to lower
    assert 1 not in cache.cached
    cache.cached[0] = 8
    cache.sent(0)
    assert cache.sends == 3 and cache.sends_at_full_cache == 1


def test_a_refused_request_goes_back_before_younger_ones_and_is_routed_again():
    loop = Loop()
    placed = []

    def dispatch(req: SimRequest, idx: int) -> None:
        req.replica = idx
        placed.append(req.i)

    tasks = ServeRoutingTasks(loop, 1, lambda req: 0, dispatch)
    old = SimRequest(0, "a", 0.0, 8, 8, 16)
    tasks.arrive(old)
    assert placed == [0]
    tasks.retry(old)
    assert placed == [0, 0] and old.replica == 0


def routing_live_fleet(variant: str, concurrency: int, serve_times=ServeTimes()):
    requests = [(f"a{i % 12}", "x" * 40, 12) for i in range(160)]
    cfg = CpuFleetConfig(variant=variant, replicas=2, slots=4, max_batch=8, step_base_s=0.0015,
                         step_per_seq_s=0.0001, serve_times=serve_times)
    return run_cpu_fleet(requests, concurrency, cfg)


def test_serve_routers_on_their_cache_are_refused_at_concurrency_64_and_never_at_one():
    busy = routing_live_fleet("pow2", 64)
    assert busy.refusals_per_request > 0.2 and busy.sends_at_full_cache > 0.2 and busy.probe_timeouts >= 0.0
    exact = routing_live_fleet("pow2", 64, serve_times=None)
    assert exact.refusals_per_request == 0.0 and exact.req_per_s > busy.req_per_s
    assert routing_live_fleet("multiplexed", 1).refusals_per_request == 0.0
    assert routing_live_fleet("pow2", 1).refusals_per_request == 0.0


def test_the_product_router_reads_the_same_cache_is_refused_at_times_and_decides_again_until_all_are_served():
    """Live, the affinity router prices a replica by Serve's cached count plus its own unsent choices, and a refused
    send comes back to it (0.44 refusals per request in serve_release): in the model too, with every request served."""
    busy = routing_live_fleet("affinity", 64)
    assert busy.requests == 160 and busy.refusals_per_request > 0.0
    assert busy.req_per_s < routing_live_fleet("affinity", 64, serve_times=None).req_per_s
    assert routing_live_fleet("affinity", 1).refusals_per_request == 0.0


def test_refusals_and_probes_cost_the_replica_cpu_its_steps_wait_for():
    """A refused send and a probe each cost the replica's process CPU (benchmarks.live.refusal_cost): with them
    priced, Serve's router at concurrency 64 spends more worker CPU per request and serves fewer requests a second."""
    free = routing_live_fleet("pow2", 64, serve_times=ServeTimes(refusal_cpu_s=0.0, probe_cpu_s=0.0))
    priced = routing_live_fleet("pow2", 64, serve_times=ServeTimes(refusal_cpu_s=0.002, probe_cpu_s=0.001))
    assert priced.refusals_per_request > 0.2
    assert priced.workers_cpu_ms > free.workers_cpu_ms + 0.002 * 1000 * 0.2
    assert priced.req_per_s < free.req_per_s


def fleet_with(variant: str, concurrency: int, **cfg):
    requests = [(f"a{i % 12}", "x" * 40, 12) for i in range(160)]
    return run_cpu_fleet(requests, concurrency, CpuFleetConfig(variant=variant, replicas=2, slots=4, max_batch=8,
                                                               step_base_s=0.0015, step_per_seq_s=0.0001, **cfg))


def test_a_disk_read_keeps_its_requester_waiting_not_the_batch_and_its_wait_is_not_cpu():
    """As the live worker reads a cold adapter before it submits: a slow read lengthens latency, not the workers'
    CPU, and the rows already running keep stepping (the run's other requests finish no later than their reads)."""
    fast = fleet_with("pow2", 8, disk_load_s=0.002)
    slow = fleet_with("pow2", 8, disk_load_s=0.5)
    # at least 12 reads of 0.5 s: charged as CPU they would add >= 37 ms a request; smaller batches add a little
    assert slow.workers_cpu_ms < 2 * fast.workers_cpu_ms < 20.0
    assert slow.p99_ms > fast.p99_ms + 400
    assert slow.p50_ms < 0.5 * slow.p99_ms  # most requests found their adapter read: they never waited for one


def test_each_distinct_adapter_in_a_step_costs_its_segment():
    """A spreading router's batches hold more adapters than the affinity router's; the step prices each."""
    flat = fleet_with("pow2", 64, step_per_adapter_s=0.0)
    priced = fleet_with("pow2", 64, step_per_adapter_s=0.0005)
    assert priced.workers_cpu_ms > flat.workers_cpu_ms and priced.req_per_s < flat.req_per_s

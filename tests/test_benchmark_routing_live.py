"""``benchmarks.routing_live``: its goal verdicts, the injected load cost, and one row on a live cluster.

The product's own deployments are covered by the fleet tests; here only what the
benchmark adds: the goals, the benchmark-only load cost in the load path, the client
processes (one router each) and the multiplexing baseline.
"""

from __future__ import annotations

import math
import time

import pytest

from benchmarks import routing_live as rl
from benchmarks.live.imbalance import busiest_share
from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.request import GenerateRequest


def row(variant, *, setting="skew", cost="cheap", c=64, routers=1, rps=30.0, p50=100.0, p99=200.0, loads=10,
        cpu=5.0):
    return {"setting": setting, "cost": cost, "routers": routers, "variant": variant, "concurrency": c,
            "req_per_s": rps, "p50_ms": p50, "p99_ms": p99, "loads": loads, "loads_per_1k": float(loads),
            "router_cpu_ms": cpu}


def verdicts(rows):
    goals, where = rl.goals(rows)
    assert set(where) == {g["name"] for g in goals}
    return {g["name"]: (g["pass"], g["measured"]) for g in goals}


def test_goals_take_the_worst_row_and_the_better_peer():
    rows = [row("affinity", rps=30, p50=100, p99=200, loads=2, cpu=5.2),
            row("multiplexed", rps=25, p50=90, p99=300, loads=10, cpu=4.0),
            row("pow2", rps=31, p50=150, p99=190, loads=40, cpu=5.0),
            row("affinity", c=1, rps=20, p50=40, p99=60, loads=0, cpu=6.0),
            row("multiplexed", c=1, rps=20, p50=40, p99=60, loads=0, cpu=5.0),
            row("pow2", c=1, rps=19, p50=41, p99=61, loads=5, cpu=5.0)]
    v = verdicts(rows)
    assert v["live_throughput_vs_best_peer"] == (False, round(30 / 31, 3))   # pow2 is the better peer at c=64
    assert v["live_p50_vs_best_peer"] == (False, round(100 / 90, 3))
    assert v["live_p99_vs_best_peer"] == (False, round(200 / 190, 3))
    assert v["live_loads_vs_multiplexed"] == (True, 0.2)                     # c=1: multiplexing loaded nothing
    assert v["router_cpu_per_request_vs_default"] == (False, 1.2)            # the worst row: 6.0 / 5.0
    assert v["live_expensive_p99_vs_best_peer"] == (None, None)              # no expensive rows in this run
    assert v["live_multi_router_loads_ratio"] == (None, None)


def test_multi_router_loads_compare_with_the_same_row_of_one_router():
    rows = [row("affinity", loads=0), row("affinity", routers=3, loads=0),
            row("affinity", setting="fits", loads=4), row("affinity", setting="fits", routers=3, loads=5)]
    assert verdicts(rows)["live_multi_router_loads_ratio"] == (False, 1.25)
    rows[-1]["loads"] = 4
    assert verdicts(rows)["live_multi_router_loads_ratio"] == (True, 1.0)     # 0 with both counts as equal
    rows[0]["loads"], rows[1]["loads"] = 0, 1
    assert verdicts(rows)["live_multi_router_loads_ratio"][0] is False        # 1 vs 0: infinitely worse


def test_clients_split_the_trace_and_the_concurrency_evenly():
    from testkit.clients import shares, split

    assert split(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert shares(64, 3) == [22, 21, 21] and shares(1, 1) == [1]


def test_injected_load_cost_tops_up_disk_reads_and_prices_host_tier_hits(demo_assets):
    from benchmarks.live.load_cost import InjectedLoadCost, LoadCost

    engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=2, max_lora_rank=16,
                                max_batch_size=4, max_model_len=128).engine_config())
    try:
        injected = InjectedLoadCost(engine)
        injected.cost = LoadCost(host_s=0.05, disk_s=0.3)
        path = str(demo_assets.adapters["demo-1"])
        started = time.perf_counter()
        engine.register_adapter("demo-1", path)                      # a read from disk: topped up to 0.3 s
        assert time.perf_counter() - started >= 0.3
        uid = engine.current_uid("demo-1")
        started = time.perf_counter()
        engine.generate_blocking(GenerateRequest(adapter="demo-1", prompt="hi", max_tokens=1))
        assert time.perf_counter() - started >= 0.05                 # the slot load: a host-tier copy
        snap = engine.pool_snapshot()
        assert snap.counters.loads == 1 and snap.counters.load_seconds >= 0.05  # the pool measured it
        started = time.perf_counter()
        engine.generate_blocking(GenerateRequest(adapter="demo-1", prompt="hi", max_tokens=1))
        assert engine.pool_snapshot().counters.loads == 1            # resident: no load, no delay charged
        assert engine.is_resident(uid)
        with pytest.raises(ValueError, match="must not be negative"):
            LoadCost(host_s=-1.0)
    finally:
        engine.shutdown()


def test_one_row_of_the_multiplexed_baseline_with_expensive_loads(ray_cluster, demo_assets):
    """Serve's LRU really unloads (each load a registration), the injected disk cost shows in the
    baseline's own load timings, and the row's CPU and latency columns are filled."""
    from fleet_helpers import delete_app
    from ray import serve

    from benchmarks.live.load_cost import LoadCost
    from benchmarks.live.processes import CpuMeter, find_processes

    args = rl.make_parser().parse_args(["--replicas", "1", "--slots", "2", "--max-batch-size", "4"])
    variant = rl.Variant("multiplexed", args, num_adapters=3)
    variant.app = f"routing-live-smoke-{int(time.time())}"
    cost = LoadCost(host_s=0.01, disk_s=0.2)
    variant.deploy()
    variant.set_load_cost(cost)
    try:
        setting = rl.Setting("smoke", 3, 1.0)  # uniform over 3 adapters on 2 slots: Serve's LRU must unload
        requests = rl.build_requests(setting, 12, seed=0)
        assert requests == rl.build_requests(setting, 12, seed=0)  # deterministic
        meter = CpuMeter(find_processes([variant.app]))
        result = rl.measure_row(variant, meter, setting, "expensive", 2, 1, requests)
        stats = rl.sample_replicas(
            lambda: serve.get_deployment_handle(variant.deployment, app_name=variant.app).stats.remote(), 1)
    finally:
        delete_app(variant.app)
    assert result["errors"] == 0 and sum(result["replica_requests"].values()) == 12
    assert result["loads"] > 0 and result["workers_cpu_ms"] > 0 and result["router_cpu_ms"] > 0
    snap = next(iter(stats.values()))
    assert snap["mux_loads"] >= result["loads"]
    assert snap["mux_load_seconds"] / snap["mux_loads"] >= 0.2  # every registration paid the disk read


def test_only_the_affinity_variants_workers_follow_the_plan():
    """Behind Serve's default router the plan routes nothing, so workers that kept its adapters would hold slots
    the traffic needs: the peers run the product's workers as a Serve user would, without the plan."""
    args = rl.make_parser().parse_args(["--quick"])
    follows = {name: rl.Variant(name, args, 12).parsed.replicas_follow_plan for name in rl.VARIANTS}
    assert follows == {"affinity": True, "multiplexed": False, "pow2": False}


def test_busiest_share_even_split_reads_half_and_one_sided_reads_one():
    # two replicas, requests alternating, all outstanding together: half each
    sent = [0.0, 0.0, 0.0, 0.0]
    lat = [1.0, 1.0, 1.0, 1.0]
    assert busiest_share(sent, lat, ["a", "b", "a", "b"]) == 0.5
    # every request on one replica: all outstanding work sits there
    assert busiest_share(sent, lat, ["a", "a", "a", "a"]) == 1.0


def test_busiest_share_drift_shows_in_the_upper_quantile_and_failures_are_left_out():
    # early on balanced, later three of four outstanding requests sit on "a"
    sent = [0.0, 0.0, 1.0, 1.5, 1.6, 1.7]
    lat = [0.5, 0.5, 5.0, 5.0, 5.0, 0.1]
    reps = ["a", "b", "a", "a", "b", None]
    assert busiest_share(sent, lat, reps, quantile=100.0) == 1.0
    assert busiest_share(sent, lat, reps, quantile=0.0) == 0.5
    assert math.isnan(busiest_share([0.0], [1.0], [None]))


def test_serve_release_joins_replica_events_to_the_client_by_prompt():
    from benchmarks.serve_release import analyse

    events = [{"ev": "inc", "t": 0.0, "rid": "a"}, {"ev": "return", "t": 1.0, "rid": "a", "prompt": "pa"},
              {"ev": "dec", "t": 1.010, "rid": "a"},                      # released 10 ms after the return
              {"ev": "inc", "t": 0.5, "rid": "b"}, {"ev": "return", "t": 2.0, "rid": "b", "prompt": "pb"},
              {"ev": "dec", "t": 2.002, "rid": "b"},                      # released 2 ms after
              {"ev": "reject", "t": 0.1, "rid": "x"}, {"ev": "reject", "t": 1.5, "rid": "y"}]
    # the client had "pa" 5 ms after its return (before the release) and "pb" 4 ms after (after it)
    found = analyse(events, sent_at=[0.0, 0.5], latencies=[1.005, 1.504], prompts=["pa", "pb"], since=1.0)
    assert found["joined"] == 2 and found["rejections"] == 1 and found["rejections_per_request"] == 0.5
    assert found["released_after_client"] == 0.5
    assert abs(found["release_p50_ms"] - 6.0) < 1e-6 and abs(found["client_p50_ms"] - 4.5) < 1e-6


def test_serve_release_reads_occupancy_and_the_routers_view():
    from benchmarks.serve_release import occupancy, router_view

    # 2 rows: empty 0-1 s, one request 1-2 s, full 2-3 s, then empty again until 4 s; measured from 1 s
    events = [{"ev": "inc", "t": 1.0}, {"ev": "inc", "t": 2.0}, {"ev": "dec", "t": 3.0}, {"ev": "dec", "t": 3.0},
              {"ev": "inc", "t": 4.0}, {"ev": "return", "t": 2.5}]
    idle, full = occupancy(events, since=1.0, rows=2)
    assert abs(idle - 1 / 3) < 1e-9 and abs(full - 1 / 3) < 1e-9
    sends = [{"ev": "send", "t": 1.0, "cache": c} for c in (0, 1, 8, 9)] + [
        {"ev": "probe", "t0": 1.0, "t": 1.1, "n": [8, None]}, {"ev": "send", "t": 0.5, "cache": 30}]
    view = router_view(sends, since=1.0, rows=8)
    assert view["sends_at_full_cache"] == 0.5 and view["probe_timeouts"] == 0.5
    assert abs(view["probe_p50_ms"] - 100.0) < 1e-6 and view["send_cache_p50"] == 4.5


def test_low_concurrency_cells_alternate_the_variants_in_turns():
    """A cell at concurrency 1 is cut in slices the variants take in turns (machine drift hits each alike);
    at 64 one turn keeps the closed loop's steady state; a turn keeps 16 requests per client."""
    assert rl.turns_for(1, 200) == rl.MAX_TURNS
    assert rl.turns_for(64, 512) == 1
    assert rl.turns_for(8, 256) == 2
    assert rl.turns_for(1, 20) == 1


def test_turns_merge_into_one_row():
    """Merged turns: req/s over the summed wall time, latencies pooled, counters and CPU summed."""
    from collections import Counter

    def part(latencies, wall, loads, engine_cpu):
        n = len(latencies)
        return {"result": {"latencies": latencies, "ttfts": latencies, "replicas": ["r0"] * n,
                           "sent_at": [float(i) for i in range(n)], "errors": [], "wall_s": wall, "cpu_s": 0.01 * n,
                           "router_p50_ms": [1000.0 * latencies[0]]},
                "cpu": {"app/LoRAWorker": 0.02 * n}, "loads": loads, "decisions": Counter(spill=1), "n": n,
                "engine": {"engine_cpu_s": engine_cpu, "rows_stepped": 10 * n, "steps": 10 * n}}

    merged = rl.merge_parts([part([0.1, 0.3], 1.0, 1, 0.5), part([0.2, 0.4, 0.6], 2.0, 2, 1.0)])
    assert merged["n"] == 5 and merged["loads"] == 3 and merged["decisions"]["spill"] == 2
    assert merged["result"]["wall_s"] == 3.0 and merged["result"]["latencies"] == [0.1, 0.3, 0.2, 0.4, 0.6]
    assert merged["result"]["router_p50_ms"] == [300.0]
    assert merged["engine"]["engine_cpu_s"] == 1.5 and merged["cpu"]["app/LoRAWorker"] == 0.1
    single = part([0.1], 1.0, 0, 0.1)
    assert rl.merge_parts([single]) is single


def test_a_replica_held_at_its_limit_refuses_every_send_and_each_refusal_costs_it_cpu(ray_cluster):
    """benchmarks.live.refusal_cost: the replica itself counts the refusals and probes it handled while holding
    its one row; both cost its process CPU above the same window idle."""
    from benchmarks.live.refusal_cost import measure_refusal_cost
    from engine.request import GenerateRequest

    costs = measure_refusal_cost(GenerateRequest(adapter="demo-0", prompt="hello there", max_tokens=8),
                                 rounds=1, window_s=1.0)
    assert costs["refusals_per_s"] > 20 and costs["probes_per_s"] > 20
    assert 0.0 < costs["probe_cpu_ms"] < 50.0 and 0.0 < costs["refusal_cpu_ms"] < 50.0

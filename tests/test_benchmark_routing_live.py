"""Smoke test of ``benchmarks.routing_live`` inside the session's Ray cluster.

Only the new parts: the multiplexed baseline deployment (Serve's LRU really unloads
adapters from the engine, and both load counts agree) and the measurement plumbing;
the product's own deployments are covered by the fleet tests. Plus the goal verdicts.
"""

from __future__ import annotations

import time

from benchmarks import routing_live as rl


def test_goal_verdicts_cover_ties_and_failures():
    def row(setting, variant, c, loads, p99):
        return {"setting": setting, "variant": variant, "concurrency": c, "loads_per_1k": loads, "p99_ms": p99}

    rows = [row("fits", "affinity", 8, 0.0, 10.0), row("fits", "multiplexed", 8, 0.0, 10.0),
            row("fits", "pow2", 8, 50.0, 10.0), row("skew", "affinity", 8, 100.0, 12.0),
            row("skew", "pow2", 8, 150.0, 10.0)]
    verdicts = {g["goal"]: g["pass"] for g in rl.goals(rows, (8,))}
    assert verdicts["fits: loads >= 5x fewer than multiplexed"] is None  # neither loaded: no verdict
    assert verdicts["skew: loads >= 50% fewer than pow2"] is False       # 33% fewer
    assert verdicts["fits: p99 within 10% of pow2"] is True
    assert verdicts["skew: p99 within 10% of pow2"] is False             # 1.2x


def test_multiplexed_baseline_unloads_and_counts_loads(ray_cluster, demo_assets):
    from ray import serve

    args = rl.make_parser().parse_args(["--replicas", "1", "--slots", "2", "--max-batch-size", "4"])
    variant = rl.MultiplexedVariant(args, num_adapters=3)
    variant.app = f"routing-live-smoke-{int(time.time())}"
    variant.deploy()
    try:
        setting = rl.Setting("smoke", 3, 1.0)  # uniform over 3 adapters on 2 slots: Serve's LRU must unload
        requests = rl.build_requests(setting, 12, seed=0)
        assert requests == rl.build_requests(setting, 12, seed=0)  # deterministic
        rows = rl.measure(variant, setting, requests, rl.build_requests(setting, 4, seed=1), (1, 4))
    finally:
        serve.delete(variant.app)
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["errors"] == 0 and sum(r["replica_requests"].values()) == 12
        assert r["loads_per_1k"] == r["mux_loads_per_1k"]  # one registration = one slot load
    assert sum(r["loads"] for r in rows) > 0 and any(r["evictions_per_1k"] > 0 for r in rows)

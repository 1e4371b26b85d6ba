"""The Ray Serve core on a local cluster: affinity, a true directory view, pinning, handles."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.request import GenerateRequest
from fleet_helpers import directory, live_replicas, real_pool, wait_for_view_to_match_pools
from pool.errors import AdapterNotFoundError
from waiting import wait_until


def generate(fleet, adapter, prompt="hello", max_tokens=3):
    return fleet.generate.remote(GenerateRequest(adapter=adapter, prompt=prompt, max_tokens=max_tokens)).result()


def test_after_warm_up_requests_land_on_the_replica_holding_the_adapter(fleet):
    replicas = live_replicas(2)
    assert len(replicas) == 2
    adapters = ["demo-1", "demo-2", "demo-3", "demo-4"]  # fits 2 replicas x 3 slots (plus base slots)

    def one_round() -> dict:
        return {adapter: generate(fleet, adapter).replica_id for adapter in adapters}

    def settled(now: dict) -> bool:  # the plan has seen this traffic; each adapter went where the plan or a copy is
        plan = directory().placement_plan.remote().result()
        return all(a in plan["demand"] and (now[a] in plan["holders"].get(a, ()) or not any(
            any(uid.startswith(a + "@") for uid in real_pool(r)["resident"]) for r in plan["holders"].get(a, ())))
            for a in adapters)

    # warm-up: until the placement plan has taken this traffic in (earlier tests left other demand and
    # registrations on the shared fleet): two rounds in a row alike, each adapter on a planned replica or, where
    # no planned replica holds it, on the copy it has (a holder needs no load: routing.policy)
    last = one_round()
    for _ in range(60):
        now = one_round()
        if now == last and settled(now):
            break
        last = now
    else:
        raise AssertionError(f"placements never settled: {last} then {now}")
    placement = {}
    misplaced = 0
    for adapter in adapters * 5:
        result = generate(fleet, adapter)
        if placement.setdefault(adapter, result.replica_id) != result.replica_id:
            misplaced += 1
        pool = real_pool(result.replica_id)
        assert any(uid.startswith(adapter + "@") for uid in pool["resident"]), (adapter, pool)
    assert misplaced == 0
    assert len(set(placement.values())) == 2  # the working set was spread, not piled on one replica


def test_directory_view_converges_to_the_real_pools_after_each_request_that_evicts(fleet):
    live_replicas(2)
    for extra in ["demo-6", "demo-7"]:  # 8 adapters + the base model > 2 replicas x 3 slots
        entry = fleet.register_adapter.remote(extra, f"demo:{extra}").result()
        assert entry["uid"].startswith(extra + "@")
    before = sum(real_pool(r)["counters"]["evictions"] for r in live_replicas(2))
    for adapter in ["demo-0", "demo-5", "demo-6", "demo-7", None, "demo-1", "demo-2", "demo-3", "demo-4",
                    "demo-6", None, "demo-0"]:
        generate(fleet, adapter)
        wait_for_view_to_match_pools()
    after = sum(real_pool(r)["counters"]["evictions"] for r in live_replicas(2))
    assert after > before  # the sequence really evicted


def test_pinned_adapter_survives_a_flood_of_other_adapters(fleet):
    result = fleet.pin_adapter.remote("demo-4").result()
    assert result["pinned"]

    def pin_holders() -> list[str]:
        view = directory().view.remote().result()["replicas"]
        return [r for r, s in view.items() if any(u.startswith("demo-4@") for u in s["pinned"])]

    holders = wait_until(pin_holders, 60, "the directory to see demo-4 pinned")
    assert len(holders) == 1  # pin_replicas = 1: its first replica in rendezvous order
    try:
        for adapter in ["demo-0", "demo-1", "demo-2", "demo-3", "demo-5"] * 3:
            generate(fleet, adapter)
            assert any(u.startswith("demo-4@") for u in real_pool(holders[0])["pinned"])
    finally:
        fleet.unpin_adapter.remote("demo-4").result()


def test_unknown_adapter_raises_a_typed_error_naming_it(fleet):
    with pytest.raises(AdapterNotFoundError, match="never-registered"):
        generate(fleet, "never-registered")


def test_streaming_through_the_handle(fleet):
    stream = fleet.options(stream=True).generate_stream.remote(
        GenerateRequest(adapter="demo-2", prompt="stream", max_tokens=5))
    items = list(stream)
    final = items[-1]
    assert final.finish_reason == "length" and final.completion_tokens == 5
    assert "".join(d.text for d in items[:-1]) == final.text


def test_a_separate_ray_driver_gets_completions_through_the_app_handle(fleet, ray_cluster):
    """The README's example, run as its own driver against the session cluster."""
    repo = Path(__file__).parents[1]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    proc = subprocess.run([sys.executable, str(repo / "examples" / "call_from_ray_app.py")], env=env,
                          capture_output=True, text=True, timeout=180, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    fields = dict(part.split("=", 1) for part in line.split()[1:4])
    assert fields["adapter"] == "demo-1" and fields["tokens"] == "8" and fields["replica"] in live_replicas(2)
    assert any(l.startswith("STREAM") for l in proc.stdout.splitlines())
    assert any(l.startswith("ADAPTER demo-1") for l in proc.stdout.splitlines())


def test_three_routers_load_no_more_than_one(fleet, ray_cluster):
    """Three processes, each with its own router, share the fleet: at the same total concurrency and
    trace, a working set that fits the slots loads (after warm-up) no more than with one router."""
    import ray

    from testkit.clients import LoadClient, shares, split
    from conftest import FLEET_APP

    live_replicas(2)
    trace = [(a, "agree", 3) for a in ["demo-1", "demo-2", "demo-3", "demo-4"] * 6]
    clients = [LoadClient.remote(FLEET_APP, "LoRAWorker", False) for _ in range(3)]

    def loads() -> int:
        return sum(c.get("load", 0) for c in directory().adapter_counts.remote().result().values())

    def routed() -> int:  # each client's router's decisions (routing.router_metrics), waits aside
        return sum(n for d in ray.get([c.decisions.remote() for c in clients]) for k, n in d.items() if k != "wait")

    def run(routers: int) -> int:
        before, decided = loads(), routed()
        parts = split(trace, routers)
        results = ray.get([c.run.remote(p, s) for c, p, s in zip(clients[:routers], parts, shares(3, routers))])
        assert all(not r["errors"] for r in results), [r["errors"] for r in results]
        assert sum(len(r["replicas"]) for r in results) == len(trace)
        assert routed() - decided == len(trace)  # one decision per request, read without Serve's internals
        return loads() - before

    try:
        run(1)
        run(3)  # warm-up: every router has seen the placements
        one, three = run(1), run(3)
        assert three <= one + 2, (one, three)
    finally:
        for client in clients:
            ray.kill(client)


def test_a_new_placement_is_read_ahead_before_its_first_request(fleet):
    """The plan places a newly registered adapter; its planned replica reads it into the host tier before
    any request asks for it, the admin view shows the placement, and the first request goes there."""
    from fleet_helpers import view_replicas

    entry = fleet.register_adapter.remote("read-ahead", "demo:demo-9").result()
    uid = entry["uid"]
    try:
        def planned() -> list[str]:
            return directory().placement_plan.remote().result().get("holders", {}).get("read-ahead", [])

        holders = wait_until(planned, 60, "the plan to place read-ahead")
        staged = wait_until(lambda: [r for r in holders if uid in view_replicas()[r]["host_cached"]
                                     or uid in view_replicas()[r]["resident"]], 60,
                            "a planned replica to read read-ahead ahead of traffic")
        assert staged
        described = fleet.list_adapters.remote().result()
        row = next(a for a in described["data"] if a["name"] == "read-ahead")
        assert row["planned_on"] == holders and row["plan_moves"] == 0
        assert described["plan"]["version"] >= 1 and "busy" in described["plan"]
        assert generate(fleet, "read-ahead").replica_id in holders
    finally:
        fleet.unregister_adapter.remote("read-ahead").result()


def test_a_registered_adapter_waits_in_the_host_tier_of_the_replica_its_first_request_goes_to(fleet):
    """Standby copies: before any request, a new registration is read into the host tier of its rendezvous-first
    replica (where routers send it while nothing holds it), so that request copies it into a slot instead of
    reading the file on its way to the first token."""
    from routing.warm_start import standby_names

    entry = fleet.register_adapter.remote("standby", "demo:demo-8").result()
    uid = entry["uid"]
    try:
        replicas = sorted(live_replicas(2))
        (first,) = [r for r in replicas if "standby" in standby_names(r, replicas, ["standby"])]
        wait_until(lambda: uid in real_pool(first)["host_cached"], 60, f"{first} to stage standby ahead of traffic")
    finally:
        fleet.unregister_adapter.remote("standby").result()

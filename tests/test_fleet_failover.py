"""Killing a worker: the directory forgets it and its adapters' later requests go elsewhere."""

from __future__ import annotations

import time

import ray

from engine.request import GenerateRequest
from fleet_helpers import directory, live_replicas


def test_killed_worker_leaves_the_view_and_traffic_moves(fleet):
    replicas = live_replicas(2)
    served = fleet.generate.remote(GenerateRequest(adapter="demo-3", prompt="x", max_tokens=2)).result()
    victim = served.replica_id
    actor = ray.get_actor(f"SERVE_REPLICA::lorafleet#LoRAWorker#{victim}", namespace="serve")
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while victim in directory().view.remote().result()["replicas"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim not in directory().view.remote().result()["replicas"]
    for _ in range(5):
        result = fleet.generate.remote(GenerateRequest(adapter="demo-3", prompt="x", max_tokens=2)).result()
        assert result.replica_id != victim
    survivors = set(replicas) - {victim}
    assert survivors & set(live_replicas(1))

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


def test_registry_survives_a_directory_restart(fleet):

    before = {e["name"]: e["uid"] for e in fleet.list_adapters.remote().result()["data"]}
    actor_names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if "AdapterDirectory" in a["name"]]
    assert len(actor_names) == 1
    ray.kill(ray.get_actor(actor_names[0], namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 60
    after = None
    while time.monotonic() < deadline:
        try:
            after = {e["name"]: e["uid"] for e in fleet.list_adapters.remote().result(timeout_s=10)["data"]}
            if directory().view.remote().result(timeout_s=10)["replicas"]:
                break
        except Exception:  # the directory is restarting
            pass
        time.sleep(0.5)
    assert after == before  # same names, same uids: restored from the GCS key-value store
    assert live_replicas(1)  # workers re-reported their pools to the new directory
    result = fleet.generate.remote(GenerateRequest(adapter="demo-2", prompt="after", max_tokens=2)).result()
    assert result.completion_tokens == 2

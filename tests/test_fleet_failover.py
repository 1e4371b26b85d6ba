"""Killing the directory, then a worker, on a throwaway app of this module's own (never the shared fleet).

A killed directory comes back with the same registry (names and uids) and the workers' pools; a
killed worker leaves the directory's view and its adapters' later requests go elsewhere. The two
tests share the app (one deploy, not two) in that order: the directory test ends with a restored
directory that has heard from both workers, which is where the worker test starts; each test
also waits for its own start (two workers in the view), so either runs alone as well.
"""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import RayError

from conftest import deploy_fleet
from engine.request import GenerateRequest
from fleet_helpers import delete_app, directory, live_replicas, view_replicas
from waiting import wait_until


@pytest.fixture(scope="module")
def own_fleet(ray_cluster, demo_assets):
    """A two-worker lorafleet app with its own directory, for this module's tests; deleted afterwards."""
    app = "failover"
    handle = deploy_fleet(demo_assets, app, route_prefix=None)
    yield app, handle
    delete_app(app)


def registry(handle) -> dict[str, str]:
    return {e["name"]: e["uid"] for e in handle.list_adapters.remote().result(timeout_s=30)["data"]}


def directory_epoch(app: str) -> str:
    """The directory's epoch: a fresh one after every restart."""
    return directory(app).get_changes.remote(-1, 0.0).result(timeout_s=10)["epoch"]


def test_registry_survives_a_directory_restart(own_fleet):
    app, handle = own_fleet
    live_replicas(2, app)
    before = registry(handle)
    assert {f"demo-{i}" for i in range(6)} <= set(before)
    prefix = f"SERVE_REPLICA::{app}#AdapterDirectory#"
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    old_epoch = directory_epoch(app)
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    # a new directory (new epoch) that workers have re-reported to
    wait_until(lambda: directory_epoch(app) != old_epoch and len(view_replicas(app)) == 2, 120,
               f"{app}'s directory to restart and hear from both workers", retry_on=(RayError, TimeoutError))
    assert registry(handle) == before  # same names, same uids: restored from the GCS key-value store
    result = handle.generate.remote(GenerateRequest(adapter="demo-2", prompt="after", max_tokens=2)).result()
    assert result.completion_tokens == 2


def test_killed_worker_leaves_the_view_and_traffic_moves(own_fleet):
    app, handle = own_fleet
    replicas = live_replicas(2, app)
    served = handle.generate.remote(GenerateRequest(adapter="demo-3", prompt="x", max_tokens=2)).result()
    victim = served.replica_id
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{app}#LoRAWorker#{victim}", namespace="serve"), no_restart=True)
    wait_until(lambda: victim not in view_replicas(app), 60, f"the directory to forget killed worker {victim}")
    for _ in range(5):
        result = handle.generate.remote(GenerateRequest(adapter="demo-3", prompt="x", max_tokens=2)).result()
        assert result.replica_id != victim
    survivors = set(replicas) - {victim}
    assert survivors & set(live_replicas(1, app))

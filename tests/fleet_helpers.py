"""Helpers for integration tests against the deployed app."""

from __future__ import annotations

import time

from ray import serve

from engine.request import ReplicaTarget


def directory():
    return serve.get_deployment_handle("AdapterDirectory", app_name="lorafleet")


def workers():
    return serve.get_deployment_handle("LoRAWorker", app_name="lorafleet")


def live_replicas(min_count: int = 1, timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = sorted(directory().view.remote().result()["replicas"])
        if len(replicas) >= min_count or time.monotonic() > deadline:
            return replicas
        time.sleep(0.2)


def real_pool(replica_id: str) -> dict:
    return workers().pool_state.remote(ReplicaTarget(replica_id)).result()


def view_matches_pools(timeout_s: float = 1.0) -> tuple[bool, float]:
    """Whether, within ``timeout_s``, the directory's residency equals every worker's real pool."""
    start = time.monotonic()
    while True:
        view = directory().view.remote().result()["replicas"]
        ok = all(
            view[r]["resident"] == real_pool(r)["resident"] and set(view[r]["pinned"]) == set(real_pool(r)["pinned"])
            for r in view
        )
        elapsed = time.monotonic() - start
        if ok or elapsed > timeout_s:
            return ok, elapsed
        time.sleep(0.02)

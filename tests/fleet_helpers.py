"""Helpers for integration tests against a deployed lorafleet app (the shared one by default)."""

from __future__ import annotations

from ray import serve

from conftest import FLEET_APP
from engine.request import ReplicaTarget
from waiting import wait_until


def directory(app: str = FLEET_APP):
    return serve.get_deployment_handle("AdapterDirectory", app_name=app)


def workers(app: str = FLEET_APP):
    return serve.get_deployment_handle("LoRAWorker", app_name=app)


def view_replicas(app: str = FLEET_APP) -> dict[str, dict]:
    """The directory's current view: replica id -> its state."""
    return directory(app).view.remote().result(timeout_s=30)["replicas"]


def live_replicas(min_count: int = 1, app: str = FLEET_APP, timeout_s: float = 60.0) -> list[str]:
    """The replicas the directory knows, once there are at least ``min_count`` (fails after ``timeout_s``)."""
    def enough() -> list[str]:
        ids = sorted(view_replicas(app))
        return ids if len(ids) >= min_count else []

    return wait_until(enough, timeout_s, f"{min_count} replicas in {app}'s directory")


def real_pool(replica_id: str, app: str = FLEET_APP) -> dict:
    return workers(app).pool_state.remote(ReplicaTarget(replica_id)).result(timeout_s=30)


def view_differences(app: str = FLEET_APP) -> list[str]:
    """Where the directory's residency and pins differ from the workers' real pools ([] = equal)."""
    found = []
    for replica, state in view_replicas(app).items():
        pool = real_pool(replica, app)
        if state["resident"] != pool["resident"]:
            found.append(f"{replica} resident: view {state['resident']} != pool {pool['resident']}")
        if set(state["pinned"]) != set(pool["pinned"]):
            found.append(f"{replica} pinned: view {sorted(state['pinned'])} != pool {sorted(pool['pinned'])}")
    return found


def wait_for_view_to_match_pools(app: str = FLEET_APP, timeout_s: float = 30.0) -> None:
    """Wait until the directory's view equals every worker's real pool; fail naming what still differs."""
    differences: list[str] = []

    def equal() -> bool:
        differences[:] = view_differences(app)
        return not differences

    wait_until(equal, timeout_s, f"{app}'s directory view to equal the real pools", detail=lambda: differences)


def ingress_stats(handle, replicas: int) -> dict[int, dict]:
    """``admission_stats`` of each of ``replicas`` ingress replicas (by pid), asking until each has answered
    (Serve spreads handle calls over the replicas at random)."""
    seen: dict[int, dict] = {}

    def every():
        for _ in range(4 * replicas):
            stats = handle.admission_stats.remote().result(timeout_s=30)
            seen[stats["pid"]] = stats
        return seen if len(seen) >= replicas else None

    return wait_until(every, 120, f"{replicas} ingress replicas to answer")


def deploy_app(app: str, args, workers: int, ingresses: int):
    """A fleet of its own (``args``: AppArgs) at ``/app``, with ``workers`` one-CPU workers and ``ingresses``
    ingress replicas; returns the ingress handle. The caller deletes it (``delete_app(app)``)."""
    from deployments.app import build_fleet

    return serve.run(build_fleet(args, {"num_replicas": workers, "ray_actor_options": {"num_cpus": 1}},
                                 {"num_replicas": ingresses}), name=app, route_prefix=f"/{app}")


def delete_app(app: str) -> None:
    """Delete a test's own app and return at once; Serve stops its replicas in the background.

    A blocking ``serve.delete`` spends ~3 s idle (Serve's 2 s drain check on each replica; it was 5-7 s while
    the directory waited out the long polls of callers already gone). Nothing waits on that: every test app has
    its own name and route prefix, and the session's ``serve.shutdown`` waits for whatever is still draining.
    """
    serve.delete(app, _blocking=False)

"""The chaos benchmark's own Ray cluster and lorafleet app: start it, find its replicas, kill them, read them.

The HTTP proxy's port is reserved the way the tests reserve theirs (``testkit.ports``), so no
other program can take the port between choosing and binding it.
Replica processes are found in the GCS actor table (name ``SERVE_REPLICA::<app>#<deployment>#<id>``,
with its pid), which works without the dashboard.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import psutil

from testkit.ports import REUSE_PORT_ENV
from testkit.serve_cluster import start_serve

REPLICA_PREFIX = "SERVE_REPLICA::"


def start_cluster(port: int, num_cpus: int) -> None:
    """A local Ray cluster and Serve with its HTTP proxy on ``port`` (the env is set first so workers inherit it)."""
    import ray

    os.environ.update(REUSE_PORT_ENV)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    start_serve(port)


def deploy(app: str, workers: int, app_args) -> None:
    """The product's app (``deployments.app.build_fleet``) with ``workers`` LoRAWorker replicas of one CPU each."""
    from ray import serve

    from deployments.app import build_fleet

    serve.run(build_fleet(app_args, {"num_replicas": workers, "ray_actor_options": {"num_cpus": 1}}),
              name=app, route_prefix="/")


@dataclass(frozen=True)
class ReplicaActor:
    name: str       # the actor's name in the "serve" namespace
    replica_id: str
    pid: int


def replica_actors(app: str, deployment: str) -> list[ReplicaActor]:
    """The live replica actors of one deployment, from the GCS actor table."""
    from ray._private import state

    prefix = f"{REPLICA_PREFIX}{app}#{deployment}#"
    found = []
    for info in state.actors(actor_state_name="ALIVE").values():
        name = info.get("Name") or ""
        if name.startswith(prefix):
            found.append(ReplicaActor(name, name[len(prefix):], int(info["Pid"])))
    return sorted(found, key=lambda a: a.replica_id)


def kill(actor: ReplicaActor) -> float:
    """Kill the replica's actor without a Ray restart (Serve's controller replaces it); returns when."""
    import ray

    handle = ray.get_actor(actor.name, namespace="serve")
    killed_at = time.monotonic()
    ray.kill(handle, no_restart=True)
    return killed_at


def directory_view(app: str, timeout_s: float = 5.0) -> Optional[dict]:
    """The directory's view of the replicas, or None while it cannot answer."""
    from ray import serve

    try:
        handle = serve.get_deployment_handle("AdapterDirectory", app_name=app)
        return handle.view.remote().result(timeout_s=timeout_s)["replicas"]
    except Exception:  # restarting, unreachable, timed out: not back yet
        return None


def engine_stats(app: str, replica_id: str, timeout_s: float = 10.0) -> dict:
    """One worker replica's engine counters (``pool_state``'s ``engine`` part)."""
    from ray import serve

    from engine.request import ReplicaTarget

    handle = serve.get_deployment_handle("LoRAWorker", app_name=app)
    return handle.pool_state.remote(ReplicaTarget(replica_id)).result(timeout_s=timeout_s)["engine"]


def fleet_engine_stats(app: str, replica_ids: list[str]) -> dict[str, dict]:
    return {r: engine_stats(app, r) for r in replica_ids}


def total(stats: dict[str, dict], key: str) -> int:
    return sum(s[key] for s in stats.values())


def wait_until_idle(app: str, replica_ids: list[str], timeout_s: float = 60.0) -> dict[str, dict]:
    """Poll until no engine has a request waiting or running and the counters stand still; returns them."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        stats = fleet_engine_stats(app, replica_ids)
        idle = total(stats, "waiting") == 0 and total(stats, "running") == 0
        if idle and previous is not None and total(stats, "tokens_generated") == total(previous, "tokens_generated"):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engines did not go idle within {timeout_s:g} s: {stats}")
        previous = stats if idle else None
        time.sleep(0.2)


def rss_bytes(pids: list[int]) -> dict[int, int]:
    """Resident set size of each live process in ``pids``."""
    found = {}
    for pid in pids:
        try:
            found[pid] = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return found

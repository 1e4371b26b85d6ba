"""Shared fixtures: demo assets built once per session, one local Ray cluster, the markers.

Every test is marked ``ray`` (it uses the ``ray_cluster`` fixture, directly or through
``fleet``/``http_base``/...) or ``unit`` (everything else: no Ray cluster), so
``pytest -m unit`` runs without starting Ray and ``pytest -m ray`` runs the integration tests.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import pytest

from deployments.edge_guard import PROXY_CALLBACK_ENV
from testkit.ports import HOST, REUSE_PORT_ENV, reserve_port
from testkit.serve_cluster import start_serve

sys.path.insert(0, str(Path(__file__).parent))  # tests' helper modules


ADMIN_TOKEN = "test-admin-token"
FLEET_APP = "lorafleet"
# On CUDA, a test engine's KV cache takes this share of the free GPU memory (the default 0.8 is one replica per
# card; a test module keeps a fixture's engine beside its tests' own, and a fleet runs replicas side by side). The
# CPU ignores it.
TEST_KV_FRACTION = 0.1
FLEET_ARGS = dict(max_loras_per_batch=3, max_lora_rank=16, max_batch_size=4, max_tokens_limit=64,
                  max_model_len=256, host_cache_bytes=64 << 20, kv_cache_memory_fraction=TEST_KV_FRACTION)
CLUSTER_FIXTURE = "ray_cluster"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test ``ray`` or ``unit`` by whether it needs the session cluster.

    An explicit marker that disagrees with the fixtures (``unit`` on a test that starts Ray,
    or ``ray`` on one that does not) is a collection error, so the split cannot drift.
    """
    for item in items:
        uses_ray = CLUSTER_FIXTURE in getattr(item, "fixturenames", ())
        wanted, other = ("ray", "unit") if uses_ray else ("unit", "ray")
        if item.get_closest_marker(other) is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked {other!r} but "
                                    f"{'uses' if uses_ray else 'does not use'} the {CLUSTER_FIXTURE} fixture")
        if item.get_closest_marker(wanted) is None:
            item.add_marker(wanted)


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lorafleet-demo")
    os.environ["LORAFLEET_DEMO_DIR"] = str(root)  # Ray workers started later inherit it
    return root


@pytest.fixture(scope="session")
def demo_assets(demo_root):
    from engine.demo import ensure_demo_assets

    return ensure_demo_assets(demo_root, num_adapters=6)


@pytest.fixture(scope="session")
def http_port() -> Iterator[int]:
    """A port for Serve's HTTP proxy, held by this process for the whole session (``testkit.ports``)."""
    sock = reserve_port()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.fixture(scope="session")
def ray_cluster(demo_root, http_port):
    """One local Ray cluster for the whole session (env set first, so every worker inherits it)."""
    import ray
    from ray import serve

    os.environ["LORAFLEET_ADMIN_TOKEN"] = ADMIN_TOKEN
    os.environ.update(REUSE_PORT_ENV)  # the proxy shares http_port's reservation
    os.environ.update(PROXY_CALLBACK_ENV)  # the edge guard in Serve's proxy, as deployed (deployments/edge_guard.py)
    # no metrics port given: Ray's agent binds a free one and publishes it in the node table
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    start_serve(http_port)
    yield ray
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def http_base(ray_cluster, http_port) -> str:
    """Base URL of the session's Serve HTTP proxy (no trailing slash)."""
    return f"http://{HOST}:{http_port}"


@pytest.fixture(scope="session")
def metrics_url(ray_cluster) -> str:
    """Ray's Prometheus endpoint on this node, at the port its metrics agent bound."""
    (node,) = [n for n in ray_cluster.nodes() if n["Alive"]]
    port = node["MetricsExportPort"]
    assert port > 0, f"Ray published no metrics export port: {node}"
    return f"http://{node['NodeManagerAddress']}:{port}/metrics"


def fleet_app_args(demo_assets):
    """AppArgs of a test fleet: the demo adapters' folder and the temp dir allowed, hub org acme."""
    from deployments.config import AppArgs

    return AppArgs(**FLEET_ARGS, adapter_roots=[str(demo_assets.model_dir.parents[1]), tempfile.gettempdir()],
                   hub_orgs=["acme"])


def deploy_fleet(demo_assets, name: str, route_prefix: str | None):
    """The lorafleet app as app ``name``: 2 workers x 3 slots, the six demo adapters, its own directory."""
    from ray import serve

    from deployments.app import build_fleet

    app = build_fleet(fleet_app_args(demo_assets), {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}})
    return serve.run(app, name=name, route_prefix=route_prefix)


@pytest.fixture(scope="session")
def fleet(ray_cluster, demo_assets):
    """The shared lorafleet app on the session cluster, served over HTTP at ``http_base``.

    Tests on it must leave it as they found it; tests that kill or restart parts of a fleet
    deploy their own app (``deploy_fleet`` under another name).
    """
    return deploy_fleet(demo_assets, FLEET_APP, "/")


@pytest.fixture
def background_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An asyncio loop running on a thread of its own (what a router's or a replica's loop is to the code on it)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-background-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


@pytest.fixture(autouse=True, scope="module")
def free_cuda_memory_between_modules() -> Iterator[None]:
    """On CUDA, hand a module's engines' memory back before the next module's engines size their KV caches from
    the free memory (an engine that was not shut down is freed only by the cyclic GC). A no-op on the CPU."""
    yield
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        import gc

        gc.collect()
        sys.modules["torch"].cuda.empty_cache()

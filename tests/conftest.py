"""Shared fixtures: demo assets built once per session, one local Ray cluster, the markers.

Every test is marked ``ray`` (it uses the ``ray_cluster`` fixture, directly or through
``fleet``/``http_base``/...) or ``unit`` (everything else: no Ray cluster), so
``pytest -m unit`` runs without starting Ray and ``pytest -m ray`` runs the integration tests.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests' helper modules

from waiting import wait_until  # noqa: E402  (a helper module of tests/, found through the line above)

ADMIN_TOKEN = "test-admin-token"
HOST = "127.0.0.1"
FLEET_APP = "lorafleet"
FLEET_ARGS = dict(max_loras_per_batch=3, max_lora_rank=16, max_batch_size=4, max_tokens_limit=64,
                  max_model_len=256, host_cache_bytes=64 << 20)
CLUSTER_FIXTURE = "ray_cluster"
SERVE_START_DEADLINE_S = 300.0  # Serve waits 60 s for its HTTP proxy; a starved machine can need longer


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
    """A port for Serve's HTTP proxy, held by this process for the whole session.

    Ray 2.60's proxy binds whatever port it is given (0 included) but reports only the
    configured number, so the bound port of ``port=0`` cannot be learnt. Instead this
    socket takes a free port from the kernel with SO_REUSEPORT and keeps it bound (never
    listening): no other program can take the port, while the proxy, which binds with
    SO_REUSEPORT too (``SERVE_SOCKET_REUSE_PORT_ENABLED``), shares it and alone accepts.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, 0))
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
    os.environ["SERVE_SOCKET_REUSE_PORT_ENABLED"] = "1"  # the proxy shares http_port's reservation
    # no metrics port given: Ray's agent binds a free one and publishes it in the node table
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    start_serve(http_port)
    yield ray
    serve.shutdown()
    ray.shutdown()


def start_serve(http_port: int) -> None:
    """``serve.start``, given until our own deadline rather than Serve's 60 s for the HTTP proxy.

    When Serve's wait times out, its controller lives on and keeps starting the proxy: the next
    ``serve.start`` connects to that controller, and we then wait for the proxy to answer.
    """
    from ray import serve

    deadline = time.monotonic() + SERVE_START_DEADLINE_S
    while True:
        try:
            serve.start(http_options={"host": HOST, "port": http_port})
            break
        except TimeoutError as exc:
            if time.monotonic() >= deadline:
                raise
            warnings.warn(f"serve.start: {exc}; retrying until {SERVE_START_DEADLINE_S:g} s have passed")
    wait_until(lambda: proxy_answers(http_port), max(1.0, deadline - time.monotonic()), "Serve's HTTP proxy to answer",
               interval_s=0.5)


def proxy_answers(http_port: int) -> bool:
    """Whether Serve's proxy answers HTTP at all (with no app deployed yet it answers 503)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/-/routes", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:  # refused, reset or timed out: not up yet
        return False


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


@pytest.fixture(autouse=True, scope="module")
def free_cuda_memory_between_modules() -> Iterator[None]:
    """On CUDA, hand a module's engines' memory back before the next module's engines size their KV caches from
    the free memory (an engine that was not shut down is freed only by the cyclic GC). A no-op on the CPU."""
    yield
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        import gc

        gc.collect()
        sys.modules["torch"].cuda.empty_cache()

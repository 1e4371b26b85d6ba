"""Shared fixtures: demo assets built once per session, in a temp folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests' helper modules


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lorafleet-demo")
    os.environ["LORAFLEET_DEMO_DIR"] = str(root)  # Ray workers started later inherit it
    return root


@pytest.fixture(scope="session")
def demo_assets(demo_root):
    from engine.demo import ensure_demo_assets

    return ensure_demo_assets(demo_root, num_adapters=6)


ADMIN_TOKEN = "test-admin-token"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


METRICS_PORT = _free_port()  # Ray's Prometheus endpoint for this session


@pytest.fixture(scope="session")
def ray_cluster(demo_root):
    """One local Ray cluster for the whole session (env set first, so every worker inherits it)."""
    import ray
    from ray import serve

    os.environ["LORAFLEET_ADMIN_TOKEN"] = ADMIN_TOKEN
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS_PORT,
             _system_config={"metrics_report_interval_ms": 1000})
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    yield ray
    serve.shutdown()
    ray.shutdown()


FLEET_ARGS = dict(max_loras_per_batch=3, max_lora_rank=16, max_batch_size=4, max_tokens_limit=64,
                  max_model_len=256, host_cache_bytes=64 << 20)


@pytest.fixture(scope="session")
def fleet(ray_cluster, demo_assets):
    """The lorafleet app on the session cluster: 2 workers x 3 slots, the six demo adapters."""
    from ray import serve

    from deployments.app import build_fleet
    from deployments.config import AppArgs

    import tempfile

    args = AppArgs(**FLEET_ARGS, adapter_roots=[str(demo_assets.model_dir.parents[1]), tempfile.gettempdir()],
                   hub_orgs=["acme"])
    handle = serve.run(build_fleet(args, {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}}),
                       name="lorafleet", route_prefix="/")
    return handle

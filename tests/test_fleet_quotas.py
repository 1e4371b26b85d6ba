"""Exact fleet-wide quotas on a live fleet with three ingress replicas, through real HTTP.

``max_concurrency: 1`` serves sequential requests with no refusal whichever ingress replica each
lands on, refuses exactly the excess of concurrent ones, and a killed ingress replica's lease comes
back within Serve's health-check period. The app (``quotas`` at ``/quotas``) is this module's own:
a test here kills an ingress replica.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ADMIN_TOKEN, FLEET_ARGS
from fleet_helpers import delete_app, deploy_app, ingress_stats
from waiting import wait_until

APP = "quotas"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
INGRESS_REPLICAS = 3
CONCURRENT = 8


@pytest.fixture(scope="module")
def quota_fleet(ray_cluster, http_base, demo_assets):
    from ray import serve

    from deployments.config import AppArgs

    args = AppArgs(**{**FLEET_ARGS, "max_tokens_limit": 1000, "max_model_len": 1024},
                   adapters=[{"name": "quota-a", "source": "demo:demo-0"}])
    handle = deploy_app(APP, args, workers=1, ingresses=INGRESS_REPLICAS)
    base = f"{http_base}/{APP}"
    reply = httpx.put(f"{base}/v1/adapters/quota-a/quota", json={"max_concurrency": 1}, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    directory = serve.get_deployment_handle("AdapterDirectory", app_name=APP)
    version = directory.get_registry.remote(-1, 0.0).result(timeout_s=30)["version"]
    seen = lambda: all(s["registry_version"] >= version for s in ingress_stats(handle, INGRESS_REPLICAS).values())
    wait_until(seen, 120, "every ingress replica to see the quota")
    yield {"base": base, "handle": handle, "leases": serve.get_deployment_handle("QuotaLeases", app_name=APP)}
    delete_app(APP)


def complete(base: str, prompt: str, max_tokens: int) -> httpx.Response:
    """A completion of exactly ``max_tokens`` (EOS ignored, so a long one really is long)."""
    return httpx.post(f"{base}/v1/completions", timeout=120,
                      json={"model": "quota-a", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})


def test_sequential_requests_are_never_refused(quota_fleet):
    base = quota_fleet["base"]
    codes = Counter(complete(base, f"s{i}", 2).status_code for i in range(50))
    assert codes == {200: 50}, codes
    stats = ingress_stats(quota_fleet["handle"], INGRESS_REPLICAS)
    served_by = {pid for pid, s in stats.items() if s["quota_round_trips"]}
    assert len(served_by) >= 2, "the proxy sent every request to one ingress replica: nothing was tested"


def test_exactly_the_excess_of_concurrent_requests_is_refused(quota_fleet):
    base = quota_fleet["base"]
    start = threading.Barrier(CONCURRENT)

    def long_request(i: int) -> int:
        start.wait(timeout=60)
        return complete(base, f"c{i}", 384).status_code

    with ThreadPoolExecutor(CONCURRENT) as pool:
        codes = Counter(pool.map(long_request, range(CONCURRENT)))
    assert codes == {200: 1, 429: CONCURRENT - 1}, codes


def test_a_killed_ingress_replicas_lease_comes_back(quota_fleet):
    from ray.serve._private.constants import DEFAULT_HEALTH_CHECK_PERIOD_S

    base, handle, leases = quota_fleet["base"], quota_fleet["handle"], quota_fleet["leases"]
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120,
                      json={"model": "quota-a", "prompt": "held", "max_tokens": 1000, "stream": True,
                            "ignore_eos": True}) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()   # kept: a dropped iterator closes the connection (the request is cancelled)
        next(lines)                                                 # admitted: its lease is held
        refused = complete(base, "refused while held", 2)
        assert refused.status_code == 429, (refused.text, leases.stats.remote().result(timeout_s=30))
        stats = ingress_stats(handle, INGRESS_REPLICAS)
        (victim,) = [pid for pid, s in stats.items() if s["quota_inflight"].get("quota-a")]
        os.kill(victim, signal.SIGKILL)

    def reclaimed():
        stats = leases.stats.remote().result(timeout_s=30)
        return stats["reclaimed"] if stats["held"].get("quota-a", 0) == 0 else None

    (event,) = wait_until(reclaimed, 120, "the killed replica's lease to come back")
    assert event["leases"] == 1 and event["silent_for_s"] <= DEFAULT_HEALTH_CHECK_PERIOD_S, event
    assert complete(base, "after", 2).status_code == 200

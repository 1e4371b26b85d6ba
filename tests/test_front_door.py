"""One front door on a live fleet: exact quotas over two ingress replicas, and handle calls
admitted exactly like HTTP ones (prompt limit, in-flight bound, quotas) through a real
DeploymentHandle.

The app here (``guarded`` at ``/guarded``) has two ingress replicas, one worker, a small
in-flight bound and prompt limit, and long generations allowed (so requests overlap).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import ADMIN_TOKEN, FLEET_ARGS
from fleet_helpers import delete_app, deploy_app, ingress_stats
from waiting import wait_until

APP = "guarded"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_PROMPT_CHARS = 200
INGRESS_INFLIGHT = 2


@pytest.fixture(scope="module")
def guarded(ray_cluster, http_base, demo_assets):
    from deployments.config import AppArgs

    args = AppArgs(**{**FLEET_ARGS, "max_tokens_limit": 512, "max_model_len": 1024},
                   adapters=[{"name": "quota-a", "source": "demo:demo-0"}, {"name": "open-b", "source": "demo:demo-1"}],
                   max_prompt_chars=MAX_PROMPT_CHARS, max_queued_requests=INGRESS_INFLIGHT)
    handle = deploy_app(APP, args, workers=1, ingresses=2)
    yield {"base": f"{http_base}/{APP}", "handle": handle}
    delete_app(APP)


def outcome(call) -> str:
    try:
        call()
        return "ok"
    except Exception as exc:  # the typed error the handle raises (Ray's wrapper is an instance of it)
        return f"{getattr(exc, 'status', '?')}:{getattr(exc, 'code', type(exc).__name__)}"


def test_max_concurrency_is_exact_over_two_ingress_replicas(guarded):
    base, handle = guarded["base"], guarded["handle"]
    reply = httpx.put(f"{base}/v1/adapters/quota-a/quota", json={"max_concurrency": 1}, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    directory = __import__("ray").serve.get_deployment_handle("AdapterDirectory", app_name=APP)
    version = directory.get_registry.remote(-1, 0.0).result(timeout_s=30)["version"]
    wait_until(lambda: all(s["registry_version"] >= version for s in ingress_stats(handle, 2).values()), 60,
               "both ingress replicas to see the quota")

    def long_request(i: int) -> httpx.Response:
        return httpx.post(f"{base}/v1/completions", timeout=120,
                          json={"model": "quota-a", "prompt": f"q{i}", "max_tokens": 256, "temperature": 0})

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(long_request, range(8)))
    codes = Counter(r.status_code for r in replies)
    assert codes[200] >= 1 and set(codes) <= {200, 429}, codes
    stats = ingress_stats(handle, 2)
    peaks = [s["quota_peak_inflight"].get("quota-a", 0) for s in stats.values()]
    assert sum(peaks) <= 1, peaks          # each replica's most-at-once, summed: the fleet never held 2


def test_handle_calls_get_the_http_limits(guarded):
    from engine.errors import InvalidRequestError
    from engine.request import GenerateRequest

    handle = guarded["handle"]
    too_long = GenerateRequest(adapter="open-b", prompt="x" * (MAX_PROMPT_CHARS + 1), max_tokens=4)
    with pytest.raises(InvalidRequestError, match="exceeds the limit"):
        handle.generate.remote(too_long).result(timeout_s=60)
    stream = handle.options(stream=True).generate_stream.remote(too_long)
    with pytest.raises(InvalidRequestError, match="exceeds the limit"):
        list(stream)
    ok = handle.generate.remote(GenerateRequest(adapter="open-b", prompt="fits", max_tokens=4)).result(timeout_s=60)
    assert ok.usage["completion_tokens"] >= 1

    def long_call(i: int) -> str:   # 12 at once over 2 replicas x 2 places: the rest are refused at the door
        request = GenerateRequest(adapter="open-b", prompt=f"h{i}", max_tokens=256)
        return outcome(lambda: handle.generate.remote(request).result(timeout_s=120))

    with ThreadPoolExecutor(12) as pool:
        outcomes = Counter(pool.map(long_call, range(12)))
    assert outcomes["ok"] >= 1 and outcomes["429:overloaded"] >= 1 and set(outcomes) <= {"ok", "429:overloaded"}, \
        outcomes
    stream = handle.options(stream=True).generate_stream.remote(GenerateRequest(adapter="open-b", prompt="s",
                                                                                max_tokens=4))
    items = list(stream)
    assert items[-1].usage["completion_tokens"] >= 1
    assert all(s["inflight"] == 0 for s in ingress_stats(handle, 2).values())   # every place was given back


def test_a_chat_completion_looks_its_adapter_up_once(guarded):
    """Through the real app (HTTP, proxy, two ingress replicas, router, worker, engine): the gate looks the name
    up once per request; the worker and its engine look up nothing, since the request carries its uid."""
    from ray import serve

    base, handle = guarded["base"], guarded["handle"]
    worker = serve.get_deployment_handle("LoRAWorker", app_name=APP)

    def chat(i: int) -> httpx.Response:
        return httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "open-b", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 2})

    assert chat(-1).status_code == 200   # loads the adapter on the worker: a uid look-up, once per replica

    def counts() -> tuple[int, int, int]:
        pool = worker.pool_state.remote().result(timeout_s=30)
        return (sum(s["registry_lookups"] for s in ingress_stats(handle, 2).values()), pool["registry_lookups"],
                pool["engine"]["name_lookups"])

    before = counts()
    requests = 6
    assert all(chat(i).status_code == 200 for i in range(requests))
    after = counts()
    assert [a - b for a, b in zip(after, before)] == [requests, 0, 0], (before, after)


def test_a_uid_replaced_by_a_reregistration_is_refused_not_served_other_weights(guarded):
    """A request resolved before its name was registered again reaches the worker with the old uid: the worker
    refuses it (410), although the name now serves other weights there."""
    from ray import serve

    from engine.errors import AdapterUnregisteredError
    from engine.request import AdapterRef, GenerateRequest

    handle = guarded["handle"]
    worker = serve.get_deployment_handle("LoRAWorker", app_name=APP)

    def ask(**fields) -> GenerateRequest:
        return GenerateRequest(adapter="swap", prompt="who serves me", max_tokens=2, **fields)

    first = handle.register_adapter.remote("swap", "demo:demo-2").result(timeout_s=60)
    assert handle.generate.remote(ask()).result(timeout_s=60).adapter == "swap"   # the worker holds the first uid
    handle.unregister_adapter.remote("swap").result(timeout_s=60)
    second = handle.register_adapter.remote("swap", "demo:demo-3").result(timeout_s=60)
    try:
        assert second["uid"] != first["uid"]
        assert handle.generate.remote(ask()).result(timeout_s=60).completion_tokens >= 1  # the second uid, loaded
        with pytest.raises(AdapterUnregisteredError, match=first["uid"]):
            worker.generate.remote(ask(resolved=AdapterRef("swap", first["uid"]))).result(timeout_s=60)
    finally:
        handle.unregister_adapter.remote("swap").result(timeout_s=60)

"""The edge guard in Serve's HTTP proxy: what the ingress stated it would refuse is refused before any handle call.

A live app of its own (``edge`` at ``/edge``, one ingress replica) with a resolver root that holds
nothing, a slow lookup rate (one every 2 s: its 429 windows are long) and a short negative TTL,
behind the session cluster's proxy, which runs the edge guard (conftest.py sets Serve's proxy
callback). Whether a request reached the ingress is read from the ingress itself: its model guard
is asked about every completion it receives (``guard_asked``), so one the proxy answered leaves
that count where it was.
"""

from __future__ import annotations

import itertools

import httpx
import pytest

from conftest import FLEET_ARGS
from deployments.edge_hints import EDGE_MARK, HINT_HEADER
from fleet_helpers import delete_app
from waiting import wait_until

APP = "edge"
NEGATIVE_TTL_S = 4.0
LOOKUPS_PER_S = 0.5
HINT = HINT_HEADER.decode()


@pytest.fixture(scope="module")
def edge_fleet(ray_cluster, http_base, demo_assets, tmp_path_factory):
    from ray import serve

    from deployments.app import build_fleet
    from deployments.config import AppArgs

    root = tmp_path_factory.mktemp("edge-resolve")
    args = AppArgs(**FLEET_ARGS, adapters=[{"name": "known", "source": "demo:demo-0"}],
                   adapter_roots=[str(demo_assets.model_dir.parents[1]), str(root)], adapter_resolvers=[str(root)],
                   adapter_resolver_negative_ttl_s=NEGATIVE_TTL_S, adapter_resolver_lookups_per_s=LOOKUPS_PER_S)
    serve.run(build_fleet(args, {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}), name=APP,
              route_prefix=f"/{APP}")
    ingress = serve.get_app_handle(APP)
    with httpx.Client(base_url=f"{http_base}/{APP}", timeout=120) as client:
        yield {"client": client, "stats": lambda: ingress.admission_stats.remote().result(timeout_s=30)}
    delete_app(APP)


def complete(fleet, model: str, headers: dict | None = None) -> httpx.Response:
    return fleet["client"].post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
                                headers=headers)


def answered_by_proxy(fleet, model: str) -> tuple[bool, httpx.Response]:
    """Send one completion for ``model``; whether it never reached the ingress, and the response."""
    before = fleet["stats"]()["guard_asked"]
    reply = complete(fleet, model)
    return fleet["stats"]()["guard_asked"] == before, reply


def test_a_name_the_negative_cache_holds_is_answered_by_the_proxy_with_the_ingress_bytes_until_it_expires(edge_fleet):
    lookups = edge_fleet["stats"]()["resolver_lookups"]
    first = complete(edge_fleet, "edge-missing", headers={EDGE_MARK.decode(): "1"})   # a client's own mark changes nothing
    assert first.status_code == 404 and "edge-missing" in first.json()["error"]["message"], first.text
    assert edge_fleet["stats"]()["resolver_lookups"] == lookups + 1 and HINT not in first.headers
    replies = []

    def proxy_answers() -> bool:
        by_proxy, reply = answered_by_proxy(edge_fleet, "edge-missing")
        replies.append(reply)
        return by_proxy

    wait_until(proxy_answers, 60, "the proxy to answer a name the ingress's negative cache holds")
    assert {(r.status_code, r.headers["content-type"], r.text) for r in replies} == \
        {(404, first.headers["content-type"], first.text)}
    assert all(HINT not in r.headers and r.headers.get("x-request-id") for r in replies)

    def looked_up_again() -> bool:
        complete(edge_fleet, "edge-missing")
        return edge_fleet["stats"]()["resolver_lookups"] > lookups + 1

    wait_until(looked_up_again, NEGATIVE_TTL_S * 10, "the name to be looked up again once the negative cache let it go")


def test_the_lookup_rates_429_is_repeated_by_the_proxy_for_unknown_names_only(edge_fleet):
    names = (f"edge-unknown-{i}" for i in itertools.count())
    refusals: list[httpx.Response] = []

    def proxy_refuses() -> bool:
        by_proxy, reply = answered_by_proxy(edge_fleet, next(names))
        if reply.status_code == 429:
            refusals.append(reply)
        return by_proxy and reply.status_code == 429

    wait_until(proxy_refuses, 60, "the proxy to repeat the ingress's 429 while its lookup rate refuses")
    assert len({(r.status_code, r.headers["retry-after"], r.text) for r in refusals}) == 1
    assert refusals[0].json()["error"]["code"] == "resolver_busy" and all(HINT not in r.headers for r in refusals)
    for _ in range(5):   # a registered name and the base model are served even while the proxy refuses the rest
        sandwich = [answered_by_proxy(edge_fleet, next(names)), answered_by_proxy(edge_fleet, "known"),
                    answered_by_proxy(edge_fleet, "demo"), answered_by_proxy(edge_fleet, next(names))]
        if sandwich[0][0] and sandwich[3][0]:
            break
    else:
        pytest.fail("the proxy's 429 window never lasted over four requests")
    assert [r.status_code for _, r in sandwich] == [429, 200, 200, 429]   # (only the ingress's workers answer 200)

"""The ingress's model guard: bogus names refused from cached state before the app parses anything.

A real ``AdapterGate`` (its registry copy, resolver, negative cache and lookup limiter) answers
the guard; the app behind the guard records what reached it, so each test can tell whether the
guard answered or handed the request on, and with which body. The same answers through the
whole live app (proxy, route prefix, FastAPI path for comparison) are in test_fleet_sources.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from pydantic import BaseModel

from deployments.adapter_gate import AdapterGate
from deployments.config import NAME_RE, AdapterSpec, AppArgs
from deployments.edge_hints import EDGE_MARK, HINT_HEADER, PROBE_TOKEN_WAIT_S, refusal_hint
from deployments.http_errors import error_response
from deployments.model_guard import ModelGuard
from deployments.quotas import AdapterQuotas, HandleCalls
from deployments.registry import RegistryEntry, RegistryFollower
from deployments.resolvers import AdapterResolver, LookupLimiter
from deployments.versions import VersionedFleetAdmin
from pool.errors import AdapterNotFoundError

PREFIX = "/fleet"
MARKED = {EDGE_MARK.decode(): "1"}   # as the edge guard in Serve's proxy marks what it hands on


class CompletionBody(BaseModel):
    """The body a route below the guard validates (module level: annotations are strings here)."""

    model: str
    prompt: str


class RecordingApp:
    """The app behind the guard: answers 200 and keeps each body it was handed, read through ``receive``."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"app"})


@pytest.fixture
def fleet(tmp_path):
    """A gate over a registry copy holding ``known``, with a resolver whose one root holds nothing."""
    args = AppArgs()
    registry = RegistryFollower(directory=None)
    registry.entries = {"known": RegistryEntry(name="known", uid="known@1", source="s", created=1.0)}
    admin = VersionedFleetAdmin(None, None, registry, args)

    async def register(spec: AdapterSpec) -> dict:
        raise AdapterNotFoundError(f"no {spec.name}")

    limiter = LookupLimiter(5.0, 4, placement=lambda: (1, 0))
    resolver = AdapterResolver([str(tmp_path)], register, limiter=limiter)
    gate = AdapterGate(admin, AdapterQuotas(HandleCalls(None), metrics=False), resolver)
    app = RecordingApp()
    base_names = {"demo", "base", ""}
    guard = ModelGuard(app, lambda model: None if model in base_names else gate.refusal_now(model),
                       hint=lambda model, status, waited_s: refusal_hint(gate, NAME_RE, "test-app", base_names, model,
                                                                         status, waited_s),
                       wait=lambda model: 0.0 if model in base_names else gate.rate_refusal_ends_in_s(model))
    return {"gate": gate, "admin": admin, "resolver": resolver, "limiter": limiter, "app": app, "guard": guard}


def post(fleet, model: object, path: str = f"{PREFIX}/v1/completions", **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=fleet["guard"], root_path=PREFIX)

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            if "content" in kw:
                return await client.post(path, **kw)
            return await client.post(path, json={"model": model, "prompt": "hi", "max_tokens": 1},
                                     headers=kw.get("headers"))

    return asyncio.run(send())


def no_refresh_due(admin) -> None:
    """As right after a miss refreshed the registry copy: misses are answered from the copy until the next."""
    admin._refreshed_at = time.monotonic()


def expected(error: BaseException) -> tuple[int, dict]:
    response = error_response(error)
    return response.status_code, json.loads(response.body)


def test_a_name_the_negative_cache_holds_gets_the_resolvers_own_404(fleet):
    with pytest.raises(AdapterNotFoundError) as normal:
        asyncio.run(fleet["resolver"].resolve("bogus-1"))   # the normal path's lookup, remembered as a miss
    no_refresh_due(fleet["admin"])
    reply = post(fleet, "bogus-1")
    assert (reply.status_code, reply.json()) == expected(normal.value)
    assert reply.status_code == 404 and fleet["app"].bodies == [] and fleet["gate"].early_refusals == 1


def test_known_names_the_base_model_and_names_never_looked_up_reach_the_app_with_their_body(fleet):
    no_refresh_due(fleet["admin"])
    for model in ("known", "demo", "never-seen"):
        assert post(fleet, model).status_code == 200
    assert [json.loads(b)["model"] for b in fleet["app"].bodies] == ["known", "demo", "never-seen"]
    assert fleet["gate"].early_refusals == 0


def test_while_a_registry_refresh_is_due_a_miss_goes_the_normal_way(fleet):
    with pytest.raises(AdapterNotFoundError):
        asyncio.run(fleet["resolver"].resolve("bogus-2"))
    assert fleet["admin"].refresh_due()    # the normal path would refresh first: the name may be registered now
    assert post(fleet, "bogus-2").status_code == 200 and len(fleet["app"].bodies) == 1


def test_a_name_no_registration_can_have_is_refused_at_once(fleet):
    reply = post(fleet, "not a name!")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    assert fleet["app"].bodies == []


def test_a_lookup_the_rate_would_refuse_gets_its_429_without_spending_a_token(fleet):
    limiter = fleet["limiter"]
    limiter.take()   # the burst of one is spent: the next lookup would wait for the rate
    limiter.done()
    no_refresh_due(fleet["admin"])
    reply = post(fleet, "bogus-3")
    assert (reply.status_code, reply.json()) == expected(limiter.busy())
    assert reply.headers["retry-after"] == "1" and limiter.refused == 1 and limiter.running == 0
    assert fleet["app"].bodies == []


def test_a_marked_404_says_how_long_the_negative_cache_holds_the_name_and_an_unmarked_one_says_nothing(fleet):
    with pytest.raises(AdapterNotFoundError):
        asyncio.run(fleet["resolver"].resolve("bogus-4"))
    held = fleet["resolver"].miss_remaining_s("bogus-4")
    no_refresh_due(fleet["admin"])
    plain, marked = post(fleet, "bogus-4"), post(fleet, "bogus-4", headers=MARKED)
    assert plain.status_code == marked.status_code == 404 and plain.json() == marked.json()
    assert HINT_HEADER.decode() not in plain.headers
    hint = json.loads(marked.headers[HINT_HEADER.decode()])
    assert hint["app"] == "test-app" and hint["known"] == ["", "base", "demo"]
    assert 0 < hint["name_for_s"] <= held + 1.0
    assert 0 < hint["unknown_for_s"] <= 1 / fleet["limiter"].lookups_per_s + 1.0   # its lookup took the rate's token
    assert fleet["resolver"].misses["bogus-4"][0] > time.monotonic() + hint["name_for_s"] - 1.0


def test_a_marked_429_of_the_lookup_rate_states_until_when_it_refuses_every_unknown_name(fleet):
    limiter = fleet["limiter"]
    limiter.take()
    limiter.done()
    no_refresh_due(fleet["admin"])
    reply = post(fleet, "bogus-5", headers=MARKED)
    assert reply.status_code == 429
    hint = json.loads(reply.headers[HINT_HEADER.decode()])
    assert 0 < hint["unknown_for_s"] <= 1 / limiter.lookups_per_s + 1.0 and (hint["rank"], hint["replicas"]) == (0, 1)
    assert "name_for_s" not in hint   # a 429 says nothing of the name itself


def test_a_marked_request_whose_lookup_token_is_due_within_the_probe_wait_waits_for_it_and_goes_on(fleet):
    limiter = fleet["limiter"]
    limiter.lookups_per_s = 1 / (PROBE_TOKEN_WAIT_S * 0.6)   # the next token is due within the wait
    limiter.take()
    limiter.done()
    no_refresh_due(fleet["admin"])
    reply = post(fleet, "bogus-6", headers=MARKED)   # (unmarked, it would be a 429: the test above)
    assert reply.status_code == 200 and [json.loads(b)["model"] for b in fleet["app"].bodies] == ["bogus-6"]
    assert limiter.refused == 0 and fleet["gate"].early_refusals == 0   # it was never refused


def test_a_request_the_concurrency_limit_refuses_too_gets_its_429_without_waiting(fleet):
    limiter = fleet["limiter"]
    limiter.lookups_per_s = 1 / (PROBE_TOKEN_WAIT_S * 0.6)
    limiter.take()
    limiter.running = limiter.max_concurrent   # every lookup place is taken: no time can be stated
    no_refresh_due(fleet["admin"])
    assert fleet["gate"].rate_refusal_ends_in_s("bogus-7") == 0.0
    assert post(fleet, "bogus-7", headers=MARKED).status_code == 429 and fleet["app"].bodies == []


def test_known_names_and_names_the_ingress_holds_nothing_about_get_no_hint(fleet):
    no_refresh_due(fleet["admin"])
    for model in ("known", "demo", "never-seen"):
        reply = post(fleet, model, headers=MARKED)
        assert reply.status_code == 200 and HINT_HEADER.decode() not in reply.headers
    assert refusal_hint(fleet["gate"], NAME_RE, "a", {"demo"}, "known", 404) is None   # a registered name's 404
    assert refusal_hint(fleet["gate"], NAME_RE, "a", {"demo"}, "never-seen", 404) is None   # not cached, rate open


def test_the_route_is_matched_below_the_route_prefix(fleet):
    no_refresh_due(fleet["admin"])
    assert post(fleet, "not a name!", path=f"{PREFIX}/v1/chat/completions").status_code == 404
    assert post(fleet, "not a name!", path=f"{PREFIX}/v1/models").status_code == 200     # not a guarded route
    assert post(fleet, "not a name!", path=f"{PREFIX}-other/v1/completions").status_code == 200   # another prefix
    assert post(fleet, "not a name!", path="/v1/completions").status_code == 404   # a server that stripped it
    assert len(fleet["app"].bodies) == 2


def test_bodies_it_cannot_read_cheaply_go_to_the_app_untouched(fleet):
    big = json.dumps({"model": "not a name!", "prompt": "x" * (fleet["guard"].max_body + 1)}).encode()

    async def chunks():   # no Content-Length: sent chunked
        yield b'{"model": "not a name!",'
        yield b' "prompt": "x"}'

    for content in (big, chunks(), b"not json", b'{"model": 7}'):
        assert post(fleet, None, content=content, headers={"content-type": "application/json"}).status_code == 200
    assert fleet["app"].bodies[0] == big and fleet["app"].bodies[1] == b'{"model": "not a name!", "prompt": "x"}'
    assert fleet["app"].bodies[2:] == [b"not json", b'{"model": 7}']


def test_an_ordinary_body_is_decoded_once_and_fastapi_validates_the_guards_parse(monkeypatch):
    """The guard's parse reaches FastAPI through the scope (``ParsedOnceRoute``): one ``json.loads`` per ordinary
    request instead of two; a body the guard could not parse is still FastAPI's to parse and report."""
    from fastapi import APIRouter, FastAPI

    from deployments.body_limit import BodyLimitMiddleware
    from deployments.model_guard import ParsedOnceRoute

    router = APIRouter(route_class=ParsedOnceRoute)

    @router.post("/v1/completions")
    async def completions(body: CompletionBody):
        return {"model": body.model, "prompt": body.prompt}

    app = FastAPI()
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=1 << 20)
    app.add_middleware(ModelGuard, refusal=lambda model: None)   # outermost, as in deployments/http_app.py
    app.include_router(router)
    decoded: list[bytes] = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **kw: decoded.append(s) or loads(s, *a, **kw))

    async def send(**kw) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
            return await client.post("/v1/completions", headers={"content-type": "application/json"}, **kw)

    ok = asyncio.run(send(content=b'{"model": "demo", "prompt": "hi"}'))
    assert decoded == [b'{"model": "demo", "prompt": "hi"}']   # (read before the client decodes the reply)
    assert ok.status_code == 200 and ok.json() == {"model": "demo", "prompt": "hi"}
    bad = asyncio.run(send(content=b'{"model": "demo",'))
    assert bad.status_code == 422 and bad.json()["detail"][0]["type"] == "json_invalid"

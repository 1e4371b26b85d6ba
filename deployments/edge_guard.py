"""Refuse a known-bogus model name in Serve's HTTP proxy, before any handle call to the ingress.

Why: under a flood of unique bogus names (benchmarks/abuse.py) each refusal still cost Serve's proxy
about 4 ms of CPU and the ingress replica about 3 ms, nearly all of it Serve's per-request plumbing
(the handle call, the router, the replica's call back into the proxy for the body, metrics), not the
app's model guard (about 4 % of the ingress's samples, py-spy). On a small machine that CPU came out
of the ordinary requests' latency. Only a refusal before the proxy's handle call saves it.

The proxy has no copy of the app's state, so it repeats only what the ingress told it would hold
(edge_hints.py): a name's 404 while the resolvers' negative cache holds it, and the 429 of a lookup
rate that refuses every unknown name for a stated time, once every ingress replica said so. The
response is the ingress's own (status, headers, body), stored when it passed through, with a fresh
``X-Request-ID``. A name the app's registry holds, or a base model name, is never refused here: the
guard follows the app's registry (the directory's long poll, as the ingress does) while it holds
hints for the app, and refuses nothing until that copy is loaded. Everything else goes on, marked
(``EDGE_MARK``) so its refusal comes back hinted; the hint header is stripped before the client.

Installed through Ray Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (``PROXY_CALLBACK_ENV``),
read by the proxy process when it starts: set it where Ray starts (the head's and workers'
environment), as ``serve_config.yaml``'s users set any Ray environment variable. Its settings
(``EdgeSettings``) come from ``LORAFLEET_EDGE_SETTINGS`` (JSON), defaults otherwise. No torch: the
proxy must not import the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, Field
from starlette.middleware import Middleware

from .asgi_body import GUARDED_PATHS, declared_length, model_of, parse_json, read_body, replay
from .edge_hints import EDGE_MARK, HINT_HEADER

log = logging.getLogger("ray.serve")
PROXY_CALLBACK_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.edge_guard:proxy_middlewares"}
EDGE_SETTINGS_ENV = "LORAFLEET_EDGE_SETTINGS"
DIRECTORY_DEPLOYMENT = "AdapterDirectory"   # deployments/directory_actor.py's deployment name (not imported: torch)
DROPPED_HEADERS = (HINT_HEADER, b"x-request-id")
GUARDED_SUFFIXES = tuple(GUARDED_PATHS)   # the ingress's completion routes, below any route prefix


class EdgeSettings(BaseModel):
    """The edge guard's tunables (``LORAFLEET_EDGE_SETTINGS``, JSON; an unknown key is an error)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=64 << 10, ge=0)
    """bytes: a completion body larger than this (or chunked) goes on unread, as the ingress's model guard does"""
    max_misses: int = Field(default=4096, ge=0)
    """names per route whose 404 the proxy repeats (least recently used dropped first)"""
    max_routes: int = Field(default=64, ge=1)
    """paths (an app's completion routes) the proxy holds hints for"""
    registry_poll_timeout_s: float = Field(default=2.0, gt=0)
    """seconds: the proxy's long poll on an app's directory; a deleted app's directory may wait this long for it"""
    probe_wait_s: float = Field(default=0.5, ge=0)
    """seconds an unknown name waits for the answer to the unknown name handed on before it, then goes on anyway"""
    follow_idle_s: float = Field(default=60.0, gt=0)
    """seconds: the proxy stops following an app's registry (and refusing for it) this long after its last hint"""

    @classmethod
    def from_env(cls) -> "EdgeSettings":
        return cls(**json.loads(os.environ.get(EDGE_SETTINGS_ENV) or "{}"))


@dataclass(frozen=True)
class Stored:
    """A refusal as the ingress sent it: the response start (hint and request id removed) and the body."""

    start: dict
    body: bytes

    async def send(self, scope: dict, send) -> None:
        request_id = next((v for k, v in scope.get("headers") or () if k == b"x-request-id"), None)
        headers = [*self.start["headers"], (b"x-request-id", request_id or str(uuid.uuid4()).encode())]
        await send({**self.start, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class EdgeRoute:
    """What the proxy knows of one app's completion route: its registry's names, the misses and rate windows its
    ingress replicas stated, and the responses to repeat."""

    def __init__(self, app: str, settings: EdgeSettings, clock: Callable[[], float] = time.monotonic):
        self.app, self.settings, self.clock = app, settings, clock
        self.names: Optional[frozenset] = None     # the registry's requested names; None: not loaded (no refusal)
        self.base_names: frozenset = frozenset()
        self.misses: OrderedDict[str, tuple[float, Stored]] = OrderedDict()   # name -> (until, its 404)
        self.windows: dict[int, float] = {}        # ingress rank -> until when its lookup rate refuses
        self.replicas = 1
        self.busy: Optional[Stored] = None         # the ingress's 429 for an unknown name
        self.probe: Optional[asyncio.Future] = None   # done when the unknown name handed on last has its answer
        self.last_hint = clock()
        self.refused = 0
        self._follow: Optional[asyncio.Task] = None

    def refusal(self, model: str) -> Optional[Stored]:
        """The stored response to answer ``model`` with now, or None to hand the request on."""
        if self.names is None or model in self.names or model in self.base_names:
            return None
        now = self.clock()
        miss = self.misses.get(model)
        if miss is not None:
            if now < miss[0]:
                self.refused += 1
                return miss[1]
            del self.misses[model]
        if self.busy is not None and all(self.windows.get(rank, 0.0) > now for rank in range(self.replicas)):
            self.refused += 1
            return self.busy
        return None

    def unknown(self, model: str) -> bool:
        """Whether the ingress would have to look ``model`` up (after ``refusal`` said None): the registry copy is
        loaded and lacks it, it is no base name and no miss is held for it."""
        return (self.names is not None and model not in self.names and model not in self.base_names
                and model not in self.misses)

    async def behind_probe(self, model: str) -> tuple[Optional[Stored], Optional[asyncio.Future]]:
        """An unknown name goes on as the probe when none is out (returned, for ``probe_done``); else it waits for
        the probe's answer, which may open the rate's window, and is decided again: refused, or no longer unknown
        (it goes on), or the next probe. Waiting refuses nothing and lasts at most ``probe_wait_s`` in all, then
        the name goes on anyway: what the ingress would answer a name it took after the probe, the probe's hint
        says. Without the wait every unknown name sent while a window's 429 was on its way back reached the
        ingress; without the turns, every name that waited on a probe whose answer opened no window (a 429 that
        came early, its window already over when it was back) went on at once: one took the lookup's token and
        the others were 429s (benchmarks/abuse.py: 589 bogus requests reached the ingress, 194 of them so and 280
        of them 429s; with the turns 387, 78 of them 429s, each a Serve round trip of ~4 ms CPU in the proxy and as
        much in the ingress)."""
        deadline = self.clock() + self.settings.probe_wait_s
        while True:
            if self.probe is None:
                self.probe = asyncio.get_running_loop().create_future()
                return None, self.probe
            try:
                await asyncio.wait_for(asyncio.shield(self.probe), max(0.0, deadline - self.clock()))
            except asyncio.TimeoutError:
                return self.refusal(model), None
            stored = self.refusal(model)
            if stored is not None or not self.unknown(model):
                return stored, None

    def probe_done(self, probe: asyncio.Future) -> None:
        if not probe.done():
            probe.set_result(None)
        if self.probe is probe:
            self.probe = None

    def learn(self, hint: dict, model: str, sent_at: float, stored: Stored) -> None:
        """Take a hint the ingress sent with ``stored`` for ``model``. Its times count from ``sent_at``, when the
        proxy handed the request on: the ingress stated them later, so the proxy never holds one past it."""
        self.last_hint = self.clock()
        self.base_names = frozenset(hint.get("known", ()))
        status = stored.start["status"]
        if status == 404 and "name_for_s" in hint and self.settings.max_misses:
            self.misses[model] = (sent_at + float(hint["name_for_s"]), stored)
            self.misses.move_to_end(model)
            while len(self.misses) > self.settings.max_misses:
                self.misses.popitem(last=False)
        if status == 429 and "unknown_for_s" in hint:
            self.busy = stored
        if self.busy is not None and "unknown_for_s" in hint:   # (a 404's window needs a 429 to repeat)
            self.replicas = max(1, int(hint["replicas"]))
            self.windows = {r: t for r, t in self.windows.items() if r < self.replicas}
            self.windows[int(hint["rank"])] = sent_at + float(hint["unknown_for_s"])
        if self._follow is None:
            self._follow = asyncio.get_running_loop().create_task(self._follow_registry())

    async def _follow_registry(self) -> None:
        """The app's registry names, by the directory's long poll, until no hint came for ``follow_idle_s``."""
        from ray import serve

        version = -1
        try:
            directory = serve.get_deployment_handle(DIRECTORY_DEPLOYMENT, app_name=self.app)
            while self.clock() - self.last_hint < self.settings.follow_idle_s:
                reply = await directory.get_registry.remote(version, self.settings.registry_poll_timeout_s)
                if reply["version"] != version:
                    self.names = frozenset(e.get("version_of") or e["name"] for e in reply["entries"])
                    self.windows = {}   # a lookup that found its adapter wrote this, and gave its token back
                version = reply["version"]
        except Exception as exc:   # the app was deleted or its directory restarts: what it stated is gone with it
            log.warning("lorafleet edge guard: following %s's registry stopped (%r)", self.app, exc)
            self.misses.clear()
            self.windows, self.busy = {}, None
        finally:
            self.names, self._follow = None, None


class EdgeGuard:
    """Pure ASGI middleware around Serve's proxy (``proxy_middlewares``)."""

    def __init__(self, app, settings: Optional[EdgeSettings] = None):
        self.app, self.settings = app, settings or EdgeSettings()
        self.routes: OrderedDict[str, EdgeRoute] = OrderedDict()   # request path -> its app's route

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if any(key == EDGE_MARK for key, _ in scope.get("headers") or ()):   # only this guard marks a request
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != EDGE_MARK]}
        length = declared_length(scope)
        if (scope.get("method") != "POST" or not scope.get("path", "").endswith(GUARDED_SUFFIXES) or length is None
                or length > self.settings.max_body_bytes):   # (the app's route prefix is not known here)
            return await self.app(scope, receive, send)
        messages, body = await read_body(receive)
        model = model_of(parse_json(body)) if body is not None else None
        path = scope["path"]
        route = self.routes.get(path)
        stored = probe = None
        if route is not None and model is not None:
            stored = route.refusal(model)
            if stored is None and route.unknown(model):
                stored, probe = await route.behind_probe(model)
        if stored is not None:
            return await stored.send(scope, send)
        scope = {**scope, "headers": [*scope.get("headers", ()), (EDGE_MARK, b"1")]}
        if model is not None:
            send = self._learning(send, path, model, time.monotonic())
        try:
            await self.app(scope, replay(messages, receive), send)
        finally:
            if probe is not None:
                route.probe_done(probe)

    def _learning(self, send, path: str, model: str, sent_at: float):
        """``send`` that strips a hint from the response and, once its body is through, learns from it."""
        hint: Optional[dict] = None
        start: Optional[dict] = None
        chunks: list[bytes] = []

        async def send_learning(message: dict) -> None:
            nonlocal hint, start
            if message["type"] == "http.response.start":
                raw = next((v for k, v in message.get("headers") or () if k == HINT_HEADER), None)
                if raw is not None:
                    hint = json.loads(raw)
                    start = {**message, "headers": [(k, v) for k, v in message["headers"] if k not in DROPPED_HEADERS]}
                    message = {**message, "headers": [(k, v) for k, v in message["headers"] if k != HINT_HEADER]}
            elif message["type"] == "http.response.body" and hint is not None:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self._route(path, hint["app"]).learn(hint, model, sent_at, Stored(start, b"".join(chunks)))
                    hint = None
            await send(message)

        return send_learning

    def _route(self, path: str, app: str) -> EdgeRoute:
        route = self.routes.get(path)
        if route is None or route.app != app:   # first hint here, or another app took the route over
            route = self.routes[path] = EdgeRoute(app, self.settings)
            while len(self.routes) > self.settings.max_routes:
                self.routes.popitem(last=False)
        self.routes.move_to_end(path)
        return route


def proxy_middlewares() -> list[Middleware]:
    """Ray Serve's HTTP proxy callback (``PROXY_CALLBACK_ENV``): the edge guard, with the environment's settings."""
    return [Middleware(EdgeGuard, settings=EdgeSettings.from_env())]

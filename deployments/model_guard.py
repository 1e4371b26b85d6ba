"""Refuse a completion naming a model the ingress already knows it cannot serve, before any parsing.

A flood of bogus model names must not cost ordinary requests their latency. Through the full
app each refusal went through Starlette's routing, FastAPI's body parsing into the request
models, the exception handlers and a JSONResponse: milliseconds of ingress CPU per bogus
request. This pure-ASGI middleware, the app's outermost, reads the small JSON body itself,
asks ``AdapterGate.refusal_now`` (cached state only: no await, no lookup) and answers with the
very error the normal path would raise, rendered by the same ``error_response``: same status,
same body, same headers. Anything it cannot tell cheaply (another route, a chunked or large
body, a body that is not a JSON object, a known or not-yet-known name) goes on untouched,
with the body it read handed on unchanged.

A body the guard parsed and handed on is not parsed again: the parsed object travels in the
request's scope (``PARSED_BODY``) and the OpenAI routes (``ParsedOnceRoute``) hand it to FastAPI
as its ``request.json()``, so an ordinary request's body is decoded once at the ingress, not twice.
FastAPI still decides, from the content type, whether the body is JSON at all, and a body the
guard could not parse is parsed by FastAPI, which reports where it is invalid.

Paths are matched after the ASGI ``root_path`` (Serve's route prefix), so the guard works for
an app at ``/`` and under a prefix alike. A request that is invalid in other ways too and
names a bogus model gets the model's 404 here, where the full app would have named the
first invalid field (400): either answer is true of it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from fastapi import Request
from fastapi.routing import APIRoute

from .asgi_body import (GUARDED_PATHS, MAX_GUARDED_BODY, UNPARSED, declared_length, model_of, parse_json,
                        read_body, replay, route_path)
from .edge_hints import PROBE_TOKEN_WAIT_S, hinting, marked
from .http_errors import error_response

PARSED_BODY = "lorafleet.parsed_body"   # scope key: the JSON the guard decoded from the body it hands on
Refusal = Callable[[Optional[str]], Optional[BaseException]]
Hint = Callable[[str, int, float], Optional[bytes]]   # (model, status, waited s) -> the edge guard's hint
Wait = Callable[[str], float]   # model -> seconds until the refusal it would get now ends by itself (0: none such)


class ModelGuard:
    """``refusal(model)``: the error to answer with now, or None to let the app decide.
    ``hint(model, status, waited_s)``: what to tell the edge guard in Serve's proxy about a 404 or 429, on the
    requests it marked (edge_hints.py). ``wait(model)``: seconds until the refusal ``model`` would get now ends by
    itself (the lookup rate's token); a marked request whose refusal ends within ``PROBE_TOKEN_WAIT_S`` waits for
    that first, then is decided (edge_hints.py says why)."""

    def __init__(self, app, refusal: Refusal, max_body: int = MAX_GUARDED_BODY, hint: Optional[Hint] = None,
                 wait: Optional[Wait] = None):
        self.app, self.refusal, self.max_body, self.hint, self.wait = app, refusal, max_body, hint, wait

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or route_path(scope) not in GUARDED_PATHS:
            return await self.app(scope, receive, send)
        length = declared_length(scope)
        if length is None or length > self.max_body:   # chunked or large: the app (and its body limit) read it
            return await self.app(scope, receive, send)
        messages, body = await read_body(receive)
        parsed = parse_json(body) if body is not None else UNPARSED
        model = model_of(parsed)
        if model is not None and self.wait is not None and marked(scope):
            wait_s = self.wait(model)
            if 0 < wait_s <= PROBE_TOKEN_WAIT_S:
                await asyncio.sleep(wait_s + 0.001)   # (a token due at the very end of the sleep: float rounding)
        error = self.refusal(model) if model is not None else None
        if self.hint is not None and model is not None and marked(scope):
            hint = self.hint
            send = hinting(send, lambda status, waited_s: hint(model, status, waited_s))
        if error is not None:
            return await error_response(error)(scope, receive, send)
        if parsed is not UNPARSED:
            scope = {**scope, PARSED_BODY: parsed}   # a copy: the server's own scope is left as it was
        await self.app(scope, replay(messages, receive), send)


class ParsedOnceRequest(Request):
    """A request whose ``json()`` is the guard's parse of the same bytes, when the guard made one."""

    async def json(self) -> Any:
        if not hasattr(self, "_json") and PARSED_BODY in self.scope:
            self._json = self.scope[PARSED_BODY]
        return await super().json()


class ParsedOnceRoute(APIRoute):
    """FastAPI's documented custom-route hook: the endpoint reads its body through ``ParsedOnceRequest``."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def parsed_once(request: Request):
            return await handler(ParsedOnceRequest(request.scope, request.receive))

        return parsed_once

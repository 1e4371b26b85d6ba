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

import json
from typing import Any, Awaitable, Callable, Optional

from fastapi import Request
from fastapi.routing import APIRoute

from .http_errors import error_response

GUARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_GUARDED_BODY = 64 << 10   # bytes: bogus-name requests are small; larger bodies go to the app unread

PARSED_BODY = "lorafleet.parsed_body"   # scope key: the JSON the guard decoded from the body it hands on
Refusal = Callable[[Optional[str]], Optional[BaseException]]


def route_path(scope: dict) -> str:
    """The path below the app's root path, as Starlette routes it: Serve passes the full path and its route
    prefix as ``root_path``; a server that already stripped the prefix passes the path below it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


def declared_length(scope: dict) -> Optional[int]:
    for key, value in scope.get("headers") or ():
        if key == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class ModelGuard:
    """``refusal(model)``: the error to answer with now, or None to let the app decide."""

    def __init__(self, app, refusal: Refusal, max_body: int = MAX_GUARDED_BODY):
        self.app, self.refusal, self.max_body = app, refusal, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or route_path(scope) not in GUARDED_PATHS:
            return await self.app(scope, receive, send)
        length = declared_length(scope)
        if length is None or length > self.max_body:   # chunked or large: the app (and its body limit) read it
            return await self.app(scope, receive, send)
        messages, body = await read_body(receive)
        parsed = parse_json(body) if body is not None else _UNPARSED
        model = model_of(parsed)
        error = self.refusal(model) if model is not None else None
        if error is not None:
            return await error_response(error)(scope, receive, send)
        if parsed is not _UNPARSED:
            scope = {**scope, PARSED_BODY: parsed}   # a copy: the server's own scope is left as it was
        await self.app(scope, replay(messages, receive), send)


async def read_body(receive) -> tuple[list[dict], Optional[bytes]]:
    """The request's messages as received, and its body (None when the client left before sending it all)."""
    messages: list[dict] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        if not message.get("more_body", False):
            break
    return messages, b"".join(m.get("body", b"") for m in messages)


_UNPARSED = object()   # no body, or one that is not JSON: FastAPI parses (and reports) it itself


def parse_json(body: bytes) -> Any:
    """``body`` decoded as FastAPI's ``request.json()`` would (``json.loads``), or ``_UNPARSED``."""
    try:
        return json.loads(body)
    except ValueError:
        return _UNPARSED


def model_of(parsed: Any) -> Optional[str]:
    """The parsed body's ``model`` when it is a string, else None (no JSON object, no string: the app says why)."""
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


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


def replay(messages: list[dict], receive) -> Callable[[], Awaitable[dict]]:
    """A ``receive`` that gives the app the messages already read, then the client's own."""
    pending = list(messages)

    async def receive_again() -> dict:
        return pending.pop(0) if pending else await receive()

    return receive_again

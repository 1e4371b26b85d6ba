"""Reading a small JSON request body in pure ASGI, and handing it on unchanged (no torch, no project imports).

Shared by the ingress's model guard (model_guard.py) and the edge guard in Serve's HTTP proxy
(edge_guard.py), which runs in a process that must not import the engine: importing
``pool`` or ``engine`` there would load torch into the proxy.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Optional

GUARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_GUARDED_BODY = 64 << 10   # bytes: bogus-name requests are small; larger bodies go to the app unread


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


def header(scope: dict, name: bytes) -> Optional[bytes]:
    """The first value of header ``name`` (lower case) in an ASGI scope or response start message."""
    for key, value in scope.get("headers") or ():
        if key == name:
            return value
    return None


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


UNPARSED = object()   # no body, or one that is not JSON: FastAPI parses (and reports) it itself


def parse_json(body: bytes) -> Any:
    """``body`` decoded as FastAPI's ``request.json()`` would (``json.loads``), or ``UNPARSED``."""
    try:
        return json.loads(body)
    except ValueError:
        return UNPARSED


def model_of(parsed: Any) -> Optional[str]:
    """The parsed body's ``model`` when it is a string, else None (no JSON object, no string: the app says why)."""
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def replay(messages: list[dict], receive) -> Callable[[], Awaitable[dict]]:
    """A ``receive`` that gives the app the messages already read, then the client's own."""
    pending = list(messages)

    async def receive_again() -> dict:
        return pending.pop(0) if pending else await receive()

    return receive_again

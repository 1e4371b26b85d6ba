"""A streamed completion cleans up exactly once, whether it ends, fails, or never starts."""

from __future__ import annotations

import asyncio
import json

import pytest

from deployments.sse import CompletionStream
from engine.request import GenerateResult, TokenDelta

pytestmark = pytest.mark.unit


class Upstream:
    """Stands in for Serve's response generator: yields items, records a cancel."""

    def __init__(self, items):
        self.items = list(items)
        self.cancelled = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled += 1


def delta(text, reason=None):
    return TokenDelta("r", 1, text, reason)


def run(stream: CompletionStream, send) -> None:
    async def receive():
        await asyncio.sleep(3600)

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "http_version": "1.1", "method": "POST", "path": "/"}
    asyncio.run(stream(scope, receive, send))


def make(upstream, closes):
    return CompletionStream(upstream, delta("a"), "m", "id", False, False, 5.0, lambda: closes.append(1))


def test_a_finished_stream_closes_once_and_cancels_nothing():
    result = GenerateResult("r", None, "ab", [1, 1], "length", 1, 2)
    upstream, closes, sent = Upstream([delta("b", "length"), result]), [], []

    async def send(message):
        sent.append(message)

    run(make(upstream, closes), send)
    bodies = b"".join(m.get("body", b"") for m in sent).decode()
    assert bodies.endswith("data: [DONE]\n\n") and closes == [1] and upstream.cancelled == 0


def test_a_client_gone_before_the_first_byte_still_cancels_and_releases():
    upstream, closes = Upstream([delta("b")] * 50), []

    async def send(message):
        raise OSError("client went away")  # fails at the response headers: the events never start

    from starlette.requests import ClientDisconnect

    with pytest.raises((OSError, ClientDisconnect)):
        run(make(upstream, closes), send)
    assert closes == [1] and upstream.cancelled == 1


def test_a_failure_after_tokens_ends_with_an_error_event_and_done():
    upstream, closes, sent = Upstream([delta("b"), RuntimeError("replica died")]), [], []

    async def send(message):
        sent.append(message)

    run(make(upstream, closes), send)
    events = [e for e in b"".join(m.get("body", b"") for m in sent).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][6:])
    assert closes == [1] and upstream.cancelled == 1

"""Bridges from the engine thread's sink to callers: an awaitable result, an async stream, a blocking call.

The engine delivers ``TokenDelta``s, then a ``GenerateResult`` or an exception, to a sink
called on its own thread; each bridge hands those over to its caller's world safely.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable

from .request import GenerateRequest, GenerateResult, TokenDelta
from .sequence import SinkItem

Submit = Callable[[GenerateRequest, Callable[[SinkItem], None]], object]


async def stream(submit: Submit, request: GenerateRequest,
                 with_result: bool = False) -> AsyncIterator[TokenDelta | GenerateResult]:
    """Token deltas as they are produced (the last carries the finish reason), then the result if asked."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    submit(request, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, GenerateResult):
            if with_result:
                yield item
            return
        yield item


async def result(submit: Submit, request: GenerateRequest) -> GenerateResult:
    """The finished result; deltas are dropped on the engine thread, never queued."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def sink(item: SinkItem) -> None:
        if isinstance(item, TokenDelta):
            return

        def settle():
            if future.done():
                return
            if isinstance(item, BaseException):
                future.set_exception(item)
            else:
                future.set_result(item)
        loop.call_soon_threadsafe(settle)

    submit(request, sink)
    return await future


def blocking(submit: Submit, request: GenerateRequest, timeout_s: float = 120.0) -> GenerateResult:
    """For scripts and benchmarks without an event loop."""
    done = threading.Event()
    box: list = []

    def sink(item: SinkItem) -> None:
        if not isinstance(item, TokenDelta):
            box.append(item)
            done.set()

    submit(request, sink)
    if not done.wait(timeout_s):
        raise TimeoutError(f"request {request.request_id} did not finish in {timeout_s}s")
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]

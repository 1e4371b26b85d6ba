"""Bridges from the engine thread's sink to callers: an awaitable result, an async stream, a blocking call.

The engine delivers ``TokenDelta``s, then a ``GenerateResult`` or an exception, to a sink
called on its own thread; each bridge hands those over to its caller's world safely.
Tokenization (inside ``submit``) runs on a worker thread, never on the caller's event
loop. A caller that goes away (cancelled, or stops reading a stream) cancels its
sequence, so the engine frees its KV blocks and batch slot at the next step.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable

from .request import GenerateRequest, GenerateResult, TokenDelta
from .sequence import Sequence, SinkItem

Submit = Callable[[GenerateRequest, Callable[[SinkItem], None]], Sequence]
Cancel = Callable[[Sequence], None]


def _deliver(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> None:
    """Hand an item to the caller's loop; a caller whose loop has closed is gone, not an engine error."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop is closed
        pass


async def _submit_off_loop(submit: Submit, cancel: Cancel, request: GenerateRequest,
                           sink: Callable[[SinkItem], None]) -> Sequence:
    """``submit`` on a thread; if the caller is cancelled meanwhile, the sequence is cancelled once it exists."""
    task = asyncio.ensure_future(asyncio.to_thread(submit, request, sink))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else cancel(t.result()))
        raise


async def stream(submit: Submit, cancel: Cancel, request: GenerateRequest,
                 with_result: bool = False) -> AsyncIterator[TokenDelta | GenerateResult]:
    """Token deltas as they are produced (the last carries the finish reason), then the result if asked."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    seq = await _submit_off_loop(submit, cancel, request, lambda item: _deliver(loop, queue.put_nowait, item))
    settled = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                settled = True
                raise item
            if isinstance(item, GenerateResult):
                settled = True
                if with_result:
                    yield item
                return
            yield item
    finally:
        if not settled:
            cancel(seq)


async def result(submit: Submit, cancel: Cancel, request: GenerateRequest) -> GenerateResult:
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
        _deliver(loop, settle)

    seq = await _submit_off_loop(submit, cancel, request, sink)
    try:
        return await future
    except asyncio.CancelledError:
        cancel(seq)
        raise


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

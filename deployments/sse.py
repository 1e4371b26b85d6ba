"""Server-sent events for a streaming completion: OpenAI's chunk format, then ``[DONE]``.

Once the response has started its status is sent, so a failure after that (the replica
died, the stream went idle past its timeout) ends the stream with an OpenAI-style error
event and ``[DONE]`` rather than a silent cut. A client that disconnects cancels the
upstream call, which removes the sequence from the engine.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from engine.request import GenerateResult

from .http_errors import HTTPError, error_response
from .openai_protocol import STREAM_DONE, stream_chunk


def error_event(exc: BaseException) -> str:
    """The error body the status-code path would have sent, as one event."""
    return f"data: {error_response(exc).body.decode()}\n\n"


async def completion_events(upstream, first, model: str, rid: str, chat: bool, include_usage: bool,
                            idle_timeout_s: float, on_close: Callable[[], None]) -> AsyncIterator[str]:
    """``first`` was awaited before the response started (so its errors became a status); the rest follow."""
    exhausted = False  # the upstream call ended by itself; otherwise it is cancelled
    try:
        if chat:
            yield stream_chunk(None, model, rid, chat, first=True)
        item = first
        while True:
            if isinstance(item, GenerateResult):
                exhausted = True
                if include_usage:
                    yield stream_chunk(None, model, rid, chat, usage=item.usage)
                break
            yield stream_chunk(item, model, rid, chat)
            try:
                item = await asyncio.wait_for(upstream.__anext__(), idle_timeout_s)
            except StopAsyncIteration:
                exhausted = True
                break
            except asyncio.TimeoutError:
                yield error_event(HTTPError(504, f"no token for {idle_timeout_s:.0f}s; the stream was closed",
                                            code="stream_idle_timeout"))
                break
            except Exception as exc:  # the replica died or the sequence failed after tokens were sent
                yield error_event(exc)
                break
        yield STREAM_DONE
    finally:
        if not exhausted:
            upstream.cancel()  # the client went away, or the stream failed: stop the work upstream
        on_close()

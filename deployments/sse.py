"""Server-sent events for a streaming completion: OpenAI's chunk format, then ``[DONE]``.

Once the response has started its status is sent, so a failure after that (the replica
died, the stream went idle past its timeout) ends the stream with an OpenAI-style error
event and ``[DONE]`` rather than a silent cut. A client that disconnects cancels the
upstream call, which removes the sequence from the engine.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Optional

from starlette.responses import StreamingResponse

from engine.request import GenerateResult

from .http_errors import HTTPError, error_response
from .openai_protocol import STREAM_DONE, stream_chunk


def error_event(exc: BaseException) -> str:
    """The error body the status-code path would have sent, as one event."""
    return f"data: {error_response(exc).body.decode()}\n\n"


class CompletionStream(StreamingResponse):
    """An SSE completion that cleans up exactly once: cancels the upstream call unless it ended by
    itself, then ``on_close`` (releases the ingress's places).

    The clean-up runs when the events end and again (a no-op) when the response ends: a client
    that goes away before the first byte was sent never starts the events, and closing a
    never-started async generator would skip its ``finally``.
    """

    def __init__(self, upstream, first, model: str, rid: str, chat: bool, include_usage: bool,
                 idle_timeout_s: float, on_close: Callable[[], None], headers: Optional[dict] = None,
                 on_finish: Optional[Callable[[], Awaitable[None]]] = None):
        self._upstream, self._on_close, self._on_finish = upstream, on_close, on_finish
        self._exhausted = self._closed = False
        events = self._events(first, model, rid, chat, include_usage, idle_timeout_s)
        super().__init__(events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._exhausted:
            self._upstream.cancel()  # the client went away, or the stream failed: stop the work upstream
        self._on_close()

    async def _finished(self) -> None:
        """The work ended by itself: give the places back before the client reads the end of the stream
        (a quota's next request may follow at once, on any ingress replica)."""
        if self._on_finish is not None:
            await self._on_finish()

    async def _events(self, first, model: str, rid: str, chat: bool, include_usage: bool,
                      idle_timeout_s: float) -> AsyncIterator[str]:
        """``first`` was awaited before the response started (so its errors became a status); the rest follow."""
        try:
            if chat:
                yield stream_chunk(None, model, rid, chat, first=True)
            item = first
            while True:
                if isinstance(item, GenerateResult):
                    self._exhausted = True
                    await self._finished()
                    if include_usage:
                        yield stream_chunk(None, model, rid, chat, usage=item.usage)
                    break
                yield stream_chunk(item, model, rid, chat)
                try:
                    item = await asyncio.wait_for(self._upstream.__anext__(), idle_timeout_s)
                except StopAsyncIteration:
                    self._exhausted = True
                    await self._finished()
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
            self._close()

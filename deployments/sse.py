"""Server-sent events for a streaming completion: OpenAI's chunk format, then ``[DONE]``."""

from __future__ import annotations

from typing import AsyncIterator, Callable

from engine.request import GenerateResult

from .openai_protocol import STREAM_DONE, stream_chunk


async def completion_events(first, rest: AsyncIterator, model: str, rid: str, chat: bool, include_usage: bool,
                            on_close: Callable[[], None]) -> AsyncIterator[str]:
    """``first`` was awaited before the response started (so its errors became a status); the rest follow."""
    try:
        if chat:
            yield stream_chunk(None, model, rid, chat, first=True)
        item = first
        while True:
            if isinstance(item, GenerateResult):
                if include_usage:
                    yield stream_chunk(None, model, rid, chat, usage=item.usage)
                break
            yield stream_chunk(item, model, rid, chat)
            try:
                item = await rest.__anext__()
            except StopAsyncIteration:
                break
        yield STREAM_DONE
    finally:
        on_close()

"""The ingress's one admission path, used by the HTTP routes and the handle methods alike.

In order, for every request: the prompt limit (400), a place in the ingress (429 when full),
the adapter (registry, then the resolvers, then its quota and version draw) under the
request's deadline, the worker call under the same deadline (504), one retry on another
replica if the first one died before its first result, and one re-pick of the version if
the drawn one was retired meanwhile (the worker no longer knows it). A stream is admitted
once its first item arrived, so its early errors are statuses, not a broken stream.

The caller's request is never changed: what the gate resolved travels in a copy
(``GenerateRequest.resolved``), and a re-pick makes another copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from engine.errors import AdapterUnregisteredError, InvalidRequestError
from engine.request import GenerateRequest, GenerateResult
from pool.errors import AdapterNotFoundError

from .adapter_gate import AdapterGate, Admission
from .admission import RequestLimiter
from .config import AppArgs
from .http_errors import HTTPError, unwrap

T = TypeVar("T")
VERSION_GONE = (AdapterNotFoundError, AdapterUnregisteredError)  # what a worker says of a retired version


def text_chars(request: GenerateRequest) -> int:
    """Every text field a request carries counts toward the prompt limit: prompt, messages, stops."""
    messages = sum(len(str(value)) for m in request.messages or [] for value in m.values())
    return len(request.prompt or "") + messages + sum(len(s) for s in request.stop_strings)


@dataclass
class OpenStream:
    """A stream past its first item: iterate ``rest()``; ``close()`` exactly once when done."""

    upstream: object
    first: object
    admission: Admission
    idle_timeout_s: float
    exhausted: bool = False

    async def rest(self) -> AsyncIterator:
        """The items after ``first``, each within the idle timeout (504 ``stream_idle_timeout`` past it)."""
        while True:
            try:
                item = await asyncio.wait_for(self.upstream.__anext__(), self.idle_timeout_s)
            except StopAsyncIteration:
                self.exhausted = True
                return
            except asyncio.TimeoutError:
                raise HTTPError(504, f"no token for {self.idle_timeout_s:.0f}s; the stream was closed",
                                code="stream_idle_timeout") from None
            if isinstance(item, GenerateResult):
                self.exhausted = True
                await self.admission.finish()   # the work is done: places back before the caller sees the end
                yield item
                return
            yield item

    def close(self) -> None:
        """Cancel the upstream call unless it ended by itself, then give back the places (idempotent)."""
        if not self.exhausted:
            self.upstream.cancel()
            self.exhausted = True
        self.admission.release()


class FrontDoor:
    def __init__(self, args: AppArgs, gate: AdapterGate, limiter: RequestLimiter, worker, worker_stream):
        self.args, self.gate, self.limiter = args, gate, limiter
        self.worker, self.worker_stream = worker, worker_stream
        self.repicks = 0

    async def admit(self, request: GenerateRequest) -> tuple[GenerateRequest, Admission, float]:
        """Prompt limit, an ingress place, then the adapter, all before ``deadline``. Returns the request as the
        workers get it (a copy carrying the resolved adapter), the admission and the deadline."""
        chars = text_chars(request)
        if chars > self.args.max_prompt_chars:
            raise InvalidRequestError("prompt", f"prompt of {chars} characters exceeds the limit of "
                                                f"{self.args.max_prompt_chars}")
        deadline = self.limiter.deadline()
        self.limiter.acquire()
        try:  # a resolver lookup runs under the request's place and deadline, like the generation
            admission = await self.limiter.within_timeout(self.gate.admit(request.adapter), deadline)
        except BaseException:
            self.limiter.release()
            raise
        admission.also_release(self.limiter.release)
        return dataclasses.replace(request, resolved=admission.ref), admission, deadline

    async def generate(self, request: GenerateRequest) -> tuple[GenerateResult, Admission]:
        request, admission, deadline = await self.admit(request)
        try:
            result = await self._first(request, admission, deadline, self.worker.generate.remote, _itself)
        except BaseException:
            admission.release()
            raise
        await admission.finish()   # places back before the client sees the answer (its next request may follow)
        return result, admission

    async def open_stream(self, request: GenerateRequest) -> OpenStream:
        request, admission, deadline = await self.admit(request)
        try:
            upstream, first = await self._first(request, admission, deadline,
                                                self.worker_stream.generate_stream.remote, _first_item)
        except BaseException:
            admission.release()
            raise
        return OpenStream(upstream, first, admission, self.args.stream_idle_timeout_s)

    async def _first(self, request: GenerateRequest, admission: Admission, deadline: float,
                     call: Callable[[GenerateRequest], object], first: Callable[[object], Awaitable[T]]) -> T:
        try:
            return await self.limiter.first_result(lambda: call(request), first, deadline)
        except BaseException as exc:
            if not isinstance(unwrap(exc), VERSION_GONE) or not await self.gate.repick(admission):
                raise
        self.repicks += 1   # the version it drew was retired while it waited: draw again from the family
        repicked = dataclasses.replace(request, resolved=admission.ref)
        return await self.limiter.first_result(lambda: call(repicked), first, deadline)


async def _itself(response):
    return await response


async def _first_item(upstream):
    return upstream, await upstream.__anext__()

"""The chaos benchmark's HTTP clients: mixed streaming/plain traffic that sometimes hangs up, and probes.

Every request becomes one ``Outcome`` saying what the client saw: a complete answer, a
stream it dropped on purpose, an error status, no response at all, a stream ended by an
error event and ``[DONE]``, or a stream cut without them. Dropping closes the connection
after some tokens (httpx discards an unfinished response's connection), so the server
sees a real client disconnect.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import httpx

from ..chaos_outcomes import CUT, DROPPED, ERROR_EVENT, NO_RESPONSE, OK, STATUS, Outcome, Probe

WORDS = ("lora", "fleet", "serve", "adapter", "token", "batch", "slot", "ray", "kernel", "cache", "route", "page")
CLIENT_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class RequestSpec:
    adapter: str
    prompt: str
    max_tokens: int
    stream: bool
    chat: bool
    temperature: float
    drop_after: Optional[int] = None   # close the stream after this many tokens (None: read it all)


@dataclass(frozen=True)
class TrafficMix:
    adapters: tuple[str, ...]
    stream_fraction: float = 0.5
    drop_fraction: float = 0.3          # of streams, dropped mid-stream
    chat_fraction: float = 0.25
    max_tokens: tuple[int, int] = (8, 48)

    def draw(self, rng: random.Random) -> RequestSpec:
        stream = rng.random() < self.stream_fraction
        max_tokens = rng.randint(*self.max_tokens)
        drop_after = rng.randint(1, max(1, max_tokens // 2)) if stream and rng.random() < self.drop_fraction else None
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        return RequestSpec(adapter=rng.choice(self.adapters), prompt=prompt, max_tokens=max_tokens, stream=stream,
                           chat=rng.random() < self.chat_fraction, temperature=rng.choice((0.0, 0.8)),
                           drop_after=drop_after)


def _request(spec: RequestSpec) -> tuple[str, dict]:
    body: dict = {"model": spec.adapter, "max_tokens": spec.max_tokens, "temperature": spec.temperature}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if spec.chat else "/v1/completions"), body


def _error_code(response: httpx.Response) -> Optional[str]:
    try:
        return (response.json().get("error") or {}).get("code")
    except ValueError:
        return None


async def send(client: httpx.AsyncClient, spec: RequestSpec, phase: str) -> Outcome:
    path, body = _request(spec)
    started = time.monotonic()
    if not spec.stream:
        try:
            response = await client.post(path, json=body)
        except httpx.HTTPError as exc:
            return Outcome(phase, False, NO_RESPONSE, started, time.monotonic(), error_code=type(exc).__name__)
        if response.status_code != 200:
            return Outcome(phase, False, STATUS, started, time.monotonic(), status=response.status_code,
                           error_code=_error_code(response))
        return Outcome(phase, False, OK, started, time.monotonic(), status=200,
                       completion_tokens=response.json()["usage"]["completion_tokens"])
    return await _stream(client, spec, phase, path, body, started)


async def _stream(client: httpx.AsyncClient, spec: RequestSpec, phase: str, path: str, body: dict,
                  started: float) -> Outcome:
    tokens, usage, finished, done, dropped, error = 0, None, False, False, False, None
    status: Optional[int] = None
    try:
        async with client.stream("POST", path, json=body) as response:
            status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return Outcome(phase, True, STATUS, started, time.monotonic(), status=response.status_code,
                               error_code=_error_code(response))
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"].get("code") or event["error"].get("type") or "error"
                    continue
                if event.get("usage") and not event.get("choices"):
                    usage = event["usage"]["completion_tokens"]
                    continue
                choice = event["choices"][0]
                if "role" in choice.get("delta", {}):
                    continue  # a chat stream's opening chunk carries no token
                tokens += 1
                finished = finished or choice.get("finish_reason") is not None
                if spec.drop_after is not None and tokens >= spec.drop_after and not finished:
                    dropped = True
                    break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        if status is None:  # no status line: nothing was streamed, the request is lost
            return Outcome(phase, True, NO_RESPONSE, started, time.monotonic(), error_code=type(exc).__name__)
        return Outcome(phase, True, CUT, started, time.monotonic(), status=200, tokens_received=tokens,
                       error_code=type(exc).__name__)
    ended = time.monotonic()
    if dropped:
        kind = DROPPED
    elif error is not None and done:
        kind = ERROR_EVENT
    elif done and finished:
        kind = OK
    else:
        kind = CUT
    return Outcome(phase, True, kind, started, ended, status=200, tokens_received=tokens, completion_tokens=usage,
                   error_code=error)


def new_client(base_url: str, concurrency: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S,
                             limits=httpx.Limits(max_connections=4 * concurrency,
                                                 max_keepalive_connections=2 * concurrency))


async def run_traffic(client: httpx.AsyncClient, mix: TrafficMix, concurrency: int, phase: Callable[[], str],
                      stop: asyncio.Event, outcomes: list[Outcome], seed: int) -> None:
    """``concurrency`` closed-loop clients until ``stop`` is set; a request is labelled with its starting phase."""
    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while not stop.is_set():
            outcomes.append(await send(client, mix.draw(rng), phase()))

    await asyncio.gather(*(client_loop(i) for i in range(concurrency)))


async def probe_adapters(client: httpx.AsyncClient, adapters: tuple[str, ...], stop: asyncio.Event,
                         probes: list[Probe], interval_s: float = 0.25) -> None:
    """One small plain request per adapter after another until ``stop``: when is each servable again."""
    async def loop(adapter: str) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                response = await client.post("/v1/completions", json={"model": adapter, "prompt": "probe",
                                                                       "max_tokens": 2})
                probes.append(Probe(adapter, started, time.monotonic(), response.status_code == 200,
                                    response.status_code))
            except httpx.HTTPError:
                probes.append(Probe(adapter, started, time.monotonic(), False, None))
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass

    await asyncio.gather(*(loop(a) for a in adapters))


async def models_listed(client: httpx.AsyncClient, adapters: tuple[str, ...]) -> bool:
    """GET /v1/models lists every adapter (the registry survived)."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and set(adapters) <= {m["id"] for m in response.json()["data"]}

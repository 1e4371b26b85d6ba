"""What the ingress tells the edge guard in Serve's proxy about a refusal (edge_guard.py), and nothing else.

The edge guard marks each completion it hands on (``EDGE_MARK``). On a marked request's 404 or
429 for an adapter name the ingress does not serve, the model guard adds ``HINT_HEADER``: a JSON
object saying how long the ingress will keep giving that answer whatever happens meanwhile, so
the proxy can give the very same response itself until then, with no handle call:

- ``name_for_s``: this name's 404, for as long as the resolvers' negative cache holds it (or the
  resolvers' negative TTL for a name no registration can have);
- ``unknown_for_s``, ``rank``, ``replicas``: this ingress replica's 429 for every name it does not
  know, for as long as its lookup rate refuses (``LookupLimiter.refusing_for_s``); a lookup that finds
  its adapter meanwhile ends it early, through a registry write the edge guard sees.

Every hint carries the app's name (whose registry the proxy follows: a name registered meanwhile
is never refused there) and its base model names (never refused either). The edge guard strips
the header, so a client never sees it; an unmarked request (no edge guard) never gets one. Pure:
no torch, no Ray, so the proxy can import it.
"""

from __future__ import annotations

import json
import re
import time
from typing import Iterable, Optional

EDGE_MARK = b"x-lorafleet-edge"          # request header the edge guard adds: "hint me"
HINT_HEADER = b"x-lorafleet-edge-hint"   # response header the edge guard reads and strips
PROBE_TOKEN_WAIT_S = 0.05
"""seconds: a marked request that the lookup rate alone would refuse, its token due within this, waits for the
token first (model_guard.py). The edge guard hands on one unknown name at a time, once the rate's window it
holds is over; that window ends a few ms before the ingress's (it counts from when the proxy handed the request
on), so that name often came in just before the token: a 429 and a Serve round trip through the proxy and the
ingress (~25 ms, ~8 ms of CPU here) for nothing, then another probe (benchmarks/abuse.py: 78 such 429s beside 326
lookups; 11 with the wait). Waiting makes it the lookup its token paces; one name per proxy waits at a time."""


def marked(scope: dict) -> bool:
    return any(key == EDGE_MARK for key, _ in scope.get("headers") or ())


def refusal_hint(gate, name_re: re.Pattern, app: str, base_names: Iterable[str], model: str, status: int,
                 waited_s: float = 0.0) -> Optional[bytes]:
    """The hint for the ingress's ``status`` answer to ``model`` as the gate stands now, or None.

    ``gate`` is the replica's ``AdapterGate`` (read only: no counter moves, no LRU order changes). Only
    apps with resolvers get hints: without them a 404 holds only until the next registry refresh.
    ``waited_s``: how long ago this replica received the request; every time is stated from then, so the
    proxy, which counts from when it handed the request on (earlier), never holds one past the ingress.
    A 404 carries the rate's window too (its lookup took the token): the proxy had the 429 to repeat."""
    resolver = gate.resolver
    if resolver is None or status not in (404, 429) or model in base_names or model in gate.known_names():
        return None
    hint: dict = {"app": app, "known": sorted(n for n in base_names if isinstance(n, str))}
    if status == 404:
        held = resolver.miss_remaining_s(model) if name_re.fullmatch(model) else resolver.negative_ttl_s
        if held > 0:
            hint["name_for_s"] = waited_s + held
    limiter = resolver.limiter
    refusing = limiter.refusing_for_s() if limiter is not None else 0.0
    replicas, rank = limiter.placement() if limiter is not None else (1, None)
    if refusing > 0 and rank is not None:
        hint.update(unknown_for_s=waited_s + refusing, rank=rank, replicas=replicas)
    if "name_for_s" not in hint and "unknown_for_s" not in hint:
        return None
    return json.dumps(hint).encode()


def hinting(send, hint_for):
    """``send`` with ``hint_for(status, waited_s)`` (bytes or None; ``waited_s``: seconds since this call) added
    as ``HINT_HEADER`` to a 404 or 429 response's start, computed when the response starts: after the refusal,
    so a miss the lookup just cached counts."""
    received = time.monotonic()

    async def send_hinted(message: dict) -> None:
        if message["type"] == "http.response.start" and message.get("status") in (404, 429):
            hint = hint_for(message["status"], time.monotonic() - received)
            if hint is not None:
                message = {**message, "headers": [*message.get("headers", ()), (HINT_HEADER, hint)]}
        await send(message)

    return send_hinted

"""The resolver's lookup rate paces misses, not finds (no cluster: the resolver and its limiter alone).

Why: the rate is there so a flood of bogus names cannot turn into object-store or hub calls, but
a burst of first requests for real adapters (registered from S3 on first use) used to be refused
with 429 because the previous real one had just spent the token.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.config import AdapterSpec
from deployments.http_errors import HTTPError
from deployments.resolvers import AdapterResolver, LookupLimiter
from engine.errors import AdapterExistsError
from pool.errors import AdapterNotFoundError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def resolver_at_one_per_s(tmp_path, present: set[str], elsewhere: set[str] = frozenset()):
    """A resolver paced at 1 lookup/s (burst of one) whose root holds ``present``; ``elsewhere``: registered
    by another ingress replica meanwhile (the registration says it exists)."""
    clock = Clock()
    calls: list[str] = []

    async def register(spec: AdapterSpec) -> dict:
        calls.append(spec.name)
        if spec.name in elsewhere:
            raise AdapterExistsError(f"{spec.name} exists")
        if spec.name not in present:
            raise AdapterNotFoundError(f"no {spec.name}")
        return {"name": spec.name}

    limiter = LookupLimiter(1.0, 4, placement=lambda: (1, 0), clock=clock)
    return AdapterResolver([str(tmp_path)], register, clock=clock, limiter=limiter), limiter, calls


def test_lookups_that_find_their_adapter_give_the_token_back(tmp_path):
    resolver, limiter, calls = resolver_at_one_per_s(tmp_path, {"from-s3", "from-disk", "third"})

    async def scenario() -> None:
        for name in ("from-s3", "from-disk", "third"):   # back to back, no time passes: none refused
            assert (await resolver.resolve(name))["name"] == name
        with pytest.raises(AdapterNotFoundError):
            await resolver.resolve("bogus-1")            # a miss spends the token ...
        with pytest.raises(HTTPError) as busy:
            await resolver.resolve("bogus-2")            # ... so the next lookup waits for the rate
        assert busy.value.status == 429 and busy.value.code == "resolver_busy"

    asyncio.run(scenario())
    assert calls == ["from-s3", "from-disk", "third", "bogus-1"] and limiter.running == 0 and limiter.refused == 1


def test_a_name_registered_elsewhere_meanwhile_counts_as_found(tmp_path):
    resolver, limiter, calls = resolver_at_one_per_s(tmp_path, {"mine"}, elsewhere={"theirs"})

    async def scenario() -> None:
        with pytest.raises(AdapterExistsError):
            await resolver.resolve("theirs")
        assert (await resolver.resolve("mine"))["name"] == "mine"

    asyncio.run(scenario())
    assert calls == ["theirs", "mine"] and limiter.refused == 0


def test_a_refund_never_lifts_the_burst_past_one(tmp_path):
    resolver, limiter, calls = resolver_at_one_per_s(tmp_path, {"real"})

    async def scenario() -> None:
        assert (await resolver.resolve("real"))["name"] == "real"   # found at a full bucket: still one token
        with pytest.raises(AdapterNotFoundError):
            await resolver.resolve("bogus-1")
        with pytest.raises(HTTPError):
            await resolver.resolve("bogus-2")

    asyncio.run(scenario())
    assert calls == ["real", "bogus-1"]

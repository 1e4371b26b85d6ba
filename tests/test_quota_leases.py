"""Fleet-wide quotas through one lease owner, without a cluster: three ingress replicas' clients
(``AdapterQuotas``) share one real ``QuotaLeases`` in this process, as they share the deployment."""

from __future__ import annotations

import asyncio

import pytest

from deployments.adapter_gate import Admission
from deployments.http_errors import HTTPError
from deployments.quota_book import NAMES_BEFORE_SWEEP, HeldReport, QuotaBook
from deployments.quota_lease_actor import QuotaLeases
from deployments.quotas import AdapterQuotas

HEARTBEAT_S = 0.01


class FrozenClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(replicas: int = 3, batch: int = 8, clock=None, recall_wait_s: float = 5.0):
    owner = QuotaLeases(batch=batch, ttl_s=60.0, recall_wait_s=recall_wait_s, **({"clock": clock} if clock else {}))
    ingresses = [AdapterQuotas(owner, heartbeat_s=HEARTBEAT_S, holder=f"ingress-{i}", metrics=False,
                               **({"clock": clock} if clock else {})) for i in range(replicas)]
    return owner, ingresses


async def admit(quotas: AdapterQuotas, name: str, limit, rate=None):
    """An Admission holding one quota place, or None when refused (the 429 is checked to name the adapter)."""
    admission = Admission(requested=name)
    try:
        admission.also_release(await quotas.acquire(name, limit, rate))
    except HTTPError as exc:
        assert exc.status == 429 and f"'{name}'" in str(exc) and exc.code == "adapter_quota_exceeded"
        return None
    return admission


@pytest.mark.parametrize("limit", [1, 2, 3, 10, 40])
def test_concurrency_is_exact_over_three_ingress_replicas(limit):
    """Requests spread over 3 replicas and held: exactly ``limit`` are admitted, every other one refused,
    although spares were cached at replicas (a refusal waits for them to come back)."""
    async def run():
        owner, ingresses = fleet()
        held = [await admit(ingresses[i % 3], "a", limit) for i in range(3 * limit + 6)]
        admitted = [h for h in held if h is not None]
        assert len(admitted) == limit
        assert sum(q.inflight["a"] for q in ingresses) == limit
        assert owner.book.held("a") >= limit
        for admission in admitted:
            await admission.finish()
        assert await admit(ingresses[1], "a", limit) is not None   # places came back
    asyncio.run(run())


def test_sequential_requests_through_three_replicas_are_never_refused():
    async def run():
        owner, ingresses = fleet()
        for i in range(50):
            admission = await admit(ingresses[i % 3], "solo", 1)
            assert admission is not None, f"request {i} refused while nothing was in flight"
            await admission.finish()
        assert owner.book.held("solo") == 0
    asyncio.run(run())


def test_far_from_the_limit_most_requests_need_no_round_trip():
    async def run():
        owner, ingresses = fleet(replicas=1, batch=8)
        held = [await admit(ingresses[0], "wide", 1000) for _ in range(64)]
        assert all(held)
        assert ingresses[0].state.round_trips <= 64 // 8 + 1 and ingresses[0].state.local >= 64 - 9
        for admission in held:
            await admission.finish()
    asyncio.run(run())


def test_release_is_idempotent_and_quotas_are_per_adapter():
    async def run():
        owner, (q, *_) = fleet()
        first = await admit(q, "support", 1)
        assert await admit(q, "support", 1) is None
        assert await admit(q, "other", 1) is not None
        first.release()
        first.release()
        await first.finish()
        again = await admit(q, "support", 1)
        assert again is not None and await admit(q, "support", 1) is None
        assert q.state.rejections[("support", "max_concurrency")] == 2
    asyncio.run(run())


def test_rate_is_one_fleet_bucket_and_spare_tokens_are_not_lost():
    async def run():
        clock = FrozenClock()
        owner, ingresses = fleet(clock=clock)
        outcomes = [await admit(ingresses[i % 3], "r", None, 10) for i in range(30)]
        assert sum(o is not None for o in outcomes) == 10     # one second of 10/s, over three replicas
        clock.now += 0.5                                       # half a second refills 5
        outcomes = [await admit(ingresses[i % 3], "r", None, 10) for i in range(12)]
        assert sum(o is not None for o in outcomes) == 5
    asyncio.run(run())


def test_refusal_names_the_rate_quota():
    async def run():
        owner, (q, *_) = fleet(clock=FrozenClock())
        await q.acquire("r", None, 1)
        with pytest.raises(HTTPError, match="1 requests per second"):
            await q.acquire("r", None, 1)
        assert q.state.rejections[("r", "requests_per_s")] == 1
    asyncio.run(run())


def test_a_silent_holders_leases_return_within_its_ttl():
    book = QuotaBook(batch=1, ttl_s=5.0)
    assert book.grant("dead", "a", 1, None, now=0.0).granted
    assert not book.grant("alive", "a", 1, None, now=1.0).granted
    assert book.expire(now=4.9) == []                      # silent 4.9 s: still alive
    book.heartbeat("alive", {}, now=6.0)
    (reclaimed,) = book.expire(now=5.0 + 5.0 / 4)          # the actor sweeps every ttl/4
    assert reclaimed.holder == "dead" and reclaimed.leases == 1 and reclaimed.silent_for_s <= 5.0 + 5.0 / 4
    assert book.grant("alive", "a", 1, None, now=6.5).granted


def test_a_restarted_owner_readopts_what_ingresses_hold():
    book = QuotaBook()
    book.heartbeat("ingress-0", {"a": HeldReport(leases=2)}, now=0.0)
    assert book.held("a") == 2
    assert not book.grant("ingress-1", "a", 2, None, now=0.1).granted


def test_bad_give_back_is_refused_and_changes_nothing():
    book = QuotaBook(batch=1)
    assert book.grant("i", "a", 3, None, now=0.0).granted
    with pytest.raises(ValueError, match="negative"):
        book.give_back("i", "a", -1, 0, 0, now=0.0)
    assert book.held("a") == 1
    with pytest.raises(ValueError, match="batch"):
        QuotaBook(batch=0)


def test_the_book_forgets_names_nothing_holds():
    book = QuotaBook(batch=1)
    for i in range(10_000):
        assert book.grant("i", f"n{i}", 1, None, now=float(i)).granted
        book.give_back("i", f"n{i}", 1, 0, 0, now=float(i))
        book.grant("i", f"r{i}", None, 5.0, now=float(i))
    assert len(book.names) <= NAMES_BEFORE_SWEEP            # rate buckets that refilled are forgotten
    assert not any(name.startswith("n") for name in book.names)

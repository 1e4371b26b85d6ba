"""Oldest first across routers (``routing.wait_exchange``): the directory's board of every router's oldest wait per
replica, what a router makes of the reply, and the exchange thread that reports while requests wait.

The last test sends real reports to the session's real directory through a Serve handle (``exchange_waits``)."""

from __future__ import annotations

import asyncio
import threading

from pytest import approx

from routing.wait_exchange import OthersWaiting, WaitBoard, WaitExchange

DEADLINE_S = 30.0


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_board_returns_the_other_routers_longest_wait_per_replica_as_of_now():
    clock = Clock()
    board = WaitBoard(expiry_s=1.0, clock=clock)
    assert board.exchange("a", {"r1": 0.5}) == {}                   # alone: nothing to hear
    clock.now += 0.2
    assert board.exchange("b", {"r1": 0.1, "r2": 2.0}) == approx({"r1": 0.7})  # a's wait grew by the 0.2 s since
    clock.now += 0.1
    heard = board.exchange("c", {})
    assert heard == approx({"r1": 0.8, "r2": 2.1}) and len(board) == 2  # the longest of a's and b's; c has none
    assert board.exchange("a", {"r1": 0.0}) == approx({"r1": 0.2, "r2": 2.1})  # a's own report never comes back


def test_a_router_that_stops_waiting_or_goes_silent_leaves_the_board():
    clock = Clock()
    board = WaitBoard(expiry_s=1.0, clock=clock)
    board.exchange("a", {"r1": 3.0})
    board.exchange("b", {"r1": 1.0})
    board.exchange("a", {})                                          # a's requests were all served
    assert board.exchange("c", {}) == approx({"r1": 1.0}) and len(board) == 1
    clock.now += 1.5                                                 # b died without a word
    assert board.exchange("c", {}) == {} and len(board) == 0
    for i in range(10_000):                                          # bounded: only reporting routers are kept
        board.exchange(f"router-{i}", {"r1": 0.1})
        clock.now += 0.001
    assert len(board) <= 1001


def test_a_router_yields_only_to_a_fresh_report_of_an_older_request():
    clock = Clock()
    others = OthersWaiting(fresh_s=0.5, clock=clock)
    assert not others.older_elsewhere("r1", since=clock.now)          # nothing heard: a router alone never yields
    assert not others.anyone()
    others.heard({})
    assert not others.anyone()                                        # heard: no one else waits
    others.heard({"r1": 2.0})                                         # another router's request began at 98.0
    assert others.anyone()
    assert others.older_elsewhere("r1", since=99.0)
    assert not others.older_elsewhere("r1", since=98.2, margin_s=0.25)  # older, but not by the margin
    assert others.older_elsewhere("r1", since=98.3, margin_s=0.25)
    assert not others.older_elsewhere("r2", since=99.0)               # no one else waits for r2
    assert not others.older_elsewhere("r1", since=97.0)               # this request is the oldest
    clock.now += 0.6
    assert not others.older_elsewhere("r1", since=99.0)               # stale: it may have been served since
    assert not others.anyone()


class Reply:
    def __init__(self, value: dict):
        self.value = value

    def result(self, *, timeout_s=None) -> dict:
        return self.value


def test_the_exchange_reports_while_requests_wait_then_once_empty_then_sleeps():
    sent: list[dict] = []
    own = {"ages": {"r1": 0.3}}
    went_quiet = threading.Event()

    def send(router_id: str, ages):
        assert router_id == "me"
        sent.append(dict(ages))
        if not ages:
            went_quiet.set()
        return Reply({"r1": 1.5})

    others = OthersWaiting(fresh_s=10.0)

    async def scenario():
        exchange = WaitExchange("me", 0.01, lambda: dict(own["ages"]), others, send)
        exchange.waiting(asyncio.get_running_loop())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        while len(sent) < 3:
            assert loop.time() < deadline, "no reports while a request waits"
            await asyncio.sleep(0.01)
        assert others.older_elsewhere("r1", since=loop.time())  # the reply reached the router's loop
        own["ages"] = {}
        await asyncio.wait_for(asyncio.to_thread(went_quiet.wait, DEADLINE_S), DEADLINE_S)
        count = len(sent)
        # asleep until the next request waits: a short wait shows no report goes out meanwhile
        await asyncio.wait_for(asyncio.to_thread(threading.Event().wait, 0.1), 1.0)
        assert len(sent) == count and sent[-1] == {}
        own["ages"] = {"r2": 0.1}
        exchange.waiting(loop)
        while len(sent) == count:
            assert loop.time() < deadline, "a new waiting request was not reported"
            await asyncio.sleep(0.01)
        assert sent[count] == {"r2": 0.1}
        exchange.stop()

    asyncio.run(scenario())


def test_the_directory_trades_waits_between_routers(fleet):
    """The deployed directory answers ``exchange_waits``: each router hears the other's waits, never its own."""
    from fleet_helpers import directory as directory_of

    directory = directory_of()
    assert directory.exchange_waits.remote("router-a", {"r1": 1.0}).result(timeout_s=DEADLINE_S) == {}
    heard = directory.exchange_waits.remote("router-b", {"r1": 0.1}).result(timeout_s=DEADLINE_S)
    assert set(heard) == {"r1"} and heard["r1"] >= 1.0
    assert directory.exchange_waits.remote("router-a", {}).result(timeout_s=DEADLINE_S)["r1"] >= 0.1
    assert directory.exchange_waits.remote("router-b", {}).result(timeout_s=DEADLINE_S) == {}

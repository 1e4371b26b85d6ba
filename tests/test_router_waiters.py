"""Waiting requests resume oldest first, whatever order they went to sleep in."""

import asyncio

from routing.waiters import OldestFirstWaiters


def test_waiters_resume_oldest_first_and_timeouts_leave_the_line():
    async def scenario():
        waiters = OldestFirstWaiters()
        resumed = []

        async def request(name, since, timeout=5.0):
            if await waiters.wait(since, timeout):
                resumed.append(name)

        # the newest goes to sleep first, as after a re-decision: it must still resume last
        tasks = [asyncio.create_task(request("new", 3.0)), asyncio.create_task(request("old", 1.0)),
                 asyncio.create_task(request("mid", 2.0)), asyncio.create_task(request("late", 0.5, timeout=0.01))]
        await tasks[3]                      # "late" timed out and left the line
        assert len(waiters) == 3
        assert waiters.first_in_line(0.9) and waiters.first_in_line(1.0) and not waiters.first_in_line(2.0)
        waiters.wake_all()
        await asyncio.gather(*tasks)
        assert resumed == ["old", "mid", "new"]
        assert len(waiters) == 0
        assert await waiters.wait(0.0, 0.01) is False  # nothing wakes it: a timeout, not an error

    asyncio.run(scenario())


def test_the_line_names_the_oldest_waiting_request_whether_asleep_or_deciding():
    from routing.waiters import OldestFirstWaiters

    waiters = OldestFirstWaiters()
    assert not waiters.is_oldest("a")
    waiters.join_line(2.0, "b")
    waiters.join_line(1.0, "a")
    assert waiters.is_oldest("a") and not waiters.is_oldest("b")
    waiters.leave_line(1.0, "a")
    assert waiters.is_oldest("b")


def test_a_freed_row_is_handed_down_the_line_until_a_request_takes_it():
    """``relay`` wakes the oldest sleeping request; one that sleeps again with ``handoff`` wakes the next younger
    one; the first that takes the row ends the relay, so the requests behind it stay asleep (no herd)."""
    async def scenario():
        waiters = OldestFirstWaiters()
        looked: list[str] = []
        takes = {"c"}  # only "c"'s decision suits the freed row

        async def request(name, since):
            woken = await waiters.wait(since, 1.0)
            while woken:
                looked.append(name)
                if name in takes:
                    return name
                woken = await waiters.wait(since, 0.2, handoff=True)
            return None

        tasks = [asyncio.create_task(request(n, s)) for n, s in (("d", 4.0), ("b", 2.0), ("a", 1.0), ("c", 3.0),
                                                                   ("e", 5.0))]
        while len(waiters) < 5:
            await asyncio.sleep(0)
        waiters.relay()
        done = await asyncio.gather(*tasks)
        assert looked == ["a", "b", "c"]  # oldest first, and "d" and "e" never woke for it
        assert done == [None, None, None, "c", None]

    asyncio.run(scenario())


def test_a_relay_with_nobody_asleep_wakes_nobody_later():
    async def scenario():
        waiters = OldestFirstWaiters()
        waiters.relay()
        waiters.hand_on(0.0)
        assert await waiters.wait(1.0, 0.05) is False

    asyncio.run(scenario())


def test_a_request_cancelled_after_a_relay_woke_it_hands_the_row_on():
    """A client that goes away just as its request is woken must not swallow the freed row: either the wake-up
    wins (Python 3.11's ``wait_for`` returns a result that arrived before the cancellation, and the router's request
    decides and hands on as usual) or the cancellation does and the next request in line is woken."""
    async def scenario():
        waiters = OldestFirstWaiters()
        first = asyncio.create_task(waiters.wait(1.0, 5.0))
        second = asyncio.create_task(waiters.wait(2.0, 1.0))
        while len(waiters) < 2:
            await asyncio.sleep(0)
        waiters.relay()   # wakes "first" ...
        first.cancel()    # ... which is cancelled before it runs again
        got_first, got_second = await asyncio.gather(first, second, return_exceptions=True)
        assert got_first is True or (isinstance(got_first, asyncio.CancelledError) and got_second is True)

    asyncio.run(scenario())

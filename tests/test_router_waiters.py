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

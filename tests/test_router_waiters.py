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


def test_a_router_tells_the_oldest_request_in_line_per_replica_it_waits_for():
    waiters = OldestFirstWaiters()
    waiters.join_line(2.0, "q2")
    waiters.join_line(1.0, "q1")
    waiters.join_line(3.0, "q3")
    waiters.waits_for(2.0, "q2", "r0")
    waiters.waits_for(1.0, "q1", "r1")
    waiters.waits_for(3.0, "q3", "r0")
    assert waiters.oldest_per_replica() == {"r0": 2.0, "r1": 1.0}
    waiters.waits_for(1.0, "q1", "r0")  # it decided again: now it waits for r0
    assert waiters.oldest_per_replica() == {"r0": 1.0}
    waiters.leave_line(1.0, "q1")
    assert waiters.oldest_per_replica() == {"r0": 2.0}


def test_the_waiting_board_shows_each_router_the_oldest_waits_of_the_others_and_forgets_silent_routers():
    from routing.waiting_board import WaitingBoard

    now = [0.0]
    board = WaitingBoard(ttl_s=10.0, clock=lambda: now[0], max_routers=3)
    board.post("a", {"r0": 100.0, "r1": 105.0})
    board.post("b", {"r0": 103.0})
    assert board.others("a") == {"r0": 103.0} and board.others("b") == {"r0": 100.0, "r1": 105.0}
    assert board.others("c") == {"r0": 100.0, "r1": 105.0}
    board.post("a", {})  # nothing waits in a any more
    assert board.others("b") == {} and len(board) == 1
    board.post("c", {"r1": 1.0})
    board.post("d", {"r1": 2.0})
    board.post("e", {"r1": 0.5})  # a fourth router: over the bound, not recorded
    assert len(board) == 3 and board.others("x") == {"r0": 103.0, "r1": 1.0}
    now[0] = 11.0
    assert board.others("x") == {} and len(board) == 0  # silent past ttl_s: forgotten

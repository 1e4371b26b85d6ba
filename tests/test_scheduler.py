from dataclasses import dataclass
from typing import Optional

from engine.scheduler import Scheduler


@dataclass(eq=False)
class Req:
    uid: Optional[str]
    blocked_steps: int = 0


def make(slots=2, pinned=(), max_batch=8, bypass=2):
    pinned = set(pinned)

    def validate(uids):
        return len(uids) <= slots and len(uids) - len(uids & pinned) <= slots - len(pinned)

    return Scheduler(validate, lambda u: u in pinned, max_batch, bypass)


def test_fifo_admission_within_slots():
    s = make(slots=2)
    reqs = [Req("a"), Req("b"), Req("c"), Req("a")]
    for r in reqs:
        s.add(r)
    admitted = s.admit()
    # c does not fit (a, b hold both slots); the later "a" joins without adding an adapter
    assert admitted == [reqs[0], reqs[1], reqs[3]]
    assert list(s.waiting) == [reqs[2]]


def test_batch_size_limit():
    s = make(slots=4, max_batch=2)
    for r in [Req("a"), Req("a"), Req("a")]:
        s.add(r)
    assert len(s.admit()) == 2


def test_blocked_head_is_not_starved_by_later_arrivals():
    s = make(slots=1, bypass=2)
    first = Req("a")
    s.add(first)
    s.admit()
    blocked = Req("b")
    s.add(blocked)
    joined = 0
    for step in range(10):
        s.add(Req("a"))  # a steady stream for the running adapter
        admitted = s.admit()
        joined += len(admitted)
        if step >= 3:
            assert admitted == []  # the bypass window closed
    assert joined == 2 and blocked.blocked_steps == 10
    for r in list(s.running):
        s.finish(r)
    admitted = s.admit()
    assert admitted[0] is blocked  # it goes before every later arrival
    assert all(r.uid == "b" for r in admitted)


def test_pinned_adapter_requests_may_bypass_a_blocked_head():
    s = make(slots=3, pinned={"p"}, bypass=0)
    s.add(Req("a"))
    s.add(Req("b"))
    s.admit()
    blocked, pinned_req = Req("c"), Req("p")
    s.add(blocked)
    s.add(pinned_req)
    assert s.admit() == [pinned_req]
    assert list(s.waiting) == [blocked]


def test_requeue_front_keeps_arrival_order_ahead_of_later_requests():
    s = make(slots=4)
    a, b, c = Req("a"), Req("b"), Req("c")
    for r in (a, b):
        s.add(r)
    s.admit()
    s.add(c)
    s.requeue_front([a, b])
    assert list(s.waiting) == [a, b, c] and s.running == []

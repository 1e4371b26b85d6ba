from deployments.event_buffer import EventBuffer
from pool.events import PoolEvent


def ev(seq):
    return PoolEvent("load", f"u{seq}", 0, "r0", seq, 0.0)


def test_first_drain_asks_for_a_snapshot_then_only_events():
    buf = EventBuffer(capacity=4)
    buf.append(ev(1))
    events, resync = buf.drain()
    assert [e["seq"] for e in events] == [1] and resync
    buf.append(ev(2))
    events, resync = buf.drain()
    assert [e["seq"] for e in events] == [2] and not resync
    assert buf.drain() == ([], False)


def test_a_full_buffer_drops_the_oldest_and_asks_for_a_resync():
    buf = EventBuffer(capacity=3)
    buf.drain()
    for seq in range(1, 6):
        buf.append(ev(seq))
    events, resync = buf.drain()
    assert [e["seq"] for e in events] == [3, 4, 5] and resync and buf.dropped == 2


def test_request_resync():
    buf = EventBuffer()
    buf.drain()
    buf.request_resync()
    assert buf.drain() == ([], True)

"""The simulator's model of Ray Serve's routing loop (``benchmarks/sim/serve_routing.py``), step by step."""

from __future__ import annotations

from benchmarks.sim.config import SimRequest
from benchmarks.sim.events import EventLoop
from benchmarks.sim.serve_routing import ServeRoutingTasks


class Fleet(EventLoop):
    """Replicas with ``capacity`` rows each; ``tries`` logs (time, request) per routing try."""

    def __init__(self, replicas: int, capacity: int):
        super().__init__()
        self.free = [capacity] * replicas
        self.tries: list[tuple[float, int]] = []
        self.placed: list[tuple[float, int, int]] = []
        self.serve = ServeRoutingTasks(self, replicas, self.try_route, self.dispatch)

    def try_route(self, req: SimRequest):
        self.tries.append((round(self.now, 6), req.i))
        return next((i for i, f in enumerate(self.free) if f > 0), None)

    def dispatch(self, req: SimRequest, idx: int) -> None:
        req.replica = idx
        self.free[idx] -= 1
        self.placed.append((round(self.now, 6), req.i, idx))

    def run_for(self, seconds: float) -> None:
        end = self.now + seconds
        self.at(end, lambda: None)
        self.run_until(lambda: self.now >= end)


def request(i: int) -> SimRequest:
    return SimRequest(i, f"a{i}", 0.0, 8, 8, 16)


def test_a_full_fleet_is_retried_at_once_then_after_25_50_100_ms():
    fleet = Fleet(replicas=1, capacity=0)
    fleet.serve.arrive(request(0))
    fleet.run_for(0.2)
    assert [t for t, _ in fleet.tries] == [0.0, 0.0, 0.025, 0.075, 0.175]


def test_at_most_two_tasks_per_replica_route_at_once():
    fleet = Fleet(replicas=2, capacity=0)
    for i in range(10):
        fleet.serve.arrive(request(i))
    assert len(fleet.serve.tasks) == 4
    assert {i for _, i in fleet.tries} == {0, 1, 2, 3}  # the rest wait untaken


def test_a_found_replica_goes_to_the_oldest_request_whose_task_is_cancelled_and_the_finder_keeps_backing_off():
    fleet = Fleet(replicas=1, capacity=0)
    found = fleet.try_route
    fleet.serve.try_route = lambda req: None if req.i == 0 else found(req)  # only request 1's tries see the row
    for i in range(3):
        fleet.serve.arrive(request(i))
    fleet.run_for(0.1)                       # both tasks back off; request 2 waits untaken
    task_of = dict(fleet.serve.owner)
    fleet.free[0] = 1
    fleet.run_for(0.1)                       # request 1's task wakes at 0.175 and finds the row
    assert fleet.placed == [(0.175, 0, 0)]   # ... for the oldest request, not its own
    assert not task_of[0].alive and task_of[1].alive and fleet.serve.owner[1] is task_of[1]
    assert fleet.serve.owner[2] is not task_of[0]  # a replacement task took request 2
    fleet.run_for(0.19)                      # the finder sleeps its next backoff (200 ms) even so
    assert [t for t, i in fleet.tries if i == 1] == [0.0, 0.0, 0.025, 0.075, 0.175, 0.375]

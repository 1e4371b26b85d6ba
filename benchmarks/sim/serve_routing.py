"""Ray Serve's routing loop (``ray.serve._private.request_router.RequestRouter``, Ray 2.60), in simulated time.

Why: live, Serve's default router at concurrency 64 on two replicas left both cores 55-70 % idle
and its engines idle most of the time while 48 requests waited in the router (``routing_live``,
pow2: 21.5 req/s; the same run with Serve's retry backoff cut to 2-10 ms: 51.6 req/s). A model
that backs off per request and hands each found replica to the request that found it served
49.7 req/s: the idle time is in how Serve's loop sleeps, so the model follows that loop (at a fixed
engine cost this alone takes pow2 from 50.8 to 44.0 req/s against 26.2 live; what the router knows
of each replica's queue -- its cache, its probes and the replicas' refusals -- is ``serve_cache``'s
model, used when a ``cache`` is given):

- At most ``min(50, 2 x replicas, pending)`` routing tasks; each takes the oldest request no task
  has taken yet and tries to place it (one ``router.route`` call per try).
- A replica found goes to the oldest pending request (with the same multiplexed model id, where
  the request carries one), not necessarily the task's own. That request's task, if another, is
  cancelled; a task ending starts replacements while requests wait to be taken.
- Tries of one request: the first failure retries at once (in the same turn of the event loop: a
  send the task made in that turn is not in Serve's cache yet), then the task sleeps 25 ms, 50 ms, ...
  up to 0.5 s between tries -- also after a try that placed some other request, since Serve's
  generator only resets when the task's own request is placed.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Protocol, Sequence

from .config import SimRequest
from .serve_cache import ServeQueueCache


class Clock(Protocol):
    now: float

    def at(self, t: float, action: Callable, *args) -> None: ...


class _Task:
    __slots__ = ("req", "attempt", "entered_backoff", "alive", "backoff_index")

    def __init__(self) -> None:
        self.req: Optional[SimRequest] = None
        self.attempt = 0
        self.entered_backoff = False
        self.alive = True
        self.backoff_index = 0  # failed selections of its own request (a probe's deadline doubles with it)


class ServeRoutingTasks:
    """Pending requests and the routing tasks that place them, as Serve's router keeps them."""

    max_tasks_cap = 50

    def __init__(self, clock: Clock, replicas: int, try_route: Callable[[SimRequest], Optional[int]],
                 dispatch: Callable[[SimRequest, int], None], initial_backoff_s: float = 0.025,
                 max_backoff_s: float = 0.5, multiplier: float = 2.0,
                 model_id: Optional[Callable[[SimRequest], Optional[str]]] = None,
                 cache: Optional[ServeQueueCache] = None,
                 candidates: Optional[Callable[[SimRequest], Sequence[int]]] = None):
        """``cache`` and ``candidates``: choose as Serve does, ``candidates(req)`` (the router's random two, or
        its holders) selected through Serve's queue-length cache and probes; without them ``try_route(req)``
        decides on exact counts at once."""
        if (cache is None) != (candidates is None):
            raise ValueError("cache and candidates go together")
        self.cache, self.candidates = cache, candidates
        self.clock, self.replicas = clock, replicas
        self.try_route, self.dispatch = try_route, dispatch
        self.initial_backoff_s, self.max_backoff_s, self.multiplier = initial_backoff_s, max_backoff_s, multiplier
        self.model_id = model_id
        self.to_fulfill: list[SimRequest] = []       # arrived, not placed, oldest first
        self.to_route: deque[SimRequest] = deque()   # not yet taken by a task
        self.owner: dict[int, _Task] = {}             # request index -> the task routing it
        self.tasks: set[_Task] = set()

    @property
    def target_tasks(self) -> int:
        return min(len(self.to_fulfill), self.max_tasks_cap, 2 * self.replicas)

    def arrive(self, req: SimRequest) -> None:
        self.to_fulfill.append(req)
        self.to_route.append(req)
        self._start_tasks()

    def _start_tasks(self) -> None:
        for _ in range(self.target_tasks - len(self.tasks)):
            task = _Task()
            self.tasks.add(task)
            self._next_request(task)

    def _next_request(self, task: _Task) -> None:
        """The outer loop: while tasks are not above target, take the next request and try it at once."""
        while self.to_route and len(self.tasks) <= self.target_tasks:
            req = self.to_route.popleft()
            if req.replica >= 0:
                continue
            task.req, task.attempt, task.entered_backoff, task.backoff_index = req, 0, False, 0
            self.owner[req.i] = task
            self._try(task)
            return
        self._end(task)

    def _end(self, task: _Task) -> None:
        task.alive = False
        self.tasks.discard(task)
        if task.req is not None and self.owner.get(task.req.i) is task:
            del self.owner[task.req.i]
        if self.to_route:  # replacements, on the event loop's next turn
            self.clock.at(self.clock.now, self._start_tasks)

    def retry(self, req: SimRequest) -> None:
        """A replica refused ``req``: back into both queues by arrival (Serve's ``is_retry``), tasks started."""
        req.replica = -1
        for queue in (self.to_fulfill, self.to_route):
            k = len(queue)
            while k > 0 and queue[k - 1].arrival > req.arrival:
                k -= 1
            queue.insert(k, req)
        self._start_tasks()

    def _try(self, task: _Task) -> None:
        if not task.alive:
            return  # cancelled while it slept
        if self.cache is None:
            self._tried(task, self.try_route(task.req))
            return
        candidates = self.candidates(task.req)
        if not candidates:
            self._tried(task, None)
            return
        self.cache.select(candidates, task.backoff_index, lambda idx: self._tried(task, idx))

    def _tried(self, task: _Task, idx: Optional[int]) -> None:
        if not task.alive:
            return  # cancelled while its probes were out
        req = task.req
        if idx is None:
            task.backoff_index += 1
        else:
            self._fulfill(idx, req, task)
            if req.replica >= 0:  # its own request is placed: the generator closes, backoff resets
                del self.owner[req.i]
                task.req = None
                self._next_request(task)
                return
        if not task.entered_backoff:  # the first failure retries at once, in the same turn of the event loop
            task.entered_backoff = True
            self._try(task)
            return
        delay = min(self.initial_backoff_s * self.multiplier ** task.attempt, self.max_backoff_s)
        task.attempt += 1
        self.clock.at(self.clock.now + delay, self._try, task)

    def _fulfill(self, idx: int, asked_by: SimRequest, task: _Task) -> None:
        """The oldest pending request with ``asked_by``'s model id (when requests carry one), else the oldest."""
        chosen = None
        if self.model_id is not None and self.model_id(asked_by) is not None:
            key = self.model_id(asked_by)
            chosen = next((r for r in self.to_fulfill if self.model_id(r) == key), None)
        if chosen is None:
            chosen = self.to_fulfill[0]
        self.to_fulfill.remove(chosen)
        if chosen in self.to_route:
            self.to_route.remove(chosen)
        self.dispatch(chosen, idx)
        other = self.owner.get(chosen.i)
        if other is not None and other is not task:
            self._end(other)  # cancelled: Serve cancels the task routing a request another task placed

"""The router's directory feed ends cleanly: ``stop`` withdraws its poll in flight, and ``ray.shutdown`` (which
raises SystemExit in the thread blocked on a poll) ends the thread without an exception or a killed process.

The unit tests drive ``DirectoryFeed`` with polls that block like Serve's ``DeploymentResponse.result``; the
last test runs a feed against the session's real directory in a driver process of its own and shuts its Ray down.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Iterator, Mapping, Optional

import pytest

from routing import directory_feed
from routing.directory_feed import DirectoryFeed, FeedClosed, stop_feeds
from routing.settings import RoutingSettings
from routing.view import RouterView

DEADLINE_S = 30.0
REPO = Path(__file__).resolve().parents[1]


class Metrics:
    lag_s = 0.0

    def export(self) -> None:
        pass


class BlockingPoll:
    """A poll that waits until released (a reply), cancelled (Serve raises on a cancelled request) or told to
    raise ``failure`` (what Ray raises in the waiting thread at ``ray.shutdown``)."""

    def __init__(self) -> None:
        self.cancelled = False
        self.failure: Optional[BaseException] = None
        self.reply: Optional[Mapping] = None
        self._event = threading.Event()

    def result(self, *, timeout_s: Optional[float] = None) -> Mapping:
        if not self._event.wait(timeout_s):
            raise TimeoutError("poll timed out")
        if self.cancelled:
            raise RuntimeError("request cancelled")
        if self.failure is not None:
            raise self.failure
        return self.reply or {}

    def cancel(self) -> None:
        self.cancelled = True
        self._event.set()

    def answer(self, reply: Mapping) -> None:
        self.reply = reply
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self.failure = exc
        self._event.set()


class Directory:
    """Hands out ``BlockingPoll``s and lets a test wait for the next one to be in flight."""

    def __init__(self) -> None:
        self.polls: list[BlockingPoll] = []
        self.closed = False
        self._sent = threading.Condition()

    def send(self, since_version: int, timeout_s: float, plan_version: int) -> BlockingPoll:
        if self.closed:
            raise FeedClosed("gone")
        with self._sent:
            self.polls.append(BlockingPoll())
            self._sent.notify_all()
            return self.polls[-1]

    def in_flight(self, count: int) -> BlockingPoll:
        with self._sent:
            assert self._sent.wait_for(lambda: len(self.polls) >= count, DEADLINE_S), f"no poll {count} sent"
            return self.polls[count - 1]


@pytest.fixture
def thread_errors() -> Iterator[list[str]]:
    """Exceptions that ended a thread (what pytest reports as an unhandled thread exception)."""
    seen: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: seen.append(f"{args.thread.name}: {args.exc_type.__name__}")
    yield seen
    threading.excepthook = previous


def started_feed(directory: Directory, loop: asyncio.AbstractEventLoop) -> DirectoryFeed:
    """A feed whose first poll (answered at once, as the directory answers ``since_version=-1``) is applied and
    whose second waits in flight."""
    feed = DirectoryFeed(RoutingSettings(min_poll_interval_s=0.0), RouterView(), Metrics(), directory.send)
    feed.ensure_running(loop)
    directory.in_flight(1).answer({"epoch": "e", "version": 1, "full": {}})
    directory.in_flight(2)
    return feed


def ended(feed: DirectoryFeed) -> bool:
    feed._thread.join(DEADLINE_S)
    return not feed._thread.is_alive()


def test_stop_withdraws_the_poll_in_flight_and_the_thread_ends(background_loop, thread_errors):
    loop = background_loop
    directory = Directory()
    feed = started_feed(directory, loop)
    feed.stop()
    assert directory.polls[1].cancelled
    assert ended(feed) and len(directory.polls) == 2  # no poll after the stop
    feed.ensure_running(loop)
    assert not feed._thread.is_alive()  # a stopped feed is not restarted by the next routed request
    assert thread_errors == []


def test_stop_feeds_stops_every_feed_of_the_process(background_loop):
    loop = background_loop
    directories = [Directory(), Directory()]
    feeds = [started_feed(d, loop) for d in directories]
    stop_feeds()
    assert all(d.polls[1].cancelled for d in directories)
    assert all(ended(f) for f in feeds)


def test_system_exit_in_a_poll_ends_the_thread_quietly_and_keeps_the_poll(background_loop, thread_errors):
    loop = background_loop
    """Ray raises SystemExit in the thread waiting on a call when ``ray.shutdown()`` runs; the poll is kept, since
    releasing its object reference after the shutdown makes Ray end the process (the last test shows it)."""
    directory = Directory()
    feed = started_feed(directory, loop)
    poll = directory.polls[1]
    poll.fail(SystemExit(0))
    assert ended(feed)
    assert thread_errors == [] and len(directory.polls) == 2
    assert any(p is poll for p in directory_feed._left_behind)


def test_a_closed_transport_ends_the_thread(background_loop, thread_errors):
    loop = background_loop
    directory = Directory()
    feed = started_feed(directory, loop)
    directory.closed = True
    directory.polls[1].fail(RuntimeError("Core worker is shutting down"))  # retried after a second, then closed
    assert ended(feed) and thread_errors == []


DRIVER = textwrap.dedent("""
    import asyncio, threading, time
    import ray
    from ray import serve
    from deployments.directory_actor import AdapterDirectoryActor
    from routing.directory_feed import DirectoryFeed
    from routing.settings import RoutingSettings
    from routing.view import RouterView

    errors = []
    threading.excepthook = lambda args: errors.append(f"{args.thread.name}: {args.exc_type.__name__}")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"location": "NoServer"})
    handle = serve.run(AdapterDirectoryActor.bind(), name="feed-exit", route_prefix=None)

    class Metrics:
        lag_s = 0.0
        def export(self): pass

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    polls = []
    second = threading.Event()  # the first reply came back and the second poll waits at the directory
    def send(since, timeout_s, plan_version):
        polls.append(since)
        if len(polls) == 2:
            second.set()
        return handle.get_changes.remote(since, timeout_s, plan_version)
    feed = DirectoryFeed(RoutingSettings(poll_timeout_s=60.0, metrics_export_interval_s=60.0), RouterView(),
                         Metrics(), send)
    feed.ensure_running(loop)
    assert second.wait(120), "no second poll"
    deadline = time.monotonic() + 120
    while handle.view.remote().result(timeout_s=30)["long_polls"] < 1:  # until it waits at the directory
        assert time.monotonic() < deadline, "the second poll never reached the directory"
    ray.shutdown()  # as the test session's teardown does, Serve still up
    feed._thread.join(30)
    print("feed alive:", feed._thread.is_alive(), "thread errors:", errors, flush=True)
""")


def test_ray_shutdown_during_a_poll_ends_the_feed_and_the_process_cleanly(ray_cluster):
    """A driver that started its own Ray (as the test session does) and whose feed waits on a real directory
    calls ``ray.shutdown()``. Before: SystemExit ended the thread as an unhandled exception, then Ray ended the
    whole process (exit status 1) when the poll's reference was released. Its own cluster, because Ray raises
    SystemExit only in the driver that started it; ``ray_cluster`` only marks it ``ray`` (it starts Ray)."""
    run = subprocess.run([sys.executable, "-c", DRIVER], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "feed alive: False thread errors: []" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]

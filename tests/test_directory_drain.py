"""A caller that stops withdraws its long polls on the directory, so a deleted app's directory does not wait
them out: Serve stops a replica only once its ongoing requests are done, and a long poll is one (a router's and
a registry follower's, up to their ``poll_timeout_s``). Polls of 120 s here: a withdrawn poll leaves at once, one
left waiting would outlast the test's deadline."""

from __future__ import annotations

import asyncio
from typing import Iterator

import pytest
from ray import serve

from deployments.directory_actor import AdapterDirectoryActor
from deployments.registry import RegistryFollower
from fleet_helpers import delete_app
from routing.directory_feed import DirectoryFeed
from routing.router_metrics import RouterMetrics
from routing.settings import RoutingSettings
from routing.view import RouterView
from waiting import wait_until

APP = "drain"
POLL_S = 120.0  # longer than every deadline below
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def drain_directory(ray_cluster) -> Iterator:
    """A directory of its own (no workers, no ingress: only its long polls matter here)."""
    handle = serve.run(AdapterDirectoryActor.bind(), name=APP, route_prefix=None)
    yield handle
    delete_app(APP)


def long_polls(handle) -> int:
    return handle.view.remote().result(timeout_s=DEADLINE_S)["long_polls"]


def test_stopping_callers_withdraw_their_long_polls(drain_directory, background_loop):
    handle, loop = drain_directory, background_loop
    follower = RegistryFollower(handle, poll_timeout_s=POLL_S)
    follow = asyncio.run_coroutine_threadsafe(follower.run(), loop)
    feed = DirectoryFeed(RoutingSettings(poll_timeout_s=POLL_S, metrics_export_interval_s=POLL_S), RouterView(),
                         RouterMetrics(), lambda since, timeout_s, plan: handle.get_changes.remote(since, timeout_s, plan))
    feed.ensure_running(loop)
    wait_until(lambda: long_polls(handle) == 2, DEADLINE_S, "the follower's and the feed's polls to wait")

    follow.cancel()  # what a worker's or the ingress's __del__ does
    loop.call_soon_threadsafe(follower.withdraw)
    feed.stop()
    wait_until(lambda: long_polls(handle) == 0, DEADLINE_S, "the withdrawn polls to leave the directory",
               detail=lambda: f"{long_polls(handle)} still waiting")
    feed._thread.join(DEADLINE_S)
    assert not feed._thread.is_alive()

"""A router's feed from the AdapterDirectory: a long poll on its own thread, paced by traffic.

Why a thread: a DeploymentHandle created and called inside the router's event loop would wait on
that same loop, so the feed makes blocking calls here and hands each reply to the loop with
``call_soon_threadsafe``. Why paced: under traffic the next poll waits for ``requests_per_poll``
routed requests (or ``poll_timeout_s``), so the feed's cost per request stays bounded whatever the
request rate. An idle router keeps a long poll outstanding: it costs one call per change (at most one
per ``min_poll_interval_s``) or per ``poll_timeout_s``, and a plan change made while idle (a newly
registered adapter's placement) reaches the router before the first request for it. The same
thread exports the router's metrics every ``metrics_export_interval_s``.

No Ray here: the router hands in ``send(since_version, timeout_s, plan_version) -> PendingPoll`` (the
directory's ``get_changes`` in flight: Serve's ``DeploymentResponse``) and the metrics to export.

Why the feed holds its poll in flight: a stopping process withdraws it (``stop``, ``stop_feeds``). The
directory counts a long poll as an ongoing request, and Serve stops a replica only once none is left: a
poll from a caller that is gone kept a deleted app's directory draining for up to ``poll_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from typing import Callable, Mapping, Optional, Protocol

from .settings import RoutingSettings
from .view import RouterView

log = logging.getLogger("ray.serve")

REPLY_MARGIN_S = 10.0  # a poll's reply is awaited its own timeout plus this (the directory may be slow to answer)
# Polls that were out when this process's Ray was shut down, kept until the process ends: Ray raises SystemExit in
# the thread blocked on one, and releasing its object reference afterwards makes Ray's core worker end the process
# on the spot ("The core worker has already been shutdown ... The process will exit", exit status 1).
_left_behind: list = []
_feeds: weakref.WeakSet = weakref.WeakSet()  # this process's feeds (and wait exchanges), for ``stop_feeds``


class FeedClosed(Exception):
    """Raised by ``send`` when the transport is gone for good (this process's Ray was shut down): the feed ends."""


class PendingPoll(Protocol):
    """A directory long poll in flight (Serve's ``DeploymentResponse``)."""

    def result(self, *, timeout_s: Optional[float] = None) -> Mapping: ...

    def cancel(self) -> None: ...


SendPoll = Callable[[int, float, int], PendingPoll]


def stop_feeds() -> None:
    """Stop every feed in this process and withdraw their polls: called by a replica on its graceful stop,
    when its process is about to exit (the routers of its handles get no stop of their own from Serve)."""
    for feed in list(_feeds):
        feed.stop()


def stopped_with_feeds(thing) -> None:
    """``thing.stop()`` runs with ``stop_feeds`` (a router's other thread that calls the directory)."""
    _feeds.add(thing)


class ExportedMetrics(Protocol):
    lag_s: float

    def export(self) -> None: ...


class DirectoryFeed:
    def __init__(self, settings: RoutingSettings, view: RouterView, metrics: ExportedMetrics, send: SendPoll):
        self.settings, self.view, self.metrics, self.send = settings, view, metrics, send
        self.routed = 0  # requests routed so far (paces the feed)
        self._routed_at_poll = -settings.requests_per_poll  # the first poll goes out at once
        self._due = threading.Event()  # set once requests_per_poll requests were routed since the last poll
        self._thread: Optional[threading.Thread] = None
        self._epoch_seen: Optional[str] = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # guards _poll against a stop between sending a poll and holding it
        self._poll: Optional[PendingPoll] = None
        _feeds.add(self)

    def ensure_running(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the feed thread once (again if it died), handing replies to ``loop``; never after ``stop``."""
        if not self._stopped.is_set() and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._run, args=(loop,), name="lorafleet-router-feed", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop polling and withdraw the poll in flight, so the directory does not wait out its timeout for a
        caller that is leaving. The thread ends within a moment (at once if it was waiting)."""
        with self._lock:
            self._stopped.set()
            poll, self._poll = self._poll, None
        self._due.set()
        if poll is not None:
            poll.cancel()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def request_routed(self) -> None:
        """One more request routed: a poll is due after ``requests_per_poll`` of them."""
        self.routed += 1
        if self.routed - self._routed_at_poll >= self.settings.requests_per_poll:
            self._due.set()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        s = self.settings
        version = -1
        exported = last_poll = time.monotonic() - s.poll_timeout_s  # the first poll goes out at once
        while not loop.is_closed() and not self._stopped.is_set():
            # under traffic, sleep until it makes a poll due (request_routed sets the event) or the period ends;
            # idle (nothing routed since the last poll), poll again at once: the long poll itself waits for a change
            if self.routed != self._routed_at_poll:
                self._due.wait(max(0.0, min(last_poll + s.poll_timeout_s,
                                            exported + s.metrics_export_interval_s) - time.monotonic()))
            else:
                self._due.set()
            now = time.monotonic()
            if now - exported >= s.metrics_export_interval_s:
                exported = now
                last = self.view.last_update
                self.metrics.lag_s = now - last if last else 0.0
                self._export_metrics()
            if not self._due.is_set() and now - last_poll < s.poll_timeout_s:
                continue  # woken to export metrics only
            if now - last_poll < s.min_poll_interval_s and self._stopped.wait(s.min_poll_interval_s - (now - last_poll)):
                break
            self._due.clear()
            self._routed_at_poll, last_poll = self.routed, time.monotonic()
            try:
                reply = self._poll_once(version, min(s.poll_timeout_s, s.metrics_export_interval_s))
                if reply is None:
                    break  # stopped
                version = reply["version"] if "full" in reply or reply.get("epoch") == self._epoch_seen else -1
                self._epoch_seen = reply.get("epoch")
                loop.call_soon_threadsafe(self.view.apply_directory_reply, reply)
            except (SystemExit, FeedClosed):  # this process's Ray was shut down (SystemExit: while our poll was out)
                break
            except Exception as exc:  # keep routing on what we have; try again shortly (a withdrawn poll ends here)
                if self._stopped.is_set():
                    break
                log.debug("lorafleet router: directory poll failed: %r", exc)
                version = -1
                self._stopped.wait(1.0)

    def _poll_once(self, version: int, timeout_s: float) -> Optional[Mapping]:
        """One long poll, held where ``stop`` can withdraw it; None once stopped."""
        with self._lock:
            if self._stopped.is_set():
                return None
            poll = self._poll = self.send(version, timeout_s, self.view.plan_version)
        try:
            return poll.result(timeout_s=timeout_s + REPLY_MARGIN_S)
        except SystemExit:
            _left_behind.append(poll)  # freed now, its reference's release would end the process (see _left_behind)
            raise
        finally:
            with self._lock:
                if self._poll is poll:
                    self._poll = None

    def _export_metrics(self) -> None:
        try:
            self.metrics.export()
        except Exception as exc:  # metrics must never stop the feed
            log.debug("lorafleet router: metrics export failed: %r", exc)

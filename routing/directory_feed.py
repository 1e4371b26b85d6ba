"""A router's feed from the AdapterDirectory: a long poll on its own thread, paced by traffic.

Why a thread: a DeploymentHandle created and called inside the router's event loop would wait on
that same loop, so the feed makes blocking calls here and hands each reply to the loop with
``call_soon_threadsafe``. Why paced: under traffic the next poll waits for ``requests_per_poll``
routed requests (or ``poll_timeout_s``), so the feed's cost per request stays bounded whatever the
request rate. An idle router keeps a long poll outstanding: it costs one call per change (at most one
per ``min_poll_interval_s``) or per ``poll_timeout_s``, and a plan change made while idle (a newly
registered adapter's placement) reaches the router before the first request for it. The same
thread exports the router's metrics every ``metrics_export_interval_s``.

No Ray here: the router hands in ``call(since_version, timeout_s, plan_version) -> reply`` (the
directory's ``get_changes``) and the metrics to export.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Mapping, Optional, Protocol

from .settings import RoutingSettings
from .view import RouterView

log = logging.getLogger("ray.serve")

GetChanges = Callable[[int, float, int], Mapping]


class ExportedMetrics(Protocol):
    lag_s: float

    def export(self) -> None: ...


class DirectoryFeed:
    def __init__(self, settings: RoutingSettings, view: RouterView, metrics: ExportedMetrics, call: GetChanges):
        self.settings, self.view, self.metrics, self.call = settings, view, metrics, call
        self.routed = 0  # requests routed so far (paces the feed)
        self._routed_at_poll = -settings.requests_per_poll  # the first poll goes out at once
        self._due = threading.Event()  # set once requests_per_poll requests were routed since the last poll
        self._thread: Optional[threading.Thread] = None
        self._epoch_seen: Optional[str] = None

    def ensure_running(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the feed thread once (again if it died), handing replies to ``loop``."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, args=(loop,), name="lorafleet-router-feed", daemon=True)
            self._thread.start()

    def request_routed(self) -> None:
        """One more request routed: a poll is due after ``requests_per_poll`` of them."""
        self.routed += 1
        if self.routed - self._routed_at_poll >= self.settings.requests_per_poll:
            self._due.set()

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        s = self.settings
        version = -1
        exported = last_poll = time.monotonic() - s.poll_timeout_s  # the first poll goes out at once
        while not loop.is_closed():
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
            if now - last_poll < s.min_poll_interval_s:
                time.sleep(s.min_poll_interval_s - (now - last_poll))
            self._due.clear()
            self._routed_at_poll, last_poll = self.routed, time.monotonic()
            try:
                reply = self.call(version, min(s.poll_timeout_s, s.metrics_export_interval_s), self.view.plan_version)
                version = reply["version"] if "full" in reply or reply.get("epoch") == self._epoch_seen else -1
                self._epoch_seen = reply.get("epoch")
                loop.call_soon_threadsafe(self.view.apply_directory_reply, reply)
            except Exception as exc:  # keep routing on what we have; try again shortly
                log.debug("lorafleet router: directory poll failed: %r", exc)
                version = -1
                time.sleep(1.0)

    def _export_metrics(self) -> None:
        try:
            self.metrics.export()
        except Exception as exc:  # metrics must never stop the feed
            log.debug("lorafleet router: metrics export failed: %r", exc)

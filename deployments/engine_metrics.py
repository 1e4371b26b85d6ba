"""Per-replica request-lifecycle metrics: cancellations and the engine's queue, pushed once a second."""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge


class EngineMetrics:
    def __init__(self) -> None:
        self.cancelled = Counter("lorafleet_requests_cancelled_total",
                                 description="Requests dropped from the engine because their caller went away")
        self.waiting = Gauge("lorafleet_engine_waiting_requests", description="Requests waiting for a batch slot")
        self.running = Gauge("lorafleet_engine_running_requests", description="Requests in the running batch")
        self._last_cancelled = 0

    def update(self, stats: dict) -> None:
        """``stats`` is ``LoRAEngine.stats()``."""
        if stats["cancelled"] > self._last_cancelled:
            self.cancelled.inc(stats["cancelled"] - self._last_cancelled)
            self._last_cancelled = stats["cancelled"]
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])

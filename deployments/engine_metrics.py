"""Per-replica engine metrics: cancellations, the engine's queue, and which fast paths serve.

The queue and cancellations are pushed once a second. The fast paths are decided once, at
start (``engine.fast_paths``), and exported as a gauge of 1 per (path, used) pair, so an
operator sees a replica that fell back to torch (a missing compiler, a kernel the card
refuses) without reading its log.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge


class EngineMetrics:
    def __init__(self) -> None:
        self.cancelled = Counter("lorafleet_requests_cancelled_total",
                                 description="Requests dropped from the engine because their caller went away")
        self.waiting = Gauge("lorafleet_engine_waiting_requests", description="Requests waiting for a batch slot")
        self.running = Gauge("lorafleet_engine_running_requests", description="Requests in the running batch")
        self.fast_path = Gauge("lorafleet_engine_fast_path",
                               description="1 for the path each engine fast path serves on (attention: flashinfer "
                                           "or torch; lora_kernels: triton or torch), as the start-up check decided",
                               tag_keys=("path", "used", "intended"))
        self._last_cancelled = 0

    def update(self, stats: dict) -> None:
        """``stats`` is ``LoRAEngine.stats()``."""
        if stats["cancelled"] > self._last_cancelled:
            self.cancelled.inc(stats["cancelled"] - self._last_cancelled)
            self._last_cancelled = stats["cancelled"]
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])
        for path, decision in stats["fast_paths"].items():
            self.fast_path.set(1, tags={"path": path, "used": decision["used"], "intended": decision["intended"]})

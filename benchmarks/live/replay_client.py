"""Open-loop trace replay from one process (one router): each request is sent at its arrival time.

Why open loop: a trace's bursts are the load; a closed-loop client would wait for the fleet
and hide its queueing. Requests carry their prompt as token ids (random, so no two share a
prefix) and ``ignore_eos``, so prompt and output lengths are the trace's. The worker's
``generate_timed`` reports the wall-clock time of the first token (client and workers share
one machine's clock), which gives TTFT without streaming every token back.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Optional

import ray


@ray.remote(num_cpus=0)
class ReplayClient:
    def __init__(self, app: str, deployment: str, multiplexed: bool):
        from ray import serve

        self.handle = serve.get_deployment_handle(deployment, app_name=app)
        self.multiplexed = multiplexed

    def pid(self) -> int:
        return os.getpid()

    def decisions(self) -> dict:
        """This process's router's decision counts by kind (the affinity router only; empty for Serve's)."""
        from testkit.clients import router_decisions

        return router_decisions()

    def model_id_sightings(self) -> list[tuple[str, str, float]]:
        """When this process's Serve router first saw each replica's multiplexed model ids since the last call
        (``benchmarks.live.model_id_lag``; empty under the other routers)."""
        from benchmarks.live.model_id_lag import SIGHTINGS

        return SIGHTINGS.take()

    async def run(self, requests: list[tuple[float, str, list[int], int]], start_at: float) -> dict:
        """``(arrival s, adapter, prompt token ids, max_tokens)`` each; sending starts at wall time ``start_at``."""
        from engine.request import GenerateRequest

        n = len(requests)
        ttft: list[Optional[float]] = [None] * n
        e2e: list[Optional[float]] = [None] * n
        replicas: list[Optional[str]] = [None] * n
        arrived: list[Optional[float]] = [None] * n  # seconds from sending to reaching the replica
        ready: list[Optional[float]] = [None] * n    # ... to the adapter being ready there
        errors: list[str] = []

        async def one(i: int, adapter: str, ids: list[int], max_tokens: int) -> None:
            sent = time.time()
            handle = self.handle.options(multiplexed_model_id=adapter) if self.multiplexed else self.handle
            request = GenerateRequest(adapter=adapter, token_ids=ids, max_tokens=max_tokens, ignore_eos=True)
            try:
                out = await handle.generate_timed.remote(request)
                ttft[i] = out["first_token_at"] - sent
                e2e[i] = time.time() - sent
                replicas[i] = out["result"].replica_id
                arrived[i], ready[i] = out["arrived_at"] - sent, out["ready_at"] - sent
            except Exception as exc:  # counted and reported, never silently dropped
                errors.append(f"{type(exc).__name__}: {str(exc)[-300:]}")

        cpu = time.process_time()
        tasks = []
        for i, (at, adapter, ids, max_tokens) in enumerate(requests):
            delay = start_at + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i, adapter, ids, max_tokens)))
        await asyncio.gather(*tasks)
        return {"ttft": ttft, "e2e": e2e, "replicas": replicas, "arrived": arrived, "ready": ready, "errors": errors,
                "wall_s": time.time() - start_at, "cpu_s": time.process_time() - cpu}

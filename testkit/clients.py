"""Closed-loop load generators for ``routing_live``, each in its own process with its own router.

Serve creates one request router per handle-holding process, so the number of client
actors is the number of routers: one reproduces a single proxy or driver, three the
"many routers" case (ingress replicas, proxies on several nodes). Each client reports
its own CPU seconds (``time.process_time``: every thread, the router's included), which
is the cost of routing in the process that hosts the router.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Optional

import ray


@ray.remote(num_cpus=0)
class LoadClient:
    def __init__(self, app: str, deployment: str, multiplexed: bool):
        from ray import serve

        self.handle = serve.get_deployment_handle(deployment, app_name=app)
        self.multiplexed = multiplexed

    def pid(self) -> int:
        return os.getpid()

    async def run(self, requests: list[tuple[str, str, int]], concurrency: int, stream: bool = False) -> dict:
        """Send ``(adapter, prompt, max_tokens)`` requests from ``concurrency`` closed-loop clients;
        ``stream``: through ``generate_stream``, timing the first token too (``ttfts``)."""
        from engine.request import GenerateRequest, GenerateResult

        latencies = [0.0] * len(requests)
        ttfts = [0.0] * len(requests)
        replicas: list[Optional[str]] = [None] * len(requests)
        sent_at = [0.0] * len(requests)  # wall clock (time.time), comparable across client processes
        errors: list[str] = []
        next_index = 0

        def handle_for(adapter: str):
            return self.handle.options(multiplexed_model_id=adapter) if self.multiplexed else self.handle

        async def send(i: int, adapter: str, prompt: str, max_tokens: int, started: float) -> GenerateResult:
            request = GenerateRequest(adapter=adapter, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
            if not stream:
                return await handle_for(adapter).generate.remote(request)
            result = None
            async for item in handle_for(adapter).options(stream=True).generate_stream.remote(request):
                if not ttfts[i]:
                    ttfts[i] = time.perf_counter() - started
                result = item
            return result

        async def client():
            nonlocal next_index
            while next_index < len(requests):
                i = next_index
                next_index += 1
                started = time.perf_counter()
                sent_at[i] = time.time()
                try:
                    result = await send(i, *requests[i], started)
                    replicas[i] = result.replica_id
                except Exception as exc:  # counted and reported, never silently dropped
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                latencies[i] = time.perf_counter() - started

        cpu, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
        return {"latencies": latencies, "ttfts": ttfts if stream else [], "replicas": replicas, "errors": errors,
                "sent_at": sent_at,
                "wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}

    def decisions(self) -> dict:
        """This process's router's decision counts (our router only; empty for Serve's)."""
        return router_decisions()


def split(items: list, parts: int) -> list[list]:
    """Round-robin: part ``k`` gets items ``k, k + parts, ...`` (every router sees the same mix)."""
    return [items[k::parts] for k in range(parts)]


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal integers, larger first."""
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


def router_decisions() -> dict:
    """Decision counts by kind of the affinity routers in this process (``routing.router_metrics``: what
    ``lorafleet_router_decisions_total`` counts here; empty where Serve's own routers route). A client actor
    holds one handle, so these are its router's."""
    from routing.router_metrics import decision_counts

    return decision_counts()

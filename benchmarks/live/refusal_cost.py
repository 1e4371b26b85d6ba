"""Benchmark-only: a replica's CPU per send it refuses and per queue-length probe it answers.

Why: Serve's own routers send to a replica their cache says has room, and the replica refuses
when it is at ``max_ongoing_requests``; they probe replicas whose count they do not know. Each
refusal and each probe is an actor call the replica's process handles on the core its engine
steps on, so the simulator (``benchmarks.sim.serve_cache.ServeTimes``) must charge it. Measured
directly: one replica with ``max_ongoing_requests=1`` holds a request, and this process sends it
what Serve's router sends (``handle_request_with_rejection`` with a request's metadata and a
payload the size of ``routing_live``'s, and ``get_num_ongoing_requests``) as fast as two callers
can, for a few seconds each; the replica's CPU in that window above the same window idle, over
the refusals and probes the replica itself counted (its ``_can_accept_request`` and
``get_num_ongoing_requests`` wrapped, Serve 2.60's private names: checked, failing by name).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import statistics
import time
import uuid

APP = "refusal-cost"
WINDOW_S = 4.0
CALLERS = 2


def _install_counters() -> None:
    """Count this replica process's refusals and probes (once)."""
    import ray.serve._private.replica as replica

    impl = getattr(replica, "Replica", None)
    missing = [n for n in ("_can_accept_request", "get_num_ongoing_requests") if not hasattr(impl, n)]
    if missing:
        raise RuntimeError(f"this Ray Serve has no Replica.{missing} in ray.serve._private.replica: "
                           f"update benchmarks/live/refusal_cost.py")
    if getattr(replica, "_lorafleet_refusal_counts", None) is not None:
        return
    counts = replica._lorafleet_refusal_counts = {"refusals": 0, "probes": 0}
    can, probe = impl._can_accept_request, impl.get_num_ongoing_requests

    def counted_can(self, metadata):
        accepted = can(self, metadata)
        counts["refusals"] += not accepted
        return accepted

    def counted_probe(self):
        counts["probes"] += 1
        return probe(self)

    impl._can_accept_request, impl.get_num_ongoing_requests = counted_can, counted_probe


def held_deployment():
    from ray import serve

    @serve.deployment(max_ongoing_requests=1, ray_actor_options={"num_cpus": 0})
    class HeldReplica:
        """Holds its one row for as long as asked; counts what it refused and answered meanwhile."""

        def __init__(self):
            _install_counters()

        def pid(self) -> int:
            return os.getpid()

        async def hold(self, seconds: float) -> None:
            await asyncio.sleep(seconds)

        async def generate(self, request) -> int:
            return 0

        def counts(self) -> dict:
            import ray.serve._private.replica as replica

            return dict(replica._lorafleet_refusal_counts)

    return HeldReplica


async def _send_until(actor, deadline: float, kind: str, payload) -> None:
    from ray.serve._private.common import RequestMetadata

    while time.monotonic() < deadline:
        if kind == "refusal":
            metadata = RequestMetadata(request_id=str(uuid.uuid4()), internal_request_id=str(uuid.uuid4()),
                                       call_method="generate", app_name=APP)
            replies = actor.handle_request_with_rejection.options(num_returns="streaming").remote(
                pickle.dumps(metadata), payload)
            info = pickle.loads(await (await replies.__anext__()))
            if info.accepted:
                raise RuntimeError("the held replica accepted a send: it was not at max_ongoing_requests")
        elif kind == "probe":
            await actor.get_num_ongoing_requests.remote()
        else:
            await asyncio.sleep(0.01)


def measure_refusal_cost(payload, rounds: int = 3, window_s: float = WINDOW_S) -> dict:
    """Replica CPU milliseconds per refused send and per probe (the median over ``rounds``), and the rates.
    Needs Ray and Serve started; deploys and deletes its own app."""
    import psutil
    import ray
    from ray import serve

    handle = serve.run(held_deployment().bind(), name=APP, route_prefix=None)
    try:
        proc = psutil.Process(handle.pid.remote().result())
        names = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if "REPLICA" in a["name"] and APP in a["name"]]
        actor = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])

        def cpu_s() -> float:
            t = proc.cpu_times()
            return t.user + t.system

        async def window(kind: str) -> tuple[float, float, dict]:
            counted = await handle.counts.remote()  # before the hold: a call while held would be refused
            held = handle.hold.remote(window_s + 1.5)
            await asyncio.sleep(0.5)
            before, started = cpu_s(), time.monotonic()
            await asyncio.gather(*(_send_until(actor, started + window_s, kind, payload) for _ in range(CALLERS)))
            wall, spent = time.monotonic() - started, cpu_s() - before
            await held
            after = await handle.counts.remote()  # (Serve's own probes for these calls: a few in thousands)
            return spent, wall, {k: after[k] - counted[k] for k in after}

        per = {"refusal": [], "probe": []}
        rates = {"refusal": [], "probe": []}
        for _ in range(rounds):
            idle_cpu, idle_wall, _ = asyncio.run(window("idle"))
            for kind, key in (("refusal", "refusals"), ("probe", "probes")):
                spent, wall, counted = asyncio.run(window(kind))
                n = counted[key]
                extra = spent - idle_cpu * wall / idle_wall
                per[kind].append(1000.0 * extra / max(1, n))
                rates[kind].append(n / wall)
        return {"refusal_cpu_ms": statistics.median(per["refusal"]), "probe_cpu_ms": statistics.median(per["probe"]),
                "refusals_per_s": statistics.median(rates["refusal"]), "probes_per_s": statistics.median(rates["probe"])}
    finally:
        serve.delete(APP)

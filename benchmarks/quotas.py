"""Fleet-wide per-adapter quotas through three ingress replicas: no false refusals, no over-admits.

Why: a quota split into per-replica shares refused requests the fleet had room for, because
Serve's proxy spreads requests over ingress replicas. With one owner of each count the fleet
should refuse only when it is at the limit. Phases, one adapter each (so a worker's queue is that
adapter's in-flight count):

1. sequential: one client, ``max_concurrency`` 1, ``--sequential`` requests one after another
   (every refusal is false: nothing else is in flight);
2. for each quota q in 1, 2, 10: ``2q + 2`` closed-loop clients for ``--seconds``.

A refusal is counted false when fewer than q admitted requests overlapped it in time (those are
the only ones that can have held the q leases when it was refused; a lower bound that never counts
a justified refusal). Over-admits are sampled at the worker (its engine's running plus waiting
requests, every ``--sample-ms``) and at the lease owner (leases held), and counted when above q.

    python -m benchmarks.quotas [--quick] [--json PATH] [--seconds S] [--sequential N]
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx

from benchmarks import common
from benchmarks.rollout import admin, start_local_serve

APP = "quotas-bench"
INGRESS_REPLICAS = 3
QUOTAS = (1, 2, 10)
MAX_TOKENS = 12


@dataclass
class Outcome:
    """One request as its client saw it."""

    sent: float
    done: float
    status: int


def request(client: httpx.Client, base: str, model: str) -> Outcome:
    sent = time.monotonic()
    try:
        status = client.post(f"{base}/v1/completions", json={"model": model, "prompt": "quota", "temperature": 0,
                                                             "max_tokens": MAX_TOKENS, "ignore_eos": True}).status_code
    except httpx.HTTPError:
        status = -1
    return Outcome(sent, time.monotonic(), status)


def closed_loop(base: str, model: str, clients: int, seconds: float) -> list[Outcome]:
    """``clients`` threads, each sending its next request when the last one is answered."""
    outcomes: list[Outcome] = []
    stop = time.monotonic() + seconds

    def client_loop() -> None:
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < stop:
                outcomes.append(request(client, base, model))

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def false_refusals(outcomes: list[Outcome], limit: int) -> int:
    """Refusals that fewer than ``limit`` admitted requests overlapped (so the fleet was under its limit)."""
    admitted = [o for o in outcomes if o.status == 200]
    count = 0
    for refused in (o for o in outcomes if o.status == 429):
        overlapping = sum(1 for a in admitted if a.sent < refused.done and a.done > refused.sent)
        count += overlapping < limit
    return count


class Sampler:
    """Polls the worker's in-flight count and the owner's leases held, keeping the maxima and the excesses."""

    def __init__(self, worker, replica_id: str, leases, interval_s: float):
        self.worker, self.replica_id, self.leases, self.interval_s = worker, replica_id, leases, interval_s
        self.name, self.limit = "", 0
        self.worker_max = self.owner_max = self.worker_over = self.owner_over = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def phase(self, name: str, limit: int) -> None:
        self.name, self.limit = name, limit
        self.worker_max = self.owner_max = self.worker_over = self.owner_over = self.samples = 0

    def _run(self) -> None:
        from engine.request import ReplicaTarget

        while not self._stop.is_set():
            if self.name:
                engine = self.worker.pool_state.remote(ReplicaTarget(self.replica_id)).result(timeout_s=30)["engine"]
                inflight = engine["running"] + engine["waiting"]
                held = self.leases.stats.remote().result(timeout_s=30)["held"].get(self.name, 0)
                self.worker_max, self.owner_max = max(self.worker_max, inflight), max(self.owner_max, held)
                self.worker_over += inflight > self.limit
                self.owner_over += held > self.limit
                self.samples += 1
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def phase_row(phase: str, limit: int, clients: int, outcomes: list[Outcome], sampler: Sampler,
              trips: int, local: int) -> dict:
    statuses = [o.status for o in outcomes]
    return {"phase": phase, "quota": limit, "clients": clients, "requests": len(outcomes),
            "ok": statuses.count(200), "refused": statuses.count(429),
            "errors": sum(s not in (200, 429) for s in statuses), "false_refusals": false_refusals(outcomes, limit),
            "worker_max_inflight": sampler.worker_max, "worker_overadmits": sampler.worker_over,
            "owner_max_held": sampler.owner_max, "owner_overadmits": sampler.owner_over, "samples": sampler.samples,
            "round_trips": trips, "from_spares": local}


def main(argv=None) -> dict:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=None, help="each closed-loop phase (default 30, --quick 8)")
    parser.add_argument("--sequential", type=int, default=50, help="sequential requests at quota 1 (default 50)")
    parser.add_argument("--sample-ms", type=float, default=20.0, help="worker/owner sampling period (default 20)")
    parser.add_argument("--cpus", type=int, default=4, help="CPUs for the local Ray cluster (default 4)")
    args = parser.parse_args(argv)
    seconds = args.seconds or (8.0 if args.quick else 30.0)
    all_started = time.perf_counter()

    import ray
    from ray import serve

    from deployments.app import build_fleet
    from deployments.config import AppArgs

    names = {q: f"quota-{q}" for q in QUOTAS}
    app_args = AppArgs(max_loras_per_batch=4, max_lora_rank=16, max_batch_size=16, max_tokens_limit=64,
                       max_model_len=256, host_cache_bytes=64 << 20,
                       adapters=[{"name": name, "source": f"demo:demo-{i}"} for i, name in enumerate(names.values())])
    port, base = start_local_serve(args.cpus)
    rows: list[dict] = []
    try:
        serve.run(build_fleet(app_args, {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}},
                              {"num_replicas": INGRESS_REPLICAS}), name=APP, route_prefix="/")
        ingress = serve.get_app_handle(APP)
        worker = serve.get_deployment_handle("LoRAWorker", app_name=APP)
        leases = serve.get_deployment_handle("QuotaLeases", app_name=APP)
        directory = serve.get_deployment_handle("AdapterDirectory", app_name=APP)
        (replica_id,) = directory.view.remote().result(timeout_s=60)["replicas"]
        for q, name in names.items():
            admin("PUT", f"{base}/v1/adapters/{name}/quota", json={"max_concurrency": q})
        version = directory.get_registry.remote(-1, 0.0).result(timeout_s=30)["version"]
        seen: dict[int, dict] = {}
        while len(seen) < INGRESS_REPLICAS or any(s["registry_version"] < version for s in seen.values()):
            stats = ingress.admission_stats.remote().result(timeout_s=30)
            seen[stats["pid"]] = stats
        with httpx.Client(timeout=120) as client:   # each adapter resident before its phase is timed
            for name in names.values():
                request(client, base, name)
        print(f"quotas: deployed; {INGRESS_REPLICAS} ingress replicas, 1 worker; phases of {seconds:g} s", flush=True)

        def trips() -> tuple[int, int]:
            stats: dict[int, dict] = {}
            while len(stats) < INGRESS_REPLICAS:
                s = ingress.admission_stats.remote().result(timeout_s=30)
                stats[s["pid"]] = s
            return sum(s["quota_round_trips"] for s in stats.values()), sum(s["quota_local"] for s in stats.values())

        sampler = Sampler(worker, replica_id, leases, args.sample_ms / 1000)
        sampler.start()
        before = trips()
        sampler.phase(names[1], 1)
        with httpx.Client(timeout=120) as client:
            outcomes = [request(client, base, names[1]) for _ in range(args.sequential)]
        after = trips()
        rows.append(phase_row("sequential", 1, 1, outcomes, sampler, after[0] - before[0], after[1] - before[1]))
        for q, name in names.items():
            sampler.phase(name, q)
            outcomes = closed_loop(base, name, 2 * q + 2, seconds)
            before, after = after, trips()
            rows.append(phase_row("closed-loop", q, 2 * q + 2, outcomes, sampler, after[0] - before[0],
                                  after[1] - before[1]))
            print(f"  quota {q}: {rows[-1]['ok']} ok, {rows[-1]['refused']} refused", flush=True)
        sampler.stop()
    finally:
        serve.shutdown()
        ray.shutdown()
        port.close()

    print()
    common.print_table(rows, ["phase", "quota", "clients", "requests", "ok", "refused", "errors", "false_refusals",
                              "worker_max_inflight", "worker_overadmits", "owner_max_held", "owner_overadmits",
                              "round_trips", "from_spares"],
                       title=f"max_concurrency quotas through {INGRESS_REPLICAS} ingress replicas", floatfmt=".1f")
    sequential = rows[0]
    false = sum(r["false_refusals"] for r in rows)
    over = sum(r["worker_overadmits"] + r["owner_overadmits"] for r in rows)
    errors = sum(r["errors"] for r in rows)
    goals = [
        common.goal("quota_false_refusals", false, "== 0", false == 0),
        common.goal("quota_overadmits", over, "== 0", over == 0),
        common.goal("quota_sequential_refusals", sequential["refused"], "== 0", sequential["refused"] == 0),
        common.goal("quota_errors", errors, "== 0", errors == 0),
        common.goal("quota_refusals_seen", sum(r["refused"] for r in rows[1:]), "> 0",
                    sum(r["refused"] for r in rows[1:]) > 0),   # the limits were reached: the check had teeth
    ]
    print()
    common.print_goals(goals)
    print(f"\ntotal {common.elapsed_since(all_started)}")
    if args.json:
        common.write_json(args.json, "quotas", rows, common.settings_of(args, seconds=seconds, quotas=list(QUOTAS),
                                                                        ingress_replicas=INGRESS_REPLICAS), goals=goals)
    return {"rows": rows, "goals": goals}


if __name__ == "__main__":
    main()

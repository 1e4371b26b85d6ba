"""Requests under faults on a live fleet: kill a worker, kill the directory, hang up mid-stream, then soak.

Why: serving engineers load-test a new server in its first hour by dropping connections
and killing processes; a request that had not started streaming must not be lost, a cut
stream must say so, and work nobody waits for must stop. The benchmark starts its own
local Ray cluster and Serve (HTTP proxy on a port it reserves), deploys the product app
(``deployments.app.build_fleet``) on the demo model, and drives mixed streaming and plain
completions (chat and text, concurrency 16, 30% of streams dropped by their client after
some tokens) over real HTTP through these phases:

- ``isolated``: streams dropped after their first token one at a time on an idle fleet,
  while every worker's engine counters are polled; with nothing else running, the serving
  replica's ``tokens_generated`` counts exactly the steps spent on that stream;
- ``drops``: the traffic with its drops, no kills; the engines' tokens beyond what the
  clients were sent is work done after clients went away (in-flight tokens included);
- ``worker_kill`` then ``directory_kill``: the traffic while one worker replica's actor
  and then the AdapterDirectory's are killed (``ray.kill``; Serve replaces them), with one
  small probe per adapter every 0.25 s to time recovery;
- ``soak_warmup`` then ``soak``: the traffic alone; workers' RSS is read after the warm-up
  and at the end.

Goals (JSON ``goals``): ``chaos_lost_requests`` (requests failed before streaming plus
streams cut without an error event, over drops and both kills) == 0; ``chaos_orphan_steps``
(an upper bound of the steps spent on a dropped stream after the engine counted its cancel,
max over the isolated drops; see ``chaos_outcomes.IsolatedDrop``) <= 1; ``chaos_recovery_s``
(every adapter servable for good after each kill) <= 15 s; ``soak_rss_growth`` (largest worker
RSS growth over the soak after warm-up) < 5% with 0 errors.

    python -m benchmarks.chaos [--quick] [--json PATH]

``--quick``: 2 workers, 10 isolated drops, 20 s of drops, a 30 s warm-up and a 2 minute soak
(about 5 minutes in all); the full run: 3 workers, 30 drops, 60 s, 60 s and 10 minutes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import threading
import time
from typing import Optional

from testkit.ports import HOST, reserve_port
from testkit.serve_cluster import stop_serve

from . import common
from .chaos_outcomes import (IsolatedDrop, KillRecord, Outcome, chaos_goals, orphan_rows, recovery_rows,
                             recovery_seconds, request_rows, rss_rows, unaccounted_tokens)
from .live import chaos_fleet as fleet
from .live.chaos_traffic import (RequestSpec, TrafficMix, models_listed, new_client, probe_adapters, run_traffic,
                                 send)

APP = "chaos"
ADAPTERS = tuple(f"demo-{i}" for i in range(6))
PHASES = ("drops", "worker_kill", "directory_kill", "soak_warmup", "soak")
CHAOS_PHASES = ("drops", "worker_kill", "directory_kill")
KILL_CAP_S = 90.0     # stop waiting for a recovery after this long (recovery is then inf)
SETTLE_S = 3.0        # probes keep going this long after recovery, so a relapse is seen
BEFORE_KILL_S = 3.0   # traffic runs this long before each kill
POLLERS_PER_REPLICA = 2  # threads reading each engine's counters during an isolated drop (finer brackets)


def app_args(args):
    from deployments.config import AppArgs

    return AppArgs(max_loras_per_batch=3, max_lora_rank=16, max_batch_size=8, max_tokens_limit=64,
                   max_model_len=256, host_cache_bytes=64 << 20, stream_idle_timeout_s=args.stream_idle_timeout_s,
                   request_timeout_s=60.0)


class Phase:
    """The phase label new requests get (read by every client loop)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self) -> str:
        return self.name


# ---------------------------------------------------------------------------- isolated drops


class StatsPoller(threading.Thread):
    """Reads one replica's engine counters back to back until stopped: (cancelled, tokens_generated) samples."""

    def __init__(self, replica_id: str):
        super().__init__(daemon=True)
        self.replica_id = replica_id
        self.samples: list[tuple[int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            stats = fleet.engine_stats(APP, self.replica_id)
            self.samples.append((stats["cancelled"], stats["tokens_generated"]))


def bracket_cancel(samples: list[tuple[int, int]], cancelled_before: int) -> tuple[Optional[int], Optional[int]]:
    """tokens_generated just before the cancel was counted (the most any earlier sample saw) and just after it
    (the least any later sample saw). Both counters only grow and each sample reads them together, so this
    holds in any order samples arrive, from any number of pollers."""
    before = [tokens for cancelled, tokens in samples if cancelled <= cancelled_before]
    after = [tokens for cancelled, tokens in samples if cancelled > cancelled_before]
    return (max(before) if before else None), (min(after) if after else None)


async def isolated_drop(client, replicas: list[str], adapter: str, max_tokens: int) -> IsolatedDrop:
    before = await asyncio.to_thread(fleet.wait_until_idle, APP, replicas)
    pollers = [StatsPoller(r) for r in replicas for _ in range(POLLERS_PER_REPLICA)]
    for p in pollers:
        p.start()
    while not all(p.samples for p in pollers):  # every replica read once before the request starts
        if not all(p.is_alive() for p in pollers):
            raise RuntimeError("a replica's engine counters could not be read")
        await asyncio.sleep(0.01)
    spec = RequestSpec(adapter=adapter, prompt="drop me after one token", max_tokens=max_tokens, stream=True,
                       chat=False, temperature=0.0, drop_after=1)
    outcome = await send(client, spec, "isolated")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        latest = {p.replica_id: p.samples[-1] for p in pollers}
        if any(latest[r][0] > before[r]["cancelled"] for r in replicas):
            break
    after = await asyncio.to_thread(fleet.wait_until_idle, APP, replicas)
    for p in pollers:
        p.stop.set()
    for p in pollers:
        await asyncio.to_thread(p.join)
    served = [r for r in replicas if after[r]["tokens_generated"] > before[r]["tokens_generated"]]
    if len(served) != 1:
        raise RuntimeError(f"an isolated drop should run on exactly one replica, ran on {served} ({outcome})")
    (replica,) = served
    samples = [s for p in pollers if p.replica_id == replica for s in p.samples]
    before_cancel, after_cancel = bracket_cancel(samples, before[replica]["cancelled"])
    return IsolatedDrop(tokens_received=outcome.tokens_received, tokens_start=before[replica]["tokens_generated"],
                        tokens_before_cancel=before_cancel, tokens_after_cancel=after_cancel,
                        tokens_end=after[replica]["tokens_generated"],
                        engine_steps_after_cancel=after[replica].get("max_steps_after_cancel"))


# ---------------------------------------------------------------------------- kills


async def kill_and_recover(client, target: str, workers: int, rng: random.Random) -> KillRecord:
    """Kill one worker replica (or the directory), probe every adapter until all are servable for good."""
    deployment = "LoRAWorker" if target == "worker" else "AdapterDirectory"
    actors = await asyncio.to_thread(fleet.replica_actors, APP, deployment)
    victim = rng.choice(actors)
    killed_at = await asyncio.to_thread(fleet.kill, victim)
    record = KillRecord(target, killed_at)
    stop = asyncio.Event()
    probing = asyncio.create_task(probe_adapters(client, ADAPTERS, stop, record.probes))
    while time.monotonic() - killed_at < KILL_CAP_S:
        if record.back_at is None and await asyncio.to_thread(replaced, victim, deployment, workers):
            record.back_at = time.monotonic()
        if record.back_at is not None and math.isfinite(recovery_seconds(record, ADAPTERS)):
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(SETTLE_S)
    stop.set()
    await probing
    record.adapters_listed = await models_listed(client, ADAPTERS)
    return record


def replaced(victim: fleet.ReplicaActor, deployment: str, workers: int) -> bool:
    """A new replica runs in the victim's place and the directory reports the full set of workers."""
    alive = fleet.replica_actors(APP, deployment)
    if victim.replica_id in {a.replica_id for a in alive} or not alive:
        return False
    view = fleet.directory_view(APP)
    live_workers = {a.replica_id for a in fleet.replica_actors(APP, "LoRAWorker")}
    return view is not None and len(live_workers) == workers and set(view) == live_workers


# ---------------------------------------------------------------------------- the run


async def run_phases(args, base_url: str) -> dict:
    rng = random.Random(args.seed)
    mix = TrafficMix(ADAPTERS, drop_fraction=args.drop_fraction)
    outcomes: list[Outcome] = []
    async with new_client(base_url, args.concurrency) as client:
        replicas = await asyncio.to_thread(wait_for_workers, args.workers)
        for adapter in ADAPTERS:  # every adapter read once, so phases do not time first loads
            await send(client, RequestSpec(adapter, "warm", 4, False, False, 0.0), "warm")

        isolated = []
        for i in range(args.isolated_drops):
            isolated.append(await isolated_drop(client, replicas, ADAPTERS[i % len(ADAPTERS)], 64))
        print(f"isolated drops done ({len(isolated)})", flush=True)

        phase = Phase("drops")
        before = await asyncio.to_thread(fleet.wait_until_idle, APP, replicas)
        stop = asyncio.Event()
        traffic = asyncio.create_task(run_traffic(client, mix, args.concurrency, phase, stop, outcomes, args.seed))
        await asyncio.sleep(args.drops_s)
        stop.set()
        await traffic
        after = await asyncio.to_thread(fleet.wait_until_idle, APP, replicas)
        drops = [o for o in outcomes if o.phase == "drops"]
        loaded = {"generated": fleet.total(after, "tokens_generated") - fleet.total(before, "tokens_generated"),
                  "cancelled": fleet.total(after, "cancelled") - fleet.total(before, "cancelled"),
                  "steps": fleet.total(after, "steps") - fleet.total(before, "steps"),
                  "dropped": sum(o.kind == "dropped" for o in drops)}
        loaded["unaccounted"] = unaccounted_tokens(loaded["generated"], drops)
        print(f"drops phase done ({len(drops)} requests)", flush=True)

        kills = []
        stop = asyncio.Event()
        phase = Phase("worker_kill")
        traffic = asyncio.create_task(run_traffic(client, mix, args.concurrency, phase, stop, outcomes,
                                                  args.seed + 1))
        await asyncio.sleep(BEFORE_KILL_S)
        kills.append(await kill_and_recover(client, "worker", args.workers, rng))
        print(f"worker kill done ({recovery_seconds(kills[-1], ADAPTERS):.1f} s)", flush=True)
        phase.name = "directory_kill"
        await asyncio.sleep(BEFORE_KILL_S)
        kills.append(await kill_and_recover(client, "directory", args.workers, rng))
        print(f"directory kill done ({recovery_seconds(kills[-1], ADAPTERS):.1f} s)", flush=True)
        phase.name = "soak_warmup"
        await asyncio.sleep(args.warmup_s)
        workers = await asyncio.to_thread(fleet.replica_actors, APP, "LoRAWorker")
        rss_before = fleet.rss_bytes([w.pid for w in workers])
        phase.name = "soak"
        await asyncio.sleep(args.soak_s)
        workers_after = await asyncio.to_thread(fleet.replica_actors, APP, "LoRAWorker")
        rss_after = fleet.rss_bytes([w.pid for w in workers_after])
        stop.set()
        await traffic
    return {"outcomes": outcomes, "isolated": isolated, "loaded": loaded, "kills": kills,
            "rss_before": rss_before, "rss_after": rss_after}


def wait_for_workers(workers: int, timeout_s: float = 300.0) -> list[str]:
    """Every worker replica up and reporting to the directory; their ids."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = fleet.directory_view(APP)
        if view is not None and len(view) == workers:
            return sorted(view)
        time.sleep(0.5)
    raise TimeoutError(f"{workers} workers did not report to the directory within {timeout_s:g} s")


def make_parser():
    parser = common.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, help="LoRAWorker replicas (default 3; quick 2)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--drop-fraction", type=float, default=0.3, help="streams dropped by their client")
    parser.add_argument("--isolated-drops", type=int, help="streams dropped one at a time (default 30; quick 10)")
    parser.add_argument("--drops-s", type=float, help="seconds of traffic with drops (default 60; quick 20)")
    parser.add_argument("--warmup-s", type=float, help="soak warm-up seconds (default 60; quick 30)")
    parser.add_argument("--soak-s", type=float, help="soak seconds after warm-up (default 600; quick 120)")
    parser.add_argument("--stream-idle-timeout-s", type=float, default=15.0)
    parser.add_argument("--cpus", type=int, default=8, help="logical CPUs of the local Ray cluster")
    return parser


def resolve(args):
    quick = args.quick
    args.workers = args.workers or (2 if quick else 3)
    args.isolated_drops = args.isolated_drops if args.isolated_drops is not None else (10 if quick else 30)
    args.drops_s = args.drops_s if args.drops_s is not None else (20.0 if quick else 60.0)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (30.0 if quick else 60.0)
    args.soak_s = args.soak_s if args.soak_s is not None else (120.0 if quick else 600.0)
    if not 2 <= args.workers:
        raise SystemExit("--workers must be at least 2 (one is killed)")
    return args


def report(args, result: dict) -> tuple[list[dict], list[dict]]:
    outcomes = result["outcomes"]
    loaded = result["loaded"]
    requests = request_rows(outcomes, PHASES)
    recovery = recovery_rows(result["kills"], ADAPTERS)
    orphans = orphan_rows(result["isolated"], loaded["unaccounted"], loaded["dropped"], loaded["cancelled"])
    rss = rss_rows(result["rss_before"], result["rss_after"])
    common.print_table(requests, title="\nrequests by phase (kinds: see benchmarks/chaos_outcomes.py)")
    common.print_table(recovery, title="\nrecovery after each kill", floatfmt=".2f")
    common.print_table(orphans, title="\nengine steps on dropped streams", floatfmt=".2f")
    print(f"  drops under load: {loaded['generated']} tokens generated in {loaded['steps']} engine steps, "
          f"{loaded['unaccounted']} never sent to a client; {loaded['cancelled']} engine cancels for "
          f"{loaded['dropped']} dropped streams")
    common.print_table(rss, title="\nworker RSS over the soak (after warm-up)", floatfmt=".1f")
    chaos = [o for o in outcomes if o.phase in CHAOS_PHASES]
    soak = [o for o in outcomes if o.phase == "soak"]
    goals = chaos_goals(chaos, result["kills"], ADAPTERS, result["isolated"], soak, result["rss_before"],
                        result["rss_after"])
    print()
    common.print_goals(goals)
    rows = ([{"table": "requests", **r} for r in requests] + [{"table": "recovery", **r} for r in recovery]
            + [{"table": "orphans", **r} for r in orphans] + [{"table": "rss", **r} for r in rss])
    return rows, goals


def main(argv=None) -> list[dict]:
    args = resolve(make_parser().parse_args(argv))
    started = time.perf_counter()
    from engine.demo import ensure_demo_assets

    ensure_demo_assets(num_adapters=len(ADAPTERS))  # once, before replicas race to build them
    reservation = reserve_port()
    port = reservation.getsockname()[1]
    print(f"chaos: {args.workers} workers, concurrency {args.concurrency}, {args.drop_fraction:.0%} of streams "
          f"dropped, soak {args.soak_s:g} s after {args.warmup_s:g} s warm-up; this machine has "
          f"{os.cpu_count()} CPU cores (load {os.getloadavg()[0]:.1f}) shared with everything else on it",
          flush=True)
    try:
        fleet.start_cluster(port, args.cpus)
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
        fleet.deploy(APP, args.workers, app_args(args))
        result = asyncio.run(run_phases(args, f"http://{HOST}:{port}"))
    finally:
        stop_serve()
        reservation.close()
    rows, goals = report(args, result)
    print(f"\nchaos: {common.elapsed_since(started)}")
    if args.json:
        extra = {"isolated_drops": [vars(d) for d in result["isolated"]], "loaded_drops": result["loaded"],
                 "kills": [{"target": k.target, "back_s": None if k.back_at is None else k.back_at - k.killed_at,
                            "probes": [vars(p) | {"t": p.started - k.killed_at} for p in k.probes]}
                           for k in result["kills"]]}
        common.write_json(args.json, "chaos", rows, common.settings_of(args, adapters=list(ADAPTERS)), extra,
                          goals=goals)
    return rows


if __name__ == "__main__":
    main()

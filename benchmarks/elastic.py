"""Elastic fleet, live: steady traffic while the adapter-aware autoscaler takes LoRAWorker 2 -> 3 -> 2.

Local Ray, the demo model, the app as it ships (``deployments.app.build_fleet``) with the
autoscaling policy of ``deployments/autoscaling.py`` and short delays. The scale events are
driven through the policy by the traffic's working set (``serve.run`` cannot change the replica
count without restarting every replica: each call is a new code version). The policy wants the
slots its pins hold plus 1.5 x the adapters requested in the last window. Client threads send
requests the whole time: for two demo adapters (3 slots + 1 pinned: two replicas of 3 slots hold
them), then for all six (10 slots: a third replica), then for two again while three slots are
pinned (6 slots: back to two).

- Scale-out: the new replica warms up before it takes traffic (``routing/warm_start.py``). Goal
  ``elastic_new_replica_loads`` = 0: slot loads on the new replica, after it reported ready, of the
  adapters its warm-start plan assigned to it.
- Scale-in: one pinned adapter per replica is registered first, so whichever replica Serve removes
  held a pin. Goal ``elastic_pin_restore_s`` <= 10: from the moment Serve stops running that replica
  until the survivor the pin rule names holds the pin in its pool.
- Goal ``elastic_errors`` = 0: failed requests over the whole run.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import numpy as np

from testkit.elastic import APP, HEADROOM, autoscaling, pin_one_per_replica, running_workers

from . import common

ADAPTERS = [f"demo-{i}" for i in range(6)]
NARROW = ADAPTERS[:2]
SLOTS = 3


def make_parser():
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=2, help="client threads sending requests back to back")
    parser.add_argument("--phase-s", type=float, default=None, help="traffic seconds per phase (quick: 8, else 30)")
    parser.add_argument("--cpus", type=int, default=8, help="logical CPUs for the local Ray cluster")
    parser.add_argument("--verbose", action="store_true")
    return parser


class Traffic:
    """Client threads, one request at a time each, for adapters drawn uniformly from ``names`` (settable)."""

    def __init__(self, handle, clients: int, seed: int, names: list[str]):
        from engine.request import GenerateRequest

        self.handle, self.request_cls, self.names = handle, GenerateRequest, list(names)
        self.latencies: list[tuple[float, float]] = []  # (end time, seconds)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._rngs = [np.random.default_rng(seed + i) for i in range(clients)]
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            names = self.names
            name = names[int(self._rngs[index].integers(len(names)))]
            started = time.perf_counter()
            try:
                self.handle.generate.remote(self.request_cls(adapter=name, prompt="hello", max_tokens=4)).result(
                    timeout_s=120)
                self.latencies.append((time.perf_counter(), time.perf_counter() - started))
            except Exception as exc:  # every failure is counted and reported
                self.errors.append(repr(exc))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)

    def window(self, start: float, end: float) -> dict:
        lat = [s for t, s in self.latencies if start <= t < end]
        return {"requests": len(lat), "p50_ms": 1000 * float(np.percentile(lat, 50)) if lat else None,
                "p99_ms": 1000 * float(np.percentile(lat, 99)) if lat else None}


def deploy(downscale_delay_s: float, demand_window_s: float):
    from ray import serve

    from deployments.app import build_fleet
    from deployments.config import AdapterSpec, AppArgs

    parsed = AppArgs(max_loras_per_batch=SLOTS, max_batch_size=4, max_tokens_limit=16, max_model_len=128,
                     host_cache_bytes=64 << 20, demand_window_s=demand_window_s,
                     adapters=[AdapterSpec(name=n, source=f"demo:{n}", pinned=(n == "demo-0")) for n in ADAPTERS])
    app = build_fleet(parsed, {"autoscaling_config": autoscaling(downscale_delay_s),
                               "ray_actor_options": {"num_cpus": 1}})
    return serve.run(app, name=APP, route_prefix=None)


def directory():
    from ray import serve

    return serve.get_deployment_handle("AdapterDirectory", app_name=APP)


def view_replicas() -> dict[str, dict]:
    return directory().view.remote().result(timeout_s=30)["replicas"]


def pool(replica: str) -> dict:
    from ray import serve

    from engine.request import ReplicaTarget

    return serve.get_deployment_handle("LoRAWorker", app_name=APP).pool_state.remote(
        ReplicaTarget(replica)).result(timeout_s=30)


def fleet_loads() -> int:
    counts = directory().adapter_counts.remote().result(timeout_s=30)
    return sum(c.get("load", 0) for c in counts.values())


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


def uids(handle) -> dict[str, str]:
    return {e["name"]: e["uid"] for e in handle.list_adapters.remote().result(timeout_s=30)["data"]}


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)
    phase_s = args.phase_s or (8.0 if args.quick else 30.0)
    window_s, downscale_delay_s = (6.0, 5.0) if args.quick else (20.0, 15.0)
    import ray
    from ray import serve

    from engine.demo import ensure_demo_assets
    from routing.pins import pin_holders

    ensure_demo_assets(num_adapters=len(ADAPTERS))
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    serve.start(proxy_location="Disabled")
    if not args.verbose:
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    print(f"elastic: LoRAWorker 2 -> 3 -> 2 replicas x {SLOTS} slots, driven by the adapter-aware autoscaling "
          f"policy (working set x {HEADROOM} against the slots; demand window {window_s:g} s, downscale delay "
          f"{downscale_delay_s:g} s); {args.clients} clients, {phase_s:g} s of steady traffic per phase", flush=True)
    rows, marks = [], {}
    new_replica: dict = {}
    scale_in: dict = {}
    try:
        started = time.perf_counter()
        handle = deploy(downscale_delay_s, window_s)
        two = sorted(wait_for(lambda: (v := view_replicas()) and len(v) == 2 and v, 120, "two replicas"))
        print(f"deployed 2 replicas in {time.perf_counter() - started:.1f} s", flush=True)
        traffic = Traffic(handle, args.clients, args.seed, NARROW)
        traffic.start()
        marks["steady-2 (2 adapters)"] = (time.perf_counter(), fleet_loads())
        time.sleep(phase_s)

        marks["scale-out (6 adapters)"] = (time.perf_counter(), fleet_loads())
        traffic.names = list(ADAPTERS)
        wait_for(lambda: running_workers() == 3, 180, "the policy to add a third replica")
        three = sorted(wait_for(lambda: (v := view_replicas()) and len(v) == 3 and v, 60, "three in the directory"))
        (new,) = set(three) - set(two)
        time.sleep(1.0)  # this process's router hears of the new replica before we target it
        marks["steady-3 (6 adapters)"] = (time.perf_counter(), fleet_loads())
        time.sleep(phase_s)
        state = pool(new)
        warm = state["warm_start"]
        by_name = uids(handle)
        assigned = {by_name[n] for n in warm["plan"].get("slots", []) if n in by_name}
        at_ready = warm.get("loads_by_adapter_at_ready", {})  # the pool's loads per adapter, then and now
        after = {u: n - at_ready.get(u, 0) for u, n in state["loads_by_adapter"].items()}
        new_replica = {"replica": new, "warm_s": warm["seconds"], "planned_slots": len(assigned),
                       "planned_host": len(warm["plan"].get("host", [])),
                       "assigned_loads": sum(after.get(u, 0) for u in assigned),
                       "all_loads": sum(after.values())}
        handle.unpin_adapter.remote("demo-0").result(timeout_s=30)  # one pin per replica below, slots - 1 = 2
        pinned = pin_one_per_replica(handle, three)
        by_name = uids(handle)
        wait_for(lambda: all(by_name[n] in view_replicas().get(r, {}).get("pinned", ()) for r, n in pinned.items()),
                 60, "each replica to pin its adapter")

        marks["scale-in (2 adapters)"] = (time.perf_counter(), fleet_loads())
        traffic.names = list(NARROW)
        wait_for(lambda: running_workers() < 3, 180, "the policy to remove a replica")
        removal_started = time.perf_counter()
        survivors = sorted(wait_for(lambda: (v := view_replicas()) and len(v) == 2 and v, 60, "two replicas again"))
        (gone,) = set(three) - set(survivors)
        moved = pinned[gone]
        (holder,) = pin_holders(moved, survivors, 1)
        wait_for(lambda: by_name[moved] in pool(holder)["pinned"], 120, f"{moved} pinned on {holder}")
        restore_s = time.perf_counter() - removal_started
        pins = {r: len(pool(r)["pinned"]) for r in survivors}
        scale_in = {"removed": gone, "moved_pin": moved, "to": holder, "restore_s": restore_s,
                    "over_guard": {r: n for r, n in pins.items() if n > SLOTS - 1}}
        marks["steady-2 (2 adapters) "] = (time.perf_counter(), fleet_loads())
        time.sleep(phase_s)
        marks["end"] = (time.perf_counter(), fleet_loads())
        traffic.stop()
    finally:
        serve.shutdown()
        ray.shutdown()

    names = list(marks)
    for a, b in itertools.pairwise(names):
        (t0, l0), (t1, l1) = marks[a], marks[b]
        rows.append({"phase": a, "seconds": t1 - t0, **traffic.window(t0, t1), "fleet_loads": l1 - l0})
    common.print_table(rows, ["phase", "seconds", "requests", "p50_ms", "p99_ms", "fleet_loads"], floatfmt=".1f",
                       title="Traffic per phase (scale-out / scale-in: from the working set's change until the "
                             "new replica set runs; fleet_loads: slot loads on all replicas)")
    print(f"\nnew replica {new_replica['replica']}: warm start {new_replica['warm_s']:.2f} s, "
          f"{new_replica['planned_slots']} adapters planned into slots, {new_replica['planned_host']} into the host "
          f"tier; loads after ready: {new_replica['assigned_loads']} of assigned adapters, "
          f"{new_replica['all_loads']} in all")
    print(f"scale-in: {scale_in['removed']} left; its pin {scale_in['moved_pin']} held on {scale_in['to']} "
          f"{scale_in['restore_s']:.2f} s after Serve stopped running it; replicas over slots - 1 pins: "
          f"{scale_in['over_guard'] or 'none'}")
    errors = len(traffic.errors)
    if errors:
        print(f"errors: {errors}, e.g. {traffic.errors[:2]}")
    goals = [
        common.goal("elastic_new_replica_loads", new_replica["assigned_loads"], "= 0", new_replica["assigned_loads"] == 0),
        common.goal("elastic_pin_restore_s", round(scale_in["restore_s"], 2), "<= 10", scale_in["restore_s"] <= 10),
        common.goal("elastic_errors", errors, "= 0", errors == 0),
    ]
    print()
    common.print_goals(goals)
    if args.json:
        common.write_json(args.json, "elastic", rows, common.settings_of(args, phase_s=phase_s), goals=goals,
                          extra={"new_replica": new_replica, "scale_in": scale_in, "driven_by": "autoscaling policy"})
    return rows


if __name__ == "__main__":
    main()

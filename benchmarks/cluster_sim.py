"""Fleet-scale simulation of routing and eviction: 8-1024 replicas, 100-10,000 adapters.

Why: past one machine the product runs on a Ray cluster; this shows how its routing
behaves at a scale no test here reaches, against the routers people would otherwise use.

Model (``benchmarks/sim``): a discrete-event simulation in which every replica runs the
project's own ``LoRAMemoryPool`` (slots, LRU eviction, events; no tensors) and
``engine.scheduler.Scheduler`` (admission while the batch's adapters fit the slots), the
pools' events reach a real ``AdapterDirectory`` after a lag, and "affinity" (this project's
router) decides with ``routing.view.RouterView`` + ``routing.policy.choose_replicas``.
Costs are ``benchmarks.sim.costs.CostModel``'s, charged as the engine pays them
(``benchmarks/sim/replica.py``, the same time model ``fleet_live``'s emulated GPU sleeps):
a disk read (``benchmarks.swap``'s measured seconds by rank) delays only its requester, a
host-to-slot copy stalls the replica's step, prefill is chunked under the token budget,
one decode token per step; ``max_batch`` running requests and ``slots`` adapters per
replica; multiplexing's replicas run Serve's model LRU (a load is a registration, an unload
drains). Baselines: Ray Serve multiplexing's logic, least-loaded,
plain consistent hashing, random. Workloads from ``benchmarks.traces``: S-LoRA power-law
popularity, gamma arrivals, ranks 8-64. Metrics over the requests after a warm-up.

Every router's loads are also reported against a fleet lower bound (``sim.fleet_bound``: Belady's
MIN over one cache with all the fleet's slots), and the elastic fleet is simulated
(``sim.elastic_runs``): replicas joining and leaving mid-trace, cold or warm-started as
``routing.warm_start`` plans it, and a bursty diurnal day autoscaled by ``routing.autoscale``'s
adapter-aware and queue-only rules (``--skip-elastic`` leaves these out).

With ``--live-json`` it also simulates live runs and checks that the simulation ranks the
variants as each live run did (``sim_reproduces_live_ranking``, over every run given): only
then should it be used to tune anything. A ``routing_live --json`` run is simulated with
``benchmarks.sim.cpu_fleet`` (its setup: closed-loop clients, engines and the control plane
sharing the machine's cores, each router's measured CPU per request charged); a
``fleet_live --json`` run is replayed by ``benchmarks.sim.fleet_replay`` (the same segments on
this simulator, whose time model is the emulated GPU's), with issue 25's per-cell tolerances.

    python -m benchmarks.cluster_sim [--quick] [--json PATH] [--plot PATH] [--workers N]
                                     [--live-json PATH [PATH ...]] [--skip-elastic]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import common
from .sim import SimConfig, run_sim
from .sim.costs import CostModel
from .sim.elastic_runs import elastic_tasks, report, run_elastic
from .sim.fleet_bound import bound_rows, fleet_bound
from .sim.online_floor import online_floor
from .sim.overhead import measure
from .traces import Popularity, make_trace

ROUTER_ORDER = ("affinity", "multiplex", "least_loaded", "hash", "random")
VIEW_ROUTERS = ("affinity", "multiplex")
MEAN_IN = MEAN_OUT = (8 + 511) / 2  # benchmarks.traces.request_lengths: uniform [8, 512)


@dataclass(frozen=True)
class Setting:
    """One workload and fleet; every router runs on the same trace."""

    experiment: str
    replicas: int
    adapters: int
    alpha: float = 0.3       # S-LoRA power-law popularity (smaller = more skewed; 1 = uniform)
    cv: float = 2.0          # gamma inter-arrival CV
    load: float = 0.4        # offered load: arrival rate / (replicas * max_batch / mean service time)
    lag_s: float = 0.1
    epsilon: float = 0.25    # routing.settings.RoutingSettings.tie_epsilon default
    requests: int = 0
    seed: int = 0

    @property
    def skewed(self) -> bool:
        return self.alpha <= 0.3

    def rate(self, costs: CostModel, max_batch: int) -> float:
        return self.load * self.replicas * max_batch / costs.service_seconds(MEAN_IN, MEAN_OUT)


@dataclass(frozen=True)
class Plan:
    settings: tuple[Setting, ...]
    tasks: tuple[tuple[Setting, str], ...]
    overhead_calls: int


def _s(experiment, replicas, adapters, per_replica, minimum, seed, **kw) -> Setting:
    return Setting(experiment, replicas, adapters, requests=max(minimum, per_replica * replicas), seed=seed, **kw)


def make_plan(quick: bool, seed: int, per_replica: Optional[int] = None) -> Plan:
    if quick:
        per, minimum = per_replica or 200, 3000
        fleet = [(8, 100), (32, 500), (64, 1000)]
        mid = (32, 500)
        alphas, loads, cvs, lags = (0.1, 0.6, 1.0), (0.2, 0.7), (8.0,), (0.01, 1.0)
        overhead = (3000,)
    else:
        per, minimum = per_replica or 150, 3000
        fleet = [(8, 100), (64, 1000), (256, 4000), (1024, 10000)]
        mid = (256, 4000)
        alphas, loads, cvs, lags = (0.1, 0.6, 1.0), (0.2, 0.7), (1.0, 8.0), (0.01, 1.0)
        overhead = (20000,)
    settings = [_s("fleet", r, a, per, minimum, seed) for r, a in fleet]
    settings += [_s("skew", *mid, per, minimum, seed, alpha=x) for x in alphas]
    settings += [_s("load", *mid, per, minimum, seed, load=x) for x in loads]
    settings += [_s("cv", *mid, per, minimum, seed, cv=x) for x in cvs]
    stale = [_s("stale", *mid, per, minimum, seed, lag_s=x) for x in lags]
    tune = [_s("tune", *mid, per, minimum, seed, load=x, epsilon=1.0) for x in (0.4, 0.7)]
    tasks = [(s, r) for s in settings for r in ROUTER_ORDER]
    tasks += [(s, r) for s in stale for r in VIEW_ROUTERS]
    tasks += [(s, "affinity") for s in tune]
    return Plan(tuple(settings + stale + tune), tuple(tasks), *overhead)


def run_task(task: tuple[Setting, str]) -> dict[str, Any]:
    setting, router = task
    costs = CostModel()
    config = SimConfig(replicas=setting.replicas, router=router, lag_s=setting.lag_s,
                       load_bound_epsilon=setting.epsilon, seed=setting.seed, costs=costs)
    trace = make_trace(setting.requests, setting.adapters, Popularity("power", setting.alpha),
                       rate=setting.rate(costs, config.max_batch), cv=setting.cv, seed=setting.seed)
    result = run_sim(trace, config)
    first_measured = int(len(trace) * config.warmup_fraction)
    bound = fleet_bound(trace.adapters, setting.replicas, config.slots, first_measured)
    floor = online_floor(trace.adapters, trace.popularity.probabilities(setting.adapters),
                         setting.replicas * config.slots, first_measured)
    row = {"experiment": setting.experiment, "alpha": setting.alpha, "cv": setting.cv, "load": setting.load,
           "lag_s": setting.lag_s, "epsilon": setting.epsilon, **result.row(), "kinds": result.kinds,
           "fleet_slots": bound.fleet_slots, "bound": bound.measured, "bound_total": bound.total,
           "global_lru": bound.global_lru, "online_floor": floor.realized,
           "loads_vs_bound": result.loads / max(1, bound.measured)}
    return row


def parallel_map(fn, items: Sequence, workers: int) -> list:
    if workers <= 1:
        return [fn(t) for t in items]
    with mp.get_context("fork").Pool(workers) as pool:
        return pool.map(fn, items, chunksize=1)


def run_tasks(tasks: Sequence[tuple[Setting, str]], workers: int) -> list[dict[str, Any]]:
    # biggest first so the pool's workers finish together; results go back in plan order
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i][0].requests * (3 if tasks[i][1] in VIEW_ROUTERS else 1))
    ordered = [tasks[i] for i in order]
    results = parallel_map(run_task, ordered, workers)
    rows: list[Optional[dict]] = [None] * len(tasks)
    for i, r in zip(order, results):
        rows[i] = r
    return rows  # type: ignore[return-value]


# ---------------------------------------------------------------------------- reporting

COLUMNS = ["router", "loads", "loads_per_req", "hit_ratio", "ttft_p50", "ttft_p99", "e2e_p99", "queue_p99",
           "slot_waited", "imbalance", "load_seconds", "disk_loads", "retries", "wall_seconds"]


def varied(experiment: str) -> list[str]:
    return {"fleet": ["replicas", "adapters"], "skew": ["alpha"], "load": ["load"], "cv": ["cv"],
            "stale": ["lag_s"], "tune": ["load", "epsilon"]}[experiment]


def setting_label(row: dict) -> str:
    e = row["experiment"]
    if e == "fleet":
        return f"{row['replicas']} replicas x {row['adapters']} adapters"
    return f"{e} {', '.join(f'{k}={row[k]:g}' for k in varied(e))}"


def _groups(rows: Sequence[dict], experiment: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["experiment"] == experiment:
            groups.setdefault(setting_label(r), []).append(r)
    return groups


def _winners(group: Sequence[dict], key: str, rel_tol: float = 0.01) -> str:
    best = min(r[key] for r in group)
    return "=".join(r["router"] for r in group if r[key] <= best * (1 + rel_tol) + 1e-12)


WIN_METRICS = (("loads", "fewest loads"), ("load_seconds", "least load stall"), ("ttft_p99", "lowest p99 TTFT"),
               ("e2e_p99", "lowest p99 e2e"), ("imbalance", "best balance"))


def wins_table(rows: Sequence[dict]) -> tuple[list[dict], dict[str, dict[str, int]]]:
    """Per setting, the winner of each metric (ties within 1%), and per router how often it wins."""
    table, counts = [], {r: {m: 0 for m, _ in WIN_METRICS} for r in ROUTER_ORDER}
    for experiment in ("fleet", "skew", "load", "cv"):
        for label, group in _groups(rows, experiment).items():
            entry = {"setting": label}
            for key, title in WIN_METRICS:
                w = _winners(group, key)
                entry[title] = w
                for name in w.split("="):
                    counts[name][key] += 1
            table.append(entry)
    return table, counts


def pareto_settings(rows: Sequence[dict], tol: float = 0.05) -> tuple[int, int]:
    """Settings where affinity is within ``tol`` of the best other router on both loads and p99 TTFT at once
    (one policy that wins on one and loses on the other does not count), and how many settings there are."""
    won = total = 0
    for experiment in ("fleet", "skew", "load", "cv"):
        for group in _groups(rows, experiment).values():
            ours = [r for r in group if r["router"] == "affinity"]
            peers = [r for r in group if r["router"] != "affinity"]
            if not ours or not peers:
                continue
            total += 1
            a = ours[0]
            won += all(a[key] <= min(p[key] for p in peers) * (1 + tol) + 1e-12 for key in ("loads", "ttft_p99"))
    return won, total


def markdown_wins(table: Sequence[dict], counts: dict[str, dict[str, int]], affinity_vs_ll: Sequence[dict]) -> str:
    titles = ["setting"] + [t for _, t in WIN_METRICS]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    lines += ["| " + " | ".join(str(e[t]) for t in titles) + " |" for e in table]
    n = len(table)
    lines += ["", "| router | " + " | ".join(t for _, t in WIN_METRICS) + " |", "|" + "---|" * (len(WIN_METRICS) + 1)]
    for r in ROUTER_ORDER:
        lines.append(f"| {r} | " + " | ".join(f"{counts[r][k]}/{n}" for k, _ in WIN_METRICS) + " |")
    lines += ["", "| setting | affinity loads vs least-loaded | affinity p99 TTFT / least-loaded |", "|---|---|---|"]
    for g in affinity_vs_ll:
        lines.append(f"| {g['setting']} | {-100 * g['load_cut']:+.0f}% | {g['ttft_p99_affinity']:.2f} s / "
                     f"{g['ttft_p99_least_loaded']:.2f} s |")
    return "\n".join(lines)


def affinity_vs_least_loaded(rows: Sequence[dict]) -> list[dict]:
    out = []
    for experiment in ("fleet", "skew", "load", "cv"):
        for label, group in _groups(rows, experiment).items():
            by = {r["router"]: r for r in group}
            a, ll = by["affinity"], by["least_loaded"]
            out.append({"setting": label, "skewed": a["alpha"] <= 0.3, "load_cut": 1 - a["loads"] / max(1, ll["loads"]),
                        "ttft_p99_affinity": a["ttft_p99"], "ttft_p99_least_loaded": ll["ttft_p99"],
                        "e2e_p99_affinity": a["e2e_p99"], "e2e_p99_least_loaded": ll["e2e_p99"]})
    return out


def stale_rows(rows: Sequence[dict]) -> list[dict]:
    """Affinity and multiplex at each lag (the default-lag runs come from the load/fleet settings)."""
    stale = [r for r in rows if r["experiment"] == "stale"]
    if not stale:
        return []
    mid = (stale[0]["replicas"], stale[0]["adapters"])
    base = [r for r in rows if r["experiment"] == "skew" or r["experiment"] == "fleet"]
    base = [r for r in base if (r["replicas"], r["adapters"]) == mid and r["alpha"] == 0.3 and r["cv"] == 2.0
            and r["load"] == 0.4 and r["router"] in VIEW_ROUTERS]
    out = sorted(stale + base, key=lambda r: (r["router"] != "affinity", r["lag_s"]))
    ref = {r["router"]: r for r in out if r["lag_s"] == min(x["lag_s"] for x in out)}
    return [{**r, "extra_loads_vs_fastest": r["loads"] - ref[r["router"]]["loads"],
             "ttft_p99_vs_fastest": r["ttft_p99"] - ref[r["router"]]["ttft_p99"]} for r in out]


def plot(rows: Sequence[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    styles = {"affinity": "o-", "multiplex": "s--", "least_loaded": "^-", "hash": "v:", "random": "x-."}
    fleet = [r for r in rows if r["experiment"] == "fleet"]
    mid = None
    skew = [r for r in rows if r["experiment"] == "skew"]
    if skew:
        mid = (skew[0]["replicas"], skew[0]["adapters"])
        skew += [r for r in fleet if (r["replicas"], r["adapters"]) == mid]
    for col, (key, label) in enumerate((("loads_per_req", "adapter loads per request"),
                                        ("ttft_p99", "p99 time to first token (s)"))):
        for name in ROUTER_ORDER:
            sel = sorted((r for r in fleet if r["router"] == name), key=lambda r: r["replicas"])
            axes[0][col].plot([r["replicas"] for r in sel], [r[key] for r in sel], styles[name], label=name)
            sel = sorted((r for r in skew if r["router"] == name), key=lambda r: r["alpha"])
            axes[1][col].plot([r["alpha"] for r in sel], [r[key] for r in sel], styles[name], label=name)
        axes[0][col].set_xscale("log", base=2)
        axes[0][col].set_xlabel("replicas (adapters: " +
                                ", ".join(f"{r['adapters']}" for r in sorted(
                                    (r for r in fleet if r["router"] == "affinity"), key=lambda r: r["replicas"]))
                                + ")", fontsize=8)
        axes[1][col].set_xlabel("power-law alpha (smaller = more skewed; 1 = uniform)"
                                + (f", {mid[0]} x {mid[1]} adapters" if mid else ""), fontsize=8)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_ylabel(label, fontsize=9)
            if key == "ttft_p99":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Simulated fleet: adapter loads and p99 TTFT by router (alpha 0.3, CV 2, load 0.4, lag 100 ms "
                 "unless varied)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def routing_live_check(path: str, live: dict) -> tuple[list[dict], int, int]:
    """Simulate a routing_live run's cells (``benchmarks.sim.live_check``): (rows, pairs alike, pairs ordered)."""
    from .sim.cpu_fleet import CpuFleetConfig, measure_engine_steps
    from .sim.live_check import SEEDS, ranking_agreement, simulate_live

    step = measure_engine_steps()
    rows = simulate_live(live, step)
    print()
    common.print_table(rows, ["setting", "cost", "concurrency", "variant", "live_req_per_s", "sim_req_per_s",
                              "live_p50_ms", "sim_p50_ms", "live_p99_ms", "sim_p99_ms", "sim_loads_per_1k",
                              "live_workers_cpu_ms", "sim_workers_cpu_ms", "engine_share", "sim_refusals_per_request",
                              "sim_idle_share", "step_scale"], floatfmt=".2f",
                       title=f"== the live fleet in simulation ({path}): engine step {1e3 * step.base_s:.2f} ms + "
                             f"{1e3 * step.per_seq_s:.3f} ms per running request + {1e3 * step.per_adapter_s:.3f} ms "
                             f"per adapter beyond the first (measured here; x step_scale, the "
                             f"run's own engine CPU per step over it at concurrency 1 where recorded), each variant's "
                             f"control-plane CPU per request from the run, on {CpuFleetConfig().cores:g} shared cores; "
                             f"Serve's routers on its queue-length cache (benchmarks/sim/serve_cache.py; compare the "
                             f"refusals and idle share with benchmarks.serve_release); mean of {SEEDS} seeds")
    agreed, ordered, wrong = ranking_agreement(rows)
    for line in wrong:
        print(f"  disagrees: {line}")
    return rows, agreed, ordered


def fleet_live_check(path: str, live: dict) -> tuple[list[dict], int, int]:
    """Replay a fleet_live run (``benchmarks.sim.fleet_replay``): (agreement rows, pairs alike, pairs ranked)."""
    from .sim.fleet_replay import (agreement_with_live, live_deploys, live_host_costs, live_model_id_delays,
                                   live_replica_ids, live_starts, replay_fleet_live)

    live_rows = live["rows"]
    variants = sorted({r["variant"] for r in live_rows})
    # as fleet_live replays itself: on the live machine's CPU count (the workers' read threads)
    sim_rows = replay_fleet_live(live["metadata"]["settings"], variants, starts=live_starts(live_rows),
                                cpu_count=(live["metadata"].get("machine") or {}).get("cpu_count"),
                                host_costs=live_host_costs(live_rows),
                                replica_ids=live_replica_ids(live_rows, live["metadata"]["settings"]["replicas"]),
                                model_id_delays=live_model_id_delays(live_rows), deploys=live_deploys(live_rows))
    agreement = agreement_with_live(live_rows, sim_rows)
    print()
    common.print_table(agreement["rows"], floatfmt=".0f",
                       title=f"== fleet_live replayed ({path}): live vs sim loads and TTFT ms, within 10% / 25%")
    for r in agreement["rankings"]:
        if not r["same"]:
            print(f"  disagrees: {r['segment']} {r['metric']}: live {r['live']}, sim {r['sim']}")
    print(f"  {agreement['summary']}")
    return agreement["rows"], agreement["pairs_ok"], agreement["pairs"]


def live_check(paths: Sequence[str]) -> tuple[list[dict], dict]:
    """Simulate each live run (``routing_live`` or ``fleet_live`` JSON); the ranking goal over all of them."""
    import json

    rows: list[dict] = []
    agreed = ordered = 0
    for path in paths:
        live = json.loads(open(path).read())
        check = fleet_live_check if live["metadata"].get("benchmark") == "fleet_live" else routing_live_check
        more, a, o = check(path, live)
        rows += [{"source": path, **r} for r in more]
        agreed, ordered = agreed + a, ordered + o
    share = agreed / ordered if ordered else None
    return rows, common.goal("sim_reproduces_live_ranking", None if share is None else round(share, 3),
                             "== 1.0 (share of live-ordered pairs, every --live-json run)",
                             None if share is None else agreed == ordered)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = common.base_parser(__doc__.split("\n\n")[0], plot=True)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes for the simulations (default: min(2, CPUs))")
    parser.add_argument("--per-replica", type=int, help="requests per replica (default 150; 200 with --quick)")
    parser.add_argument("--skip-overhead", action="store_true", help="do not time the routing decision")
    parser.add_argument("--skip-elastic", action="store_true", help="no scale-event or autoscaling runs")
    parser.add_argument("--live-json", metavar="PATH", nargs="+", action="extend",
                        help="routing_live and/or fleet_live --json runs: simulate each and check the rankings match")
    parser.add_argument("--live-only", action="store_true", help="with --live-json: only that check")
    args = parser.parse_args(argv)
    if args.live_only:
        if not args.live_json:
            parser.error("--live-only needs --live-json")
        live_rows, agreement = live_check(args.live_json)
        print()
        common.print_goals([agreement])
        if args.json:
            common.write_json(args.json, "cluster_sim", live_rows, common.settings_of(args), goals=[agreement])
        return 0
    plan = make_plan(args.quick, args.seed, args.per_replica)
    started = time.perf_counter()
    costs = CostModel()
    cfg = SimConfig()
    print(f"model: slots {cfg.slots}/replica, max_batch = max_ongoing {cfg.max_batch}, LRU, host tier "
          f"{costs.host_cache_bytes / 1e9:g} GB/replica, prefill {costs.prefill_s_per_token * 1e3:g} ms/token, "
          f"decode {costs.decode_s_per_token * 1e3:g} ms/token; adapter load s (host, disk) by rank: "
          + ", ".join(f"r{r}=({h * 1e3:.1f} ms, {d * 1e3:.0f} ms)" for r, (h, d) in costs.load_table.items())
          + " [benchmarks.swap, measured]; warm-up: first 25% of requests not counted")

    overhead: list[dict] = []
    if not args.skip_overhead:  # first, alone, so the simulations do not share the CPU with the timing
        for n in (64, 1024):
            overhead += measure(n, 10_000, calls=plan.overhead_calls,
                                seed=args.seed)

    rows = run_tasks(plan.tasks, args.workers)
    elastic = [] if args.skip_elastic else elastic_tasks(args.quick, args.seed)
    # the autoscaling runs are the longest: first, so the workers finish together
    elastic_rows = parallel_map(run_elastic, sorted(elastic, key=lambda t: t[0] != "autoscale"), args.workers)
    for experiment, title in (("fleet", "fleet size (adapters grow with it)"), ("skew", "skew"),
                              ("load", "offered load"), ("cv", "arrival burstiness (gamma CV)")):
        sel = [r for r in rows if r["experiment"] == experiment]
        if not sel:
            continue
        s0 = sel[0]
        print()
        common.print_table(
            sel, varied(experiment) + COLUMNS, floatfmt=".3g",
            title=(f"== {title}: {s0['replicas'] if experiment != 'fleet' else '8-1024'} replicas, "
                   f"alpha {s0['alpha'] if experiment != 'skew' else 'varied'}, CV {s0['cv'] if experiment != 'cv' else 'varied'}, "
                   f"load {s0['load'] if experiment != 'load' else 'varied'}, lag {s0['lag_s'] * 1e3:g} ms, "
                   f"{s0['requests']} measured requests each. Seconds: ttft (arrival -> first token), e2e, "
                   f"queue (arrival -> admitted to a batch), load_seconds (disk reads the requests "
                   f"waited for + slot copies their batches stalled for, summed); slot_waited = share that waited "
                   f"in the engine's queue for a row or an adapter slot; wall = simulator CPU s"))

    st = stale_rows(rows)
    if st:
        print()
        common.print_table(
            st, ["router", "lag_s", "loads", "hit_ratio", "ttft_p99", "e2e_p99", "imbalance", "load_seconds",
                 "extra_loads_vs_fastest", "ttft_p99_vs_fastest"], floatfmt=".3g",
            title=(f"== stale view: pool event -> router view after lag_s (delivered in batches every lag_s), "
                   f"{st[0]['replicas']} replicas x {st[0]['adapters']} adapters, alpha 0.3, load 0.4; "
                   f"the other routers use no view"))
    tune = [r for r in rows if r["experiment"] == "tune"]
    if tune:
        base = [r for r in rows if r["router"] == "affinity" and r["replicas"] == tune[0]["replicas"]
                and r["adapters"] == tune[0]["adapters"] and r["alpha"] == 0.3 and r["cv"] == 2.0
                and r["lag_s"] == 0.1 and r["load"] in (0.4, 0.7) and r["experiment"] in ("fleet", "skew", "load")]
        mux = [r for r in rows if r["router"] == "multiplex" and r["experiment"] in ("fleet", "load")
               and r["replicas"] == tune[0]["replicas"] and r["load"] in (0.4, 0.7) and r["alpha"] == 0.3]
        print()
        common.print_table(sorted(base + tune, key=lambda r: (r["load"], r["epsilon"])) + mux,
                           ["router", "load", "epsilon", "loads", "hit_ratio", "ttft_p99", "e2e_p99", "imbalance",
                            "load_seconds"], floatfmt=".3g",
                           title="== tuning: affinity's load_bound_epsilon (RoutingSettings.tie_epsilon) 0.25 vs 1.0, multiplex for reference")

    if overhead:
        print()
        common.print_table(overhead, ["replicas", "adapters", "kind", "calls", "median_us", "p99_us", "mean_us", "note"],
                           floatfmt=".3g",
                           title="== routing decision, in-process, microseconds per call (10,000 adapters, "
                                 "8 slots/replica full, power-law alpha 0.3)")

    bounds = bound_rows(rows, ROUTER_ORDER)
    print()
    common.print_table(bounds, ["experiment", "replicas", "adapters", "alpha", "load", "cv", "fleet_slots", "bound",
                                *ROUTER_ORDER, "global_lru", "online_floor", "bound_total", "affinity_total"],
                       floatfmt=".3g",
                       title="== fleet lower bound: Belady's MIN over one cache of replicas x slots (no router can "
                             "load less); bound = measured requests, cache starting with the best contents; each "
                             "router's measured loads / bound; global_lru: one LRU cache of every slot with no "
                             "routing constraint (the pools evict LRU; MIN sees the future) / bound; online_floor: A0, "
                             "the fewest loads any online policy expects on independent requests (sim.online_floor) / "
                             "bound; bound_total and affinity_total: the whole run from empty slots")

    elastic_goals, elastic_extra = report(elastic_rows, elastic)

    comparison = affinity_vs_least_loaded(rows)
    table, counts = wins_table(rows)
    skewed = [g for g in comparison if g["skewed"]]
    fails = [g for g in skewed if not (g["load_cut"] >= 0.5 and g["ttft_p99_affinity"] <= g["ttft_p99_least_loaded"])]
    worst_cut = min((g["load_cut"] for g in skewed), default=None)
    goals = [common.goal("sim_loads_vs_least_loaded_under_skew", None if worst_cut is None else round(worst_cut, 3),
                         ">= 0.5 fewer, p99 TTFT no worse", (not fails) if skewed else None)]
    worse_e2e = [g["setting"] for g in skewed if g["e2e_p99_affinity"] > g["e2e_p99_least_loaded"]]
    print(f"\naffinity vs least-loaded under skew: load cut {100 * (worst_cut or 0):.0f}% at worst over {len(skewed)} "
          f"settings" + (f"; failing: {[g['setting'] for g in fails]}" if fails else "")
          + f"; p99 end-to-end also no worse in {len(skewed) - len(worse_e2e)}/{len(skewed)}"
          + (f" (worse in {worse_e2e})" if worse_e2e else ""))
    default = [b["affinity"] for b in bounds if b["experiment"] == "fleet"]
    worst = max(default, default=None)
    goals.append(common.goal("sim_loads_vs_fleet_bound", None if worst is None else round(worst, 3),
                             "<= 1.5 (affinity loads / fleet bound, default setting, worst fleet size)",
                             None if worst is None else worst <= 1.5))
    floors = [b["online_floor"] for b in bounds if b["experiment"] == "fleet"]
    goals.append(common.goal("sim_online_floor_vs_fleet_bound", round(max(floors), 3) if floors else None,
                             "reported (A0's loads / fleet bound, worst fleet size: no online router expects fewer "
                             "loads, so a sim_loads_vs_fleet_bound target below this is out of reach)", None))
    goals += elastic_goals
    big = [r for r in overhead if r["replicas"] == 1024 and r["kind"] == "policy"]
    goals.append(common.goal("sim_decision_median_us_1024_replicas", round(big[0]["median_us"], 1) if big else None,
                             "<= 20", big[0]["median_us"] <= 20 if big else None))
    settings_won = len(table)
    pareto, pareto_of = pareto_settings(rows)
    goals.append(common.goal("sim_pareto_settings", pareto, f">= 8 of {pareto_of} (within 5% of the best peer on "
                                                            "loads and p99 TTFT at once)",
                             pareto >= 8 if pareto_of else None))
    for name, key, need in (("sim_fewest_loads_settings", "loads", 8), ("sim_lowest_p99_ttft_settings", "ttft_p99", 7)):
        won = counts["affinity"][key]
        goals.append(common.goal(name, won, f">= {need} of {settings_won}", won >= need if settings_won else None))
    live_rows: list[dict] = []
    if args.live_json:
        live_rows, agreement = live_check(args.live_json)
        goals.append(agreement)
    else:
        goals.append(common.goal("sim_reproduces_live_ranking", None, "every live-ordered pair", None))
    md = markdown_wins(table, counts, comparison)
    print()
    common.print_goals(goals)
    print()
    print("### Where each router wins (simulated fleet, `python -m benchmarks.cluster_sim" + (" --quick" if args.quick else "") + "`)")
    print()
    print(md)
    print(f"\n({common.elapsed_since(started)}, {args.workers} worker processes)")

    settings = common.settings_of(args, sim=dict((k, v) for k, v in vars(cfg).items() if k != "costs"),
                                  costs=costs.describe(), settings=[vars(s) for s in plan.settings])
    if args.json:
        common.write_json(args.json, "cluster_sim", rows, settings,
                          {"overhead": overhead, "stale": st, "wins": table, "win_counts": counts,
                           "affinity_vs_least_loaded": comparison, "fleet_bound": bounds, **elastic_extra,
                           "readme_table": md, "live_check": live_rows},
                          goals=goals)
    png = common.plot_path(args)
    if png:
        plot(rows, png)
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Latency, throughput, loads and control-plane CPU on a live local Ray Serve fleet: this router vs Serve's own.

Why: users feel latency and throughput, and a serving engineer compares a custom router
against what Ray Serve already ships before adopting it. Three variants, the same engine,
pool, slot count and trace, deployed side by side and measured in turns (each row of one
variant right after the same row of the others, so drift on a shared machine hits all; at low
concurrency, where the variants are close, a cell's trace is cut in up to ``MAX_TURNS`` slices
and the variants alternate slice by slice, ``turns_for``):

- ``affinity``: the product as it ships (``deployments.app.build_fleet``), requests routed
  by ``routing.ray_router:AdapterAffinityRouter`` (expected completion time);
- ``multiplexed``: Ray Serve's model multiplexing (``@serve.multiplexed`` with
  ``max_num_models_per_replica`` = slots, ``multiplexed_model_id`` per request;
  ``benchmarks/live/multiplexed_worker.py``);
- ``pow2``: the product's workers behind Serve's default router (power of two choices).

Axes: ``setting`` -- ``fits`` (the adapters fit the fleet's slots) and ``skew`` (more
adapters than slots, S-LoRA ``power(alpha)`` popularity); ``cost`` -- ``cheap`` (the demo's
own loads, ~0.1 ms) and ``expensive`` (each load costs what a Llama-3-8B rank-16 adapter
costs on a GPU host: a 4.8 ms host-tier copy, an 88 ms disk read; injected in the
workers' load path by a benchmark-only subclass, ``benchmarks/live/load_cost.py``);
``concurrency`` -- closed-loop clients; ``routers`` -- 1 or 3 client processes, each with
its own router (Serve runs one per proxy and ingress replica).

Columns: loads per 1000 measured requests (every replica's pool loads; a
``multiplexed`` load is a full registration), client-side p50/p99 and req/s, and CPU
milliseconds per request of the processes involved: the clients (the processes hosting
the routers), the directory, the node's metrics agent and the workers. Warm-up passes
are excluded.

Goals (JSON ``goals``, over every setting, cost and concurrency of the run):
``live_throughput_vs_best_peer`` >= 1.0, ``live_p50_vs_best_peer`` <= 1.05,
``live_p99_vs_best_peer`` <= 1.0, ``live_c64_lead_cheap`` >= 1.5 and ``live_c64_lead_expensive``
>= 3.0 (req/s over the best peer's at concurrency 64), ``live_loads_vs_multiplexed`` <= 0.33 (where
multiplexing loads at all), ``live_expensive_p99_vs_best_peer`` <= 0.8,
``router_cpu_per_request_vs_default`` <= 1.1 (affinity's clients / pow2's, the same
worker and trace), ``live_multi_router_loads_ratio`` <= 1.2 (3 routers / 1).

    python -m benchmarks.routing_live [--quick] [--json PATH] [--plot PATH]

``--quick``: skew only, concurrency 1 and 64, 200 requests per row at concurrency 1 (60 left
run-to-run swings of 10-30% at concurrency 1) and 8 per client slot above (3 per client left
the same commit's affinity row at 58-72 req/s at concurrency 64 on a quiet machine; about six
minutes on a quiet machine). The benchmark starts
its own local Ray cluster with Serve's HTTP proxy disabled.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from . import common
from .live.imbalance import busiest_share
from .traces import Popularity, make_trace

APP_PREFIX = "routing-live"
VARIANTS = ("affinity", "multiplexed", "pow2")
PEERS = ("multiplexed", "pow2")
CONCURRENCY = (1, 8, 64)
COSTS = ("cheap", "expensive")
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
MULTI_ROUTERS = 3
MAX_TURNS = 4  # alternating turns per one-router cell (``turns_for``)


@dataclass(frozen=True)
class Setting:
    name: str
    num_adapters: int
    alpha: float


def settings_for(slots_total: int, args) -> list[Setting]:
    fits = min(args.fits_adapters, slots_total)
    return [Setting("fits", fits, args.alpha), Setting("skew", args.skew_adapters, args.alpha)]


def build_requests(setting: Setting, n: int, seed: int) -> list[tuple[str, str, int]]:
    """``(adapter, prompt, max_tokens)``: S-LoRA ``power(alpha)`` adapters (id 0 hottest), 8-32
    character prompts, 8-16 new tokens."""
    trace = make_trace(n, setting.num_adapters, Popularity("power", setting.alpha), seed=seed,
                       input_range=(8, 33), output_range=(8, 17))
    rng = np.random.default_rng(seed + 7919)
    requests = []
    for adapter, n_in, n_out in zip(trace.adapters.tolist(), trace.input_lens.tolist(), trace.output_lens.tolist()):
        prompt = "".join(rng.choice(LETTERS, size=int(n_in)).tolist()).strip() or "hello"
        requests.append((f"demo-{adapter}", prompt, int(n_out)))
    return requests


def requests_per_row(concurrency: int, args) -> int:
    """Enough requests that every closed-loop client sends several (8: the ramp at the start and the tail at
    the end, when fewer than ``concurrency`` requests are out, are a small part of the row)."""
    return max(args.requests or (200 if args.quick else 600), 8 * concurrency)


# ---------------------------------------------------------------------------- variants


def app_args(num_adapters: int, args, follow_plan: bool = True):
    """``follow_plan``: whether the workers keep and read ahead the directory's placement plan; off behind
    Serve's default router, which does not route by it (as ``fleet_live`` runs its peers: a plan the router
    ignores would only hold slots its traffic needs)."""
    from deployments.config import AdapterSpec, AppArgs

    return AppArgs(max_loras_per_batch=args.slots, max_lora_rank=16, max_batch_size=args.max_batch_size,
                   max_tokens_limit=64, max_model_len=256, host_cache_bytes=64 << 20,
                   routing={"tie_epsilon": args.load_bound_epsilon}, replicas_follow_plan=follow_plan,
                   adapters=[AdapterSpec(name=f"demo-{i}", source=f"demo:demo-{i}") for i in range(num_adapters)])


class Variant:
    """One deployed variant: its app, its client processes (one router each) and its load counter."""

    def __init__(self, name: str, args, num_adapters: int):
        self.name = name
        self.args = args
        self.parsed = app_args(num_adapters, args, follow_plan=name == "affinity")
        self.app = f"{APP_PREFIX}-{name}"
        self.multiplexed = name == "multiplexed"
        self.deployment = "MultiplexedLoRAWorker" if self.multiplexed else "LoRAWorker"
        self.clients: list = []

    def application(self):
        from ray.serve.config import RequestRouterConfig

        from deployments.app import build_fleet

        from .live.load_cost import LoadCostLoRAWorker, LoadCostMultiplexedWorker
        from .live.multiplexed_worker import build_multiplexed

        options = {"num_replicas": self.args.replicas, "ray_actor_options": {"num_cpus": 1}}
        if self.multiplexed:
            return build_multiplexed(self.parsed, {**options, "func_or_class": LoadCostMultiplexedWorker})
        options["func_or_class"] = LoadCostLoRAWorker
        if self.name == "pow2":
            options["request_router_config"] = RequestRouterConfig()  # Serve's default router
        return build_fleet(self.parsed, options)

    def deploy(self) -> float:
        """Deploy the app and wait until every worker reports; returns seconds."""
        from ray import serve

        started = time.perf_counter()
        serve.run(self.application(), name=self.app, route_prefix=None)
        self.loads()
        return time.perf_counter() - started


    def set_load_cost(self, cost) -> None:
        """The injected load cost on every replica (``benchmarks/live/load_cost.py``), without a redeploy."""
        from ray import serve

        from engine.request import ReplicaTarget

        handle = serve.get_deployment_handle(self.deployment, app_name=self.app)
        if self.name == "affinity":  # our router delivers a ReplicaTarget to that replica
            directory = serve.get_deployment_handle("AdapterDirectory", app_name=self.app)
            for rid in directory.view.remote().result()["replicas"]:
                handle.set_injected_load_cost.remote(ReplicaTarget(rid), cost.host_s, cost.disk_s).result()
        else:  # Serve's routers pick at random: ask until every replica has answered
            sample_replicas(lambda: handle.set_injected_load_cost.remote(None, cost.host_s, cost.disk_s),
                            self.args.replicas)

    def engine_counters(self) -> dict[str, float]:
        """Steps, rows stepped and engine-thread CPU seconds summed over the replicas so far
        (``benchmarks/live/load_cost.py``): what a row's engine did, read around it."""
        from ray import serve

        from engine.request import ReplicaTarget

        handle = serve.get_deployment_handle(self.deployment, app_name=self.app)
        if self.name == "affinity":
            directory = serve.get_deployment_handle("AdapterDirectory", app_name=self.app)
            snaps = [handle.engine_counters.remote(ReplicaTarget(rid)).result()
                     for rid in directory.view.remote().result()["replicas"]]
        else:
            snaps = list(sample_replicas(lambda: handle.engine_counters.remote(None), self.args.replicas).values())
        return {key: sum(s[key] for s in snaps) for key in ("steps", "rows_stepped", "engine_cpu_s")}

    def ensure_clients(self, count: int) -> list:
        from testkit.clients import LoadClient

        while len(self.clients) < count:
            self.clients.append(LoadClient.remote(self.app, self.deployment, self.multiplexed))
        return self.clients[:count]

    def loads(self) -> int:
        """Slot loads over the whole fleet so far (the directory's event counts; the baseline's own counters)."""
        from ray import serve

        if self.multiplexed:
            handle = serve.get_deployment_handle(self.deployment, app_name=self.app)
            stats = sample_replicas(lambda: handle.stats.remote(), self.args.replicas)
            return sum(s["counters"]["loads"] for s in stats.values())
        directory = serve.get_deployment_handle("AdapterDirectory", app_name=self.app)
        deadline = time.monotonic() + 60
        while len(directory.view.remote().result()["replicas"]) < self.args.replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.app}: not every worker reported to the directory within 60 s")
            time.sleep(0.2)
        counts = directory.adapter_counts.remote().result()
        return sum(c.get("load", 0) for c in counts.values())


def deploy_all(variants: list[Variant]) -> float:
    """Deploy every variant's app at once (their replicas start in parallel); returns seconds."""
    from ray.serve.api import RunTarget, run_many

    started = time.perf_counter()
    run_many([RunTarget(v.application(), name=v.app, route_prefix=None) for v in variants])
    for v in variants:
        v.loads()  # every worker up and reporting
    return time.perf_counter() - started

def sample_replicas(call, expected: int, timeout_s: float = 60.0) -> dict[str, dict]:
    """Ask until every replica has answered once (for routers that ignore ``ReplicaTarget``)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(seen)} of {expected} replicas answered within {timeout_s:.0f}s")
        snap = call().result()
        seen.setdefault(snap["replica_id"], snap)
    return seen


# ---------------------------------------------------------------------------- one row


def run_clients(clients: list, requests: list, concurrency: int, stream: bool = False) -> dict:
    """Split the trace round-robin over the clients (their routers) and the concurrency over them too."""
    import ray

    from testkit.clients import shares, split

    parts = split(requests, len(clients))
    results = ray.get([c.run.remote(p, s, stream)
                       for c, p, s in zip(clients, parts, shares(concurrency, len(clients)))])
    return {"latencies": [x for r in results for x in r["latencies"]],
            "ttfts": [x for r in results for x in r["ttfts"]],
            "replicas": [x for r in results for x in r["replicas"]],
            "sent_at": [x for r in results for x in r["sent_at"]],
            "errors": [x for r in results for x in r["errors"]],
            # each router's own median: with several routers, whether one's requests wait while another's run
            "router_p50_ms": [round(1000.0 * float(np.median(r["latencies"])), 1) if r["latencies"] else None
                              for r in results],
            "wall_s": max(r["wall_s"] for r in results), "cpu_s": sum(r["cpu_s"] for r in results)}


def measure_part(variant: Variant, meter, routers: int, requests: list, concurrency: int) -> dict:
    """One turn of ``variant`` on ``requests``: its clients' results and the counters read around them."""
    import ray

    clients = variant.ensure_clients(routers)
    decisions_before = [Counter(d) for d in ray.get([c.decisions.remote() for c in clients])]
    loads_before = variant.loads()
    engine_before = variant.engine_counters()
    meter.start()
    result = run_clients(clients, requests, concurrency)
    cpu = meter.stop()
    engine = {k: v - engine_before[k] for k, v in variant.engine_counters().items()}
    loads = variant.loads() - loads_before
    decisions = sum((Counter(d) - b for d, b in zip(ray.get([c.decisions.remote() for c in clients]),
                                                      decisions_before)), Counter())
    return {"result": result, "cpu": cpu, "engine": engine, "loads": loads, "decisions": decisions,
            "n": len(requests)}


def merge_parts(parts: Sequence[dict]) -> dict:
    """Several turns of one variant as one: lists joined, seconds, counters and CPU summed (one router)."""
    if len(parts) == 1:
        return parts[0]
    results = [p["result"] for p in parts]
    result = {key: [x for r in results for x in r[key]] for key in ("latencies", "ttfts", "replicas", "sent_at",
                                                                     "errors")}
    result.update(wall_s=sum(r["wall_s"] for r in results), cpu_s=sum(r["cpu_s"] for r in results),
                  router_p50_ms=[round(1000.0 * float(np.median(result["latencies"])), 1)
                                 if result["latencies"] else None])
    add = lambda key: {k: sum(p[key].get(k, 0.0) for p in parts) for k in parts[0][key]}  # noqa: E731
    return {"result": result, "cpu": add("cpu"), "engine": add("engine"), "loads": sum(p["loads"] for p in parts),
            "decisions": sum((p["decisions"] for p in parts), Counter()), "n": sum(p["n"] for p in parts)}


def row_of(variant: Variant, setting: Setting, cost: str, concurrency: int, routers: int, part: dict) -> dict:
    """A table row from a variant's (merged) turns."""
    result, cpu, engine, loads, decisions, n = (part[k] for k in ("result", "cpu", "engine", "loads", "decisions",
                                                                  "n"))
    ok = np.array([lat for lat, rep in zip(result["latencies"], result["replicas"]) if rep is not None])
    per_replica = Counter(r for r in result["replicas"] if r is not None)
    per_request = lambda seconds: 1000.0 * seconds / n  # noqa: E731
    row = {
        "setting": setting.name, "cost": cost, "routers": routers, "variant": variant.name,
        "concurrency": concurrency, "requests": n,
        "loads_per_1k": 1000.0 * loads / n,
        "p50_ms": 1000.0 * float(np.percentile(ok, 50)) if len(ok) else math.nan,
        "p99_ms": 1000.0 * float(np.percentile(ok, 99)) if len(ok) else math.nan,
        "req_per_s": n / result["wall_s"],
        "router_p50_ms": "/".join(str(x) for x in result["router_p50_ms"]),
        "router_cpu_ms": per_request(result["cpu_s"]),
        "directory_cpu_ms": per_request(cpu.get(f"{variant.app}/AdapterDirectory", 0.0)),
        "metrics_agent_cpu_ms": per_request(cpu.get("metrics_agent", 0.0)),
        "workers_cpu_ms": per_request(cpu.get(f"{variant.app}/{variant.deployment}", 0.0)),
        # the workers' engine threads alone, and the mean batch of their steps (the simulator prices steps by them)
        "engine_cpu_ms": per_request(engine["engine_cpu_s"]),
        "rows_per_step": engine["rows_stepped"] / engine["steps"] if engine["steps"] else math.nan,
        "steps_per_request": engine["steps"] / n,
        "per_replica": "/".join(str(c) for c in sorted(per_replica.values(), reverse=True)),
        # the busiest replica's share (%) of the outstanding requests, p90 over send instants: the closed loop's drift
        "busiest_pct": _percent(busiest_share(result["sent_at"], result["latencies"], result["replicas"])),
        "errors": len(result["errors"]),
        "spill": decisions.get("spill", 0) + decisions.get("prefill_spill", 0) if variant.name == "affinity" else None,
        "waits": decisions.get("wait", 0) if variant.name == "affinity" else None,
        # JSON only
        "loads": loads, "wall_s": result["wall_s"], "decisions": dict(decisions),
        "replica_requests": dict(per_replica), "error_samples": result["errors"][:3],
    }
    print(f"  {setting.name:>4} {cost:>9} r={routers} {variant.name:>11} c={concurrency:<3} "
          f"loads/1k={row['loads_per_1k']:6.1f} p50={row['p50_ms']:7.1f} p99={row['p99_ms']:7.1f} ms "
          f"{row['req_per_s']:5.1f} req/s router cpu {row['router_cpu_ms']:5.1f} ms/req errors={row['errors']}",
          flush=True)
    return row


def measure_row(variant: Variant, meter, setting: Setting, cost: str, concurrency: int, routers: int,
                requests: list) -> dict:
    """``variant`` on ``requests`` in one turn."""
    return row_of(variant, setting, cost, concurrency, routers,
                  measure_part(variant, meter, routers, requests, concurrency))


def turns_for(concurrency: int, requests: int) -> int:
    """How many turns a cell's one-router rows take: the variants alternate, each turn a slice of the trace.

    Why: this machine's speed drifts by a fifth within a minute (engine CPU per batch-1 step 2.0 to 3.1 ms across
    one run's concurrency-1 rows), and at concurrency 1 the variants are within a few percent of each other, so a
    row measured in one stretch ranks the minute, not the router. Alternating slices give every variant the same
    mix of fast and slow stretches. A turn keeps at least 16 requests per client (a closed loop's start and end)."""
    return min(MAX_TURNS, max(1, requests // (16 * concurrency)))


def measure_cell(variants: Sequence[Variant], meter, setting: Setting, cost: str, concurrency: int,
                 requests: list) -> list[dict]:
    """One row per variant (one router), measured in ``turns_for`` alternating turns over slices of
    ``requests`` (turn k starts with variant k mod V), each row the turns merged."""
    turns = turns_for(concurrency, len(requests))
    bounds = np.linspace(0, len(requests), turns + 1).astype(int)
    parts: dict[str, list[dict]] = {v.name: [] for v in variants}
    for k in range(turns):
        chunk = requests[bounds[k]:bounds[k + 1]]
        for v in list(variants[k % len(variants):]) + list(variants[:k % len(variants)]):
            parts[v.name].append(measure_part(v, meter, 1, chunk, concurrency))
    return [row_of(v, setting, cost, concurrency, 1, merge_parts(parts[v.name])) for v in variants]


def _percent(share: float) -> Optional[int]:
    return None if math.isnan(share) else round(100 * share)


# ---------------------------------------------------------------------------- goals


def _ratio(num: float, den: float) -> float:
    if den == 0:
        return math.inf if num > 0 else 1.0
    return num / den


def _groups(rows: list[dict], routers: int = 1) -> dict[tuple, dict[str, dict]]:
    """(setting, cost, concurrency) -> variant -> row, for rows with ``routers`` routers."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["routers"] == routers:
            out.setdefault((r["setting"], r["cost"], r["concurrency"]), {})[r["variant"]] = r
    return out


def _worst(values: list[tuple[float, str]], higher_is_worse: bool) -> tuple[Optional[float], str]:
    if not values:
        return None, ""
    value, where = (max if higher_is_worse else min)(values, key=lambda v: v[0])
    return value, where


def goals(rows: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """The issue's goals (each measured value is the worst over the run's rows) and where each worst was."""
    throughput, p50, p99, loads, expensive, cpu, multi = [], [], [], [], [], [], []
    lead = {"cheap": [], "expensive": []}  # req/s vs the best peer at the highest concurrency
    for (setting, cost, c), by in _groups(rows).items():
        where = f"{setting}/{cost}/c={c}"
        a = by.get("affinity")
        peers = [by[p] for p in PEERS if p in by]
        if a is None or not peers:
            continue
        throughput.append((a["req_per_s"] / max(p["req_per_s"] for p in peers), where))
        if c >= 64 and cost in lead:
            lead[cost].append(throughput[-1])
        p50.append((a["p50_ms"] / min(p["p50_ms"] for p in peers), where))
        p99.append((a["p99_ms"] / min(p["p99_ms"] for p in peers), where))
        if cost == "expensive":
            expensive.append((a["p99_ms"] / min(p["p99_ms"] for p in peers), where))
        mux = by.get("multiplexed")
        if mux is not None and mux["loads"] > 0:
            loads.append((a["loads_per_1k"] / mux["loads_per_1k"], where))
        if "pow2" in by:
            cpu.append((_ratio(a["router_cpu_ms"], by["pow2"]["router_cpu_ms"]), where))
    one = {k: v.get("affinity") for k, v in _groups(rows, 1).items()}
    for key, by in _groups(rows, MULTI_ROUTERS).items():
        a3, a1 = by.get("affinity"), one.get(key)
        if a3 is not None and a1 is not None:
            multi.append((_ratio(a3["loads"], a1["loads"]), f"{key[0]}/{key[1]}/c={key[2]}"))
    out, where_of = [], {}
    for name, values, target, worse_high, ok in (
            ("live_throughput_vs_best_peer", throughput, ">= 1.0", False, lambda v: v >= 1.0),
            ("live_p50_vs_best_peer", p50, "<= 1.05", True, lambda v: v <= 1.05),
            ("live_p99_vs_best_peer", p99, "<= 1.0", True, lambda v: v <= 1.0),
            ("live_c64_lead_cheap", lead["cheap"], ">= 1.5", False, lambda v: v >= 1.5),
            ("live_c64_lead_expensive", lead["expensive"], ">= 3.0", False, lambda v: v >= 3.0),
            ("live_loads_vs_multiplexed", loads, "<= 0.33", True, lambda v: v <= 0.33),
            ("live_expensive_p99_vs_best_peer", expensive, "<= 0.8", True, lambda v: v <= 0.8),
            ("router_cpu_per_request_vs_default", cpu, "<= 1.1", True, lambda v: v <= 1.1),
            ("live_multi_router_loads_ratio", multi, "<= 1.2", True, lambda v: v <= 1.2)):
        value, where = _worst(values, worse_high)
        out.append(common.goal(name, None if value is None else round(value, 3), target,
                               None if value is None else ok(value)))
        where_of[name] = f"worst at {where} of {len(values)} comparisons" if values else "nothing to compare"
    return out, where_of


def markdown_table(rows: list[dict]) -> str:
    """One line per (setting, cost, concurrency): the three variants side by side (1 router)."""
    lines = ["| setting | load cost | conc | loads/1k aff / mux / pow2 | p50 ms aff / mux / pow2 | "
             "p99 ms aff / mux / pow2 | req/s aff / mux / pow2 | router CPU ms/req aff / mux / pow2 |",
             "|---|---|---|---|---|---|---|---|"]
    for (setting, cost, c), by in sorted(_groups(rows).items(), key=lambda kv: (kv[0][0] != "fits", kv[0][1], kv[0][2])):
        def cells(key: str, fmt: str) -> str:
            return " / ".join(format(by[v][key], fmt) if v in by else "-" for v in VARIANTS)
        lines.append(f"| {setting} | {cost} | {c} | {cells('loads_per_1k', '.0f')} | {cells('p50_ms', '.0f')} | "
                     f"{cells('p99_ms', '.0f')} | {cells('req_per_s', '.1f')} | {cells('router_cpu_ms', '.1f')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["setting"], r["cost"]) for r in rows if r["routers"] == 1})
    fig, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 6.5), squeeze=False)
    styles = {"affinity": "o-", "multiplexed": "s--", "pow2": "^:"}
    for col, (setting, cost) in enumerate(panels):
        for variant in VARIANTS:
            sel = sorted((r for r in rows if (r["setting"], r["cost"], r["variant"], r["routers"]) ==
                          (setting, cost, variant, 1)), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in sel]
            axes[0][col].plot(xs, [r["req_per_s"] for r in sel], styles[variant], label=variant)
            axes[1][col].plot(xs, [r["p99_ms"] for r in sel], styles[variant], label=variant)
        axes[0][col].set_title(f"{setting}, {cost} loads", fontsize=10)
        for row, label in ((0, "req/s"), (1, "p99 ms")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            if row == 1:
                ax.set_yscale("log")  # p99 spans 100 ms at concurrency 1 to seconds at 64
            ax.set_xlabel("concurrency (closed-loop clients)", fontsize=8)
            ax.set_ylabel(label, fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("routing_live: throughput and p99 against concurrency, one router", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def make_parser():
    parser = common.base_parser(__doc__.split("\n\n")[0], plot=True)
    parser.add_argument("--replicas", type=int, default=2, help="worker replicas (default 2)")
    parser.add_argument("--cpus", type=int, default=8,
                        help="logical CPUs of the local Ray cluster (default 8: the three apps' workers at once)")
    parser.add_argument("--slots", type=int, default=4, help="adapter slots per replica (default 4)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="running requests per replica = max_ongoing_requests (default 8)")
    parser.add_argument("--fits-adapters", type=int, default=6, help="adapters in the 'fits' setting (default 6)")
    parser.add_argument("--skew-adapters", type=int, default=12, help="adapters in the 'skew' setting (default 12)")
    parser.add_argument("--load-bound-epsilon", type=float, default=0.25,
                        help="the router's tie tolerance app arg (default 0.25, the product default)")
    parser.add_argument("--alpha", type=float, default=0.3, help="S-LoRA power-law alpha (default 0.3)")
    parser.add_argument("--requests", type=int,
                        help="requests per row (default 600; quick 200), at least 8 per client at high concurrency")
    parser.add_argument("--verbose", action="store_true", help="keep Ray Serve's driver-side log lines")
    parser.add_argument("--concurrency", type=int, nargs="+", help="concurrency levels (default 1 8 64; quick 1 64)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--settings", nargs="+", choices=("fits", "skew"),
                        help="default: fits skew (quick: skew)")
    parser.add_argument("--costs", nargs="+", choices=COSTS, default=list(COSTS))
    parser.add_argument("--no-multi-router", action="store_true", help=f"skip the {MULTI_ROUTERS}-router rows")
    return parser


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)
    concurrencies = tuple(args.concurrency or ((1, 64) if args.quick else CONCURRENCY))
    chosen = args.settings or (["skew"] if args.quick else ["fits", "skew"])
    all_started = time.perf_counter()

    import ray
    from ray import serve

    from engine.demo import ensure_demo_assets

    from .live.load_cost import LoadCost
    from .live.processes import CpuMeter, find_processes

    costs = {"cheap": LoadCost(), "expensive": LoadCost.llama3_8b_rank16()}
    settings = [s for s in settings_for(args.replicas * args.slots, args) if s.name in chosen]
    num_adapters = max(s.num_adapters for s in settings)
    ensure_demo_assets(num_adapters=num_adapters)  # once, before any replica races to build them
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    serve.start(proxy_location="Disabled")
    if not args.verbose:  # deploy/delete chatter and queue-length probe warnings, on the driver
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    print(f"routing_live: {args.replicas} replicas x {args.slots} slots, max_batch_size {args.max_batch_size}, "
          f"concurrency {list(concurrencies)}, settings {chosen}, load costs {args.costs}, alpha {args.alpha}; "
          f"variants {args.variants} deployed side by side, measured in turns", flush=True)
    rows: list[dict] = []
    variants = [Variant(name, args, num_adapters) for name in args.variants]
    try:
        deploy_s = deploy_all(variants)
        print(f"deployed {[v.name for v in variants]} in {deploy_s:.1f} s", flush=True)
        for cost in args.costs:
            for v in variants:
                v.set_load_cost(costs[cost])
            meter = CpuMeter(find_processes([v.app for v in variants]))
            for i, setting in enumerate(settings):
                warmup = build_requests(setting, max(48, requests_per_row(1, args) // 2), args.seed + 100 * i + 1)
                for v in variants:
                    run_clients(v.ensure_clients(1), warmup, 8)
                for c in concurrencies:
                    requests = build_requests(setting, requests_per_row(c, args), args.seed + 100 * i)
                    rows += measure_cell(variants, meter, setting, cost, c, requests)
                    multi = [v for v in variants if v.name == "affinity"]
                    if multi and not args.no_multi_router and c >= MULTI_ROUTERS:
                        run_clients(multi[0].ensure_clients(MULTI_ROUTERS), warmup, 8)
                        rows.append(measure_row(multi[0], meter, setting, cost, c, MULTI_ROUTERS, requests))
    finally:
        serve.shutdown()
        ray.shutdown()

    rows.sort(key=lambda r: (r["setting"] != "fits", COSTS.index(r["cost"]), r["concurrency"], r["routers"],
                             VARIANTS.index(r["variant"])))
    columns = ["setting", "cost", "routers", "variant", "concurrency", "requests", "loads_per_1k", "p50_ms", "p99_ms",
               "req_per_s", "router_cpu_ms", "directory_cpu_ms", "metrics_agent_cpu_ms", "workers_cpu_ms",
               "engine_cpu_ms", "rows_per_step",
               "per_replica", "busiest_pct", "spill", "waits", "router_p50_ms", "errors"]
    print()
    common.print_table(rows, columns, floatfmt=".1f",
                       title=f"Live routing ({args.replicas} replicas x {args.slots} slots, warm-up excluded; "
                             f"*_cpu_ms = CPU milliseconds per request: router = the client processes hosting "
                             f"the routers)")
    goal_rows, where_of = goals(rows)
    print()
    common.print_goals(goal_rows)
    for name, where in where_of.items():
        print(f"  {name}: {where}")
    md = markdown_table(rows)
    print("\n" + md)
    print(f"\ntotal {common.elapsed_since(all_started)}")
    if args.json:
        common.write_json(args.json, "routing_live", rows,
                          common.settings_of(args, concurrency_levels=list(concurrencies), settings_run=chosen,
                                             costs={k: vars(v) for k, v in costs.items()}),
                          extra={"deploy_seconds": deploy_s, "readme_table": md, "goal_where": where_of},
                          goals=goal_rows)
    png = common.plot_path(args)
    if png:
        plot(rows, png)
        print(f"plot: {png}")
    return rows


if __name__ == "__main__":
    main()

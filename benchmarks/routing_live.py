"""Adapter loads and latency on a live local Ray Serve fleet: this router vs Serve's own options.

Why: the point of ``AdapterAffinityRouter`` is that a request goes where its adapter
already sits, so replicas stop reloading adapters. This measures it end to end (real
Serve handles, real replicas, the demo model) against the two things a Ray Serve user
would otherwise deploy, with the same engine, the same pool and the same slot count:

- ``affinity``: the product as it ships (``deployments.app.build_fleet``), requests routed
  by ``routing.ray_router:AdapterAffinityRouter``;
- ``multiplexed``: Ray Serve's built-in model multiplexing (``@serve.multiplexed`` with
  ``max_num_models_per_replica`` = slots, requests sent with ``multiplexed_model_id``;
  ``benchmarks/live/multiplexed_worker.py``);
- ``pow2``: the same ``LoRAWorker`` deployment with Serve's default request router
  (power of two choices, no adapter awareness).

Workload: one trace per setting, adapters drawn like S-LoRA (``power(alpha)``), short
prompts and 8-16 output tokens, sent closed-loop at concurrency 1, 8 and 64 from the
driver through DeploymentHandles (no HTTP; every variant gets the same single hop).
"fits": the adapters fit the fleet's slots (the ideal is no load after warm-up);
"skew": more adapters than the fleet's slots. Each (variant, setting) gets a warm-up pass
first, excluded from the counts. Loads come from every replica's pool counters.

Columns: ``loads_per_1k`` = adapter slot loads (every replica's pool ``counters.loads``) per
1000 measured requests; ``evictions_per_1k`` counts slots freed for another adapter (pool
evictions, or Serve's LRU unloads for ``multiplexed``); p50/p99 are client-side (send to
result, queueing in the driver's router included); ``per_replica`` = requests served by each
replica (``GenerateResult.replica_id``); ``spill``/``full_spill`` = the driver-side
router's decision counts (``affinity`` only). A ``multiplexed`` load is a full
registration (read + validate), the others reload from the host tier; each counts as one.

Goals (from the issue): loads >= 5x fewer than ``multiplexed`` when the working set fits
(N/A when neither loaded); >= 50% fewer than ``pow2`` under skew; p99 within 10% of
``pow2`` or better. ``--quick``: 150 requests per row instead of 600 (same settings and
concurrency levels), about 1.5 minutes; the full run takes about 4.

    python -m benchmarks.routing_live [--quick] [--json PATH] [--replicas N] [--cpus N]

The benchmark starts its own local Ray cluster (``address="local"``) with Serve's HTTP
proxy disabled, so it can run beside another cluster on the same machine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from . import common
from .traces import Popularity, make_trace

APP_PREFIX = "routing-live"
VARIANTS = ("affinity", "multiplexed", "pow2")
CONCURRENCY = (1, 8, 64)
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz     "))


@dataclass(frozen=True)
class Setting:
    name: str
    num_adapters: int
    alpha: float


@dataclass(frozen=True)
class Request:
    adapter: str
    prompt: str
    max_tokens: int


def settings_for(slots_total: int, args) -> list[Setting]:
    fits = min(args.fits_adapters, slots_total)
    return [Setting("fits", fits, args.alpha), Setting("skew", args.skew_adapters, args.alpha)]


def build_requests(setting: Setting, n: int, seed: int) -> list[Request]:
    """S-LoRA-style adapters (``power(alpha)``; id 0 hottest), 8-32 character prompts, 8-16 new tokens."""
    trace = make_trace(n, setting.num_adapters, Popularity("power", setting.alpha), seed=seed,
                       input_range=(8, 33), output_range=(8, 17))
    rng = np.random.default_rng(seed + 7919)
    requests = []
    for adapter, n_in, n_out in zip(trace.adapters.tolist(), trace.input_lens.tolist(), trace.output_lens.tolist()):
        prompt = "".join(rng.choice(LETTERS, size=int(n_in)).tolist()).strip() or "hello"
        requests.append(Request(f"demo-{adapter}", prompt, int(n_out)))
    return requests


# ---------------------------------------------------------------------------- variants


def app_args(num_adapters: int, args):
    from deployments.config import AdapterSpec, AppArgs

    return AppArgs(max_loras_per_batch=args.slots, max_lora_rank=16, max_batch_size=args.max_batch_size,
                   max_tokens_limit=64, max_model_len=256, host_cache_bytes=64 << 20,
                   load_bound_epsilon=args.load_bound_epsilon,
                   adapters=[AdapterSpec(name=f"demo-{i}", source=f"demo:demo-{i}") for i in range(num_adapters)])


class Variant(ABC):
    """One deployed variant: how to send a request and how to read every replica's counters."""

    name: str
    deployment: str

    def __init__(self, args, num_adapters: int):
        self.args = args
        self.parsed = app_args(num_adapters, args)
        self.replica_options = {"num_replicas": args.replicas, "ray_actor_options": {"num_cpus": 1}}
        self.handle = None
        # one app name per variant: the driver caches handles (and their routers) by deployment id,
        # so reusing a name would route a later variant with an earlier variant's router
        self.app = f"{APP_PREFIX}-{self.name}"

    @abstractmethod
    def application(self):
        """The Serve application (graph) this variant deploys."""

    def deploy(self) -> float:
        from ray import serve

        started = time.perf_counter()
        serve.run(self.application(), name=self.app, route_prefix=None)
        self.handle = serve.get_deployment_handle(self.deployment, app_name=self.app)
        self.stats()  # every replica answers
        return time.perf_counter() - started

    def send(self, request: Request):
        from engine.request import GenerateRequest

        return self.handle.generate.remote(GenerateRequest(adapter=request.adapter, prompt=request.prompt,
                                                           max_tokens=request.max_tokens, temperature=0.0))

    def stats(self) -> dict[str, dict]:
        """replica id -> pool snapshot (with ``counters``), for every replica."""
        return sample_replicas(lambda: self.handle.pool_state.remote(), self.args.replicas)

    def decisions(self) -> Counter:
        return Counter()


class AffinityVariant(Variant):
    name, deployment = "affinity", "LoRAWorker"

    def application(self):
        from deployments.app import build_fleet

        return build_fleet(self.parsed, dict(self.replica_options))

    def stats(self) -> dict[str, dict]:
        from ray import serve

        from engine.request import ReplicaTarget

        directory = serve.get_deployment_handle("AdapterDirectory", app_name=self.app)
        deadline = time.monotonic() + 60
        while True:
            replicas = sorted(directory.view.remote().result()["replicas"])
            if len(replicas) >= self.args.replicas or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if len(replicas) < self.args.replicas:
            raise RuntimeError(f"only {len(replicas)} of {self.args.replicas} workers reported to the directory")
        return {r: self.handle.pool_state.remote(ReplicaTarget(r)).result() for r in replicas}

    def decisions(self) -> Counter:
        """The driver's router's decision counts (affinity/placement/spill/full_spill), if reachable."""
        try:
            router = self.handle._router._asyncio_router._request_router
            return Counter(router.decisions)
        except AttributeError:
            return Counter()


class Pow2Variant(Variant):
    name, deployment = "pow2", "LoRAWorker"

    def application(self):
        from ray.serve.config import RequestRouterConfig

        from deployments.app import build_fleet

        return build_fleet(self.parsed, {**self.replica_options, "request_router_config": RequestRouterConfig()})


class MultiplexedVariant(Variant):
    name, deployment = "multiplexed", "MultiplexedLoRAWorker"

    def application(self):
        from .live.multiplexed_worker import build_multiplexed

        return build_multiplexed(self.parsed, dict(self.replica_options))

    def send(self, request: Request):
        from engine.request import GenerateRequest

        return self.handle.options(multiplexed_model_id=request.adapter).generate.remote(
            GenerateRequest(adapter=request.adapter, prompt=request.prompt, max_tokens=request.max_tokens,
                            temperature=0.0))

    def stats(self) -> dict[str, dict]:
        return sample_replicas(lambda: self.handle.stats.remote(), self.args.replicas)


VARIANT_CLASSES = {"affinity": AffinityVariant, "multiplexed": MultiplexedVariant, "pow2": Pow2Variant}


def sample_replicas(call: Callable[[], Any], expected: int, timeout_s: float = 60.0) -> dict[str, dict]:
    """Ask until every replica has answered once (for routers that ignore ``ReplicaTarget``)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(seen)} of {expected} replicas answered within {timeout_s:.0f}s")
        snap = call().result()
        seen.setdefault(snap["replica_id"], snap)
    return seen


def total(stats: dict[str, dict], key: str) -> float:
    return sum(s.get(key, 0) for s in stats.values()) if key.startswith("mux_") \
        else sum(s["counters"][key] for s in stats.values())


# ---------------------------------------------------------------------------- driving


async def run_closed_loop(variant: Variant, requests: list[Request], concurrency: int):
    """``concurrency`` clients, each sending its next request when the previous answer arrives."""
    latencies = np.zeros(len(requests))
    replicas: list[Optional[str]] = [None] * len(requests)
    errors: list[str] = []
    next_index = 0

    async def client():
        nonlocal next_index
        while next_index < len(requests):
            i = next_index
            next_index += 1
            started = time.perf_counter()
            try:
                result = await variant.send(requests[i])
                replicas[i] = result.replica_id
            except Exception as exc:  # counted and reported, never silently dropped
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
            latencies[i] = time.perf_counter() - started

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, replicas, errors, time.perf_counter() - started


def measure(variant: Variant, setting: Setting, requests: list[Request], warmup: list[Request],
            concurrencies: tuple[int, ...]) -> list[dict]:
    rows = []
    before = variant.stats()
    _, _, warm_errors, warm_s = asyncio.run(run_closed_loop(variant, warmup, 8))
    warm = variant.stats()
    warm_loads = total(warm, "loads") - total(before, "loads")
    for concurrency in concurrencies:
        before, decisions_before = variant.stats(), variant.decisions()
        latencies, replicas, errors, wall = asyncio.run(run_closed_loop(variant, requests, concurrency))
        after, decisions = variant.stats(), variant.decisions() - decisions_before
        n = len(requests)
        loads = total(after, "loads") - total(before, "loads")
        per_replica = Counter(r for r in replicas if r is not None)
        ok = latencies[[r is not None for r in replicas]]
        row = {
            "setting": setting.name, "adapters": setting.num_adapters, "variant": variant.name,
            "concurrency": concurrency, "requests": n,
            "loads_per_1k": 1000.0 * loads / n,
            # the multiplexed baseline frees slots by unloading (Serve's LRU), the others by evicting
            "evictions_per_1k": 1000.0 * sum(total(after, k) - total(before, k) for k in ("evictions", "unloads")) / n,
            "p50_ms": 1000.0 * float(np.percentile(ok, 50)) if len(ok) else math.nan,
            "p99_ms": 1000.0 * float(np.percentile(ok, 99)) if len(ok) else math.nan,
            "req_per_s": n / wall,
            "per_replica": "/".join(str(c) for c in sorted(per_replica.values(), reverse=True)),
            "errors": len(errors),
            "spill": decisions.get("spill", 0) if variant.name == "affinity" else None,
            "full_spill": decisions.get("full_spill", 0) if variant.name == "affinity" else None,
            # JSON only
            "loads": loads,
            "warmup_requests": len(warmup), "warmup_loads": warm_loads,
            "warmup_loads_per_1k": 1000.0 * warm_loads / max(1, len(warmup)), "warmup_errors": len(warm_errors),
            "warmup_s": warm_s,
            "load_seconds": total(after, "load_seconds") - total(before, "load_seconds"),
            "decisions": dict(decisions),
            "replica_requests": dict(per_replica),
            "resident_after": {r: sorted(s["resident"]) for r, s in after.items()},
            "error_samples": errors[:3],
        }
        if variant.name == "multiplexed":
            row["mux_loads_per_1k"] = 1000.0 * (total(after, "mux_loads") - total(before, "mux_loads")) / n
        rows.append(row)
        print(f"  {setting.name:>4} {variant.name:>11} c={concurrency:<3} loads/1k={row['loads_per_1k']:7.1f} "
              f"p50={row['p50_ms']:7.1f} ms p99={row['p99_ms']:7.1f} ms replicas={row['per_replica']} "
              f"errors={len(errors)}", flush=True)
    return rows


# ---------------------------------------------------------------------------- goals


def _row(rows, setting, variant, concurrency):
    for r in rows:
        if (r["setting"], r["variant"], r["concurrency"]) == (setting, variant, concurrency):
            return r
    return None


def _ratio(num: float, den: float) -> float:
    if den == 0:
        return math.inf if num > 0 else (1.0 if num == 0 else 0.0)
    return num / den


def goals(rows: list[dict], concurrencies) -> list[dict]:
    out = []
    for c in concurrencies:
        a, b = _row(rows, "fits", "affinity", c), _row(rows, "fits", "multiplexed", c)
        if a and b:
            ratio = _ratio(b["loads_per_1k"], a["loads_per_1k"])
            both_zero = a["loads_per_1k"] == 0 and b["loads_per_1k"] == 0
            out.append({"goal": "fits: loads >= 5x fewer than multiplexed", "concurrency": c,
                        "affinity": a["loads_per_1k"], "baseline": b["loads_per_1k"],
                        "measure": "neither loaded" if both_zero else f"{ratio:.1f}x fewer",
                        "pass": None if both_zero else ratio >= 5.0})
        a, p = _row(rows, "skew", "affinity", c), _row(rows, "skew", "pow2", c)
        if a and p:
            cut = 1.0 - _ratio(a["loads_per_1k"], p["loads_per_1k"])
            out.append({"goal": "skew: loads >= 50% fewer than pow2", "concurrency": c,
                        "affinity": a["loads_per_1k"], "baseline": p["loads_per_1k"],
                        "measure": f"{100 * cut:.0f}% fewer", "pass": cut >= 0.5})
        for setting in ("fits", "skew"):
            a, p = _row(rows, setting, "affinity", c), _row(rows, setting, "pow2", c)
            if a and p:
                ratio = _ratio(a["p99_ms"], p["p99_ms"])
                out.append({"goal": f"{setting}: p99 within 10% of pow2", "concurrency": c,
                            "affinity": a["p99_ms"], "baseline": p["p99_ms"],
                            "measure": f"{ratio:.2f}x pow2's p99", "pass": ratio <= 1.10})
    return out


# ---------------------------------------------------------------------------- main


def make_parser():
    parser = common.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="worker replicas (default 2)")
    parser.add_argument("--cpus", type=int, default=4, help="CPUs of the local Ray cluster (default 4)")
    parser.add_argument("--slots", type=int, default=4, help="adapter slots per replica (default 4)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="running requests per replica = max_ongoing_requests (default 8)")
    parser.add_argument("--fits-adapters", type=int, default=6, help="adapters in the 'fits' setting (default 6)")
    parser.add_argument("--skew-adapters", type=int, default=12, help="adapters in the 'skew' setting (default 12)")
    parser.add_argument("--load-bound-epsilon", type=float, default=0.25,
                        help="the router's load_bound_epsilon app arg (default 0.25, the product default)")
    parser.add_argument("--alpha", type=float, default=0.3, help="S-LoRA power-law alpha (default 0.3)")
    parser.add_argument("--requests", type=int, help="requests per (setting, concurrency) (default 600; quick 150)")
    parser.add_argument("--verbose", action="store_true", help="keep Ray Serve's driver-side log lines")
    parser.add_argument("--concurrency", type=int, nargs="+", help="concurrency levels (default 1 8 64)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--settings", nargs="+", choices=("fits", "skew"), default=["fits", "skew"])
    return parser


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)
    n = args.requests or (150 if args.quick else 600)
    concurrencies = tuple(args.concurrency or CONCURRENCY)
    n_warm = max(48, n // 4)
    all_started = time.perf_counter()

    import ray
    from ray import serve

    from engine.demo import ensure_demo_assets

    settings = [s for s in settings_for(args.replicas * args.slots, args) if s.name in args.settings]
    num_adapters = max(s.num_adapters for s in settings)
    ensure_demo_assets(num_adapters=num_adapters)  # once, before any replica races to build them
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    serve.start(proxy_location="Disabled")
    if not args.verbose:  # deploy/delete chatter and queue-length probe warnings, on the driver
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    print(f"routing_live: {args.replicas} replicas x {args.slots} slots, max_batch_size {args.max_batch_size}, "
          f"{n} requests per level (+{n_warm} warm-up), concurrency {list(concurrencies)}, alpha {args.alpha}",
          flush=True)
    rows: list[dict] = []
    deploy_s: dict[str, float] = {}
    try:
        for index, name in enumerate(args.variants):
            variant = VARIANT_CLASSES[name](args, num_adapters)
            variant.app = f"{APP_PREFIX}-{index}-{name}"  # never reuse a name (see Variant.__init__)
            deploy_s[name] = variant.deploy()
            print(f"{name}: deployed in {deploy_s[name]:.1f} s", flush=True)
            for i, setting in enumerate(settings):
                requests = build_requests(setting, n, args.seed + 100 * i)
                warmup = build_requests(setting, n_warm, args.seed + 100 * i + 1)
                rows += measure(variant, setting, requests, warmup, concurrencies)
            serve.delete(variant.app)
    finally:
        serve.shutdown()
        ray.shutdown()

    rows.sort(key=lambda r: (r["setting"] != "fits", r["concurrency"], VARIANTS.index(r["variant"])))
    columns = ["setting", "adapters", "variant", "concurrency", "loads_per_1k", "evictions_per_1k", "p50_ms",
               "p99_ms", "req_per_s", "per_replica", "spill", "full_spill", "errors"]
    print()
    common.print_table(rows, columns, title=f"Live routing ({args.replicas} replicas x {args.slots} slots, "
                                            f"{n} requests per row, warm-up excluded)", floatfmt=".1f")
    goal_rows = goals(rows, concurrencies)
    print()
    for g in goal_rows:
        verdict = "N/A " if g["pass"] is None else ("PASS" if g["pass"] else "FAIL")
        print(f"{verdict}  {g['goal']:<44} c={g['concurrency']:<3} "
              f"affinity {g['affinity']:.1f} vs {g['baseline']:.1f}: {g['measure']}")
    print(f"\ntotal {common.elapsed_since(all_started)}")
    if args.json:
        common.write_json(args.json, "routing_live", rows,
                          common.settings_of(args, requests_per_level=n, warmup_requests=n_warm,
                                             concurrency_levels=list(concurrencies),
                                             settings=[s.__dict__ for s in settings]),
                          extra={"goals": goal_rows, "deploy_seconds": deploy_s})
    return rows


if __name__ == "__main__":
    main()

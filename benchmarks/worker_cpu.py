"""CPU per request of one worker's engine, in-process, on routing_live's workload: no Ray, no fleet.

Why: routing_live's ``workers_cpu_ms`` column moves 20-30% run to run on a shared machine
(Ray's own threads, the rate other work leaves the replicas), too much to bisect a change
of that size. This drives one ``LoRAEngine`` built from the same ``AppArgs`` as the live
workers (4 slots, batch 8, 12 demo adapters, one torch thread as a ``num_cpus=1`` replica
has) with the same trace (``routing_live.build_requests``, skew) from an asyncio loop, as the
worker's ``generate`` does, and reads CPU seconds of the whole process and of the engine
thread alone. Nothing here depends on the routing code, so it runs on old commits too
(``PYTHONPATH=<old worktree> python <this file>``).

Rows: concurrency 1 (``--requests`` requests one after another) and concurrency 8 (a full
batch); ``--rounds`` rounds taking turns, each row's minimum and median over the rounds
(other work on the machine adds CPU time to a run through cache misses, never removes it).

    python -m benchmarks.worker_cpu [--quick] [--requests 200] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from types import SimpleNamespace
from typing import Optional, Sequence

import psutil
import torch

from benchmarks import common

CONCURRENCY = (1, 8)


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) of one thread of this process."""
    for t in psutil.Process().threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    return 0.0


def build_engine(num_adapters: int):
    """The live worker's engine (routing_live's AppArgs) with every demo adapter registered."""
    from benchmarks.routing_live import app_args
    from deployments.config import resolve_demo_source
    from engine.demo import ensure_demo_assets
    from engine.engine import LoRAEngine

    ensure_demo_assets(num_adapters=num_adapters)
    args = app_args(num_adapters, SimpleNamespace(slots=4, max_batch_size=8, load_bound_epsilon=0.25))
    engine = LoRAEngine(args.engine_config("bench"))
    for spec in args.startup_adapters():
        engine.register_adapter(spec.name, resolve_demo_source(spec.source))
    return engine


async def drive(engine, requests: list, concurrency: int) -> None:
    """Closed-loop clients on one event loop, each awaiting ``engine.generate`` as the worker does."""
    from engine.request import GenerateRequest

    queue = list(reversed(requests))

    async def client() -> None:
        while queue:
            adapter, prompt, max_tokens = queue.pop()
            await engine.generate(GenerateRequest(adapter=adapter, prompt=prompt, max_tokens=max_tokens))

    await asyncio.gather(*(client() for _ in range(concurrency)))


def measure(engine, requests: list, concurrency: int) -> dict:
    engine_tid = engine._thread.native_id
    proc = psutil.Process()
    steps0, cpu0, eng0, wall0 = engine.steps, sum(proc.cpu_times()[:2]), thread_cpu_s(engine_tid), time.perf_counter()
    asyncio.run(drive(engine, requests, concurrency))
    n = len(requests)
    return {"concurrency": concurrency, "requests": n,
            "process_cpu_ms": 1000.0 * (sum(proc.cpu_times()[:2]) - cpu0) / n,
            "engine_cpu_ms": 1000.0 * (thread_cpu_s(engine_tid) - eng0) / n,
            "steps_per_request": (engine.steps - steps0) / n,
            "req_per_s": n / (time.perf_counter() - wall0)}


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    parser = common.base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help="requests per row (default 200; quick 100)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds taking turns (default 3)")
    args = parser.parse_args(argv)
    args.requests = args.requests or (100 if args.quick else 200)
    from benchmarks.routing_live import Setting, build_requests

    torch.set_num_threads(1)  # a num_cpus=1 replica (deployments/worker.py's _torch_threads)
    setting = Setting("skew", 12, 0.3)
    engine = build_engine(setting.num_adapters)
    try:
        asyncio.run(drive(engine, build_requests(setting, 64, args.seed + 1), 8))  # warm-up
        requests = build_requests(setting, args.requests, args.seed)
        runs: dict[int, list[dict]] = {c: [] for c in CONCURRENCY}
        for _ in range(args.rounds):
            for c in CONCURRENCY:
                runs[c].append(measure(engine, requests, c))
    finally:
        engine.shutdown()
    rows = []
    for c, rs in runs.items():
        row = {"concurrency": c, "requests": args.requests, "rounds": len(rs),
               "steps_per_request": round(rs[0]["steps_per_request"], 2),
               "req_per_s_best": round(max(r["req_per_s"] for r in rs), 1)}
        for key in ("process_cpu_ms", "engine_cpu_ms"):
            values = [r[key] for r in rs]
            row[f"{key}_min"], row[f"{key}_median"] = round(min(values), 3), round(statistics.median(values), 3)
        rows.append(row)
    common.print_table(rows, title="one worker's engine, in-process: CPU ms per request (min and median of rounds)",
                       floatfmt=".3g")
    # reported, not judged: this is a yardstick for comparing commits on one machine, not a target
    goal_rows = [common.goal(f"worker_process_cpu_ms_per_request_c{r['concurrency']}", r["process_cpu_ms_min"],
                             "reported", None) for r in rows]
    print()
    common.print_goals(goal_rows)
    if args.json:
        common.write_json(args.json, "worker_cpu", rows, common.settings_of(args), extra={"runs": runs},
                          goals=goal_rows)
    return rows


if __name__ == "__main__":
    main()

"""Hostile traffic at the front door: a flood of bogus model names with resolvers on.

Why: the first-request resolver is open to anyone who can send a request. A flood of
names nobody registered must not grow the ingress's memory, must not turn into more
worker lookups (hub or S3 calls) than ``adapter_resolver_lookups_per_s`` allows, and must
not slow ordinary requests. Phases, with ordinary traffic (``--clients`` threads on a
registered adapter) running throughout:

1. baseline: ordinary traffic alone;
2. repeats: one bogus name sent ``--repeats`` times (memory after the first tenth must not grow);
3. flood: ``--names`` unique bogus names at ``--flood-rate`` requests per second.

The ingress's RSS is read from /proc before and after phases 2 and 3, its lookup counter
through the app handle, and the CPU time of Serve's proxy, the ingress and the workers at
the baseline's and the flood's ends (benchmarks/proc_cpu.py), so the table says where the
flood's CPU went. The bogus requests are sent from a process of their own: sent from
this one, their client CPU shared the ordinary clients' interpreter and inflated the very
latency the benchmark measures; and they go as plain HTTP/1.1 bytes over kept-alive connections
(``flood``), since that process shares this machine's cores too. Its CPU is the table's last row.

    python -m benchmarks.abuse [--quick] [--json PATH] [--names N] [--flood-rate R] [--repeats N]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks import common
from benchmarks.machine_speed import SpeedProbe, span
from benchmarks.proc_cpu import CpuMeter, pids_named
from benchmarks.rollout import Traffic, percentile_ms, start_local_serve

APP = "abuse-bench"
LOOKUPS_PER_S = 5.0


def rss_mb(pid: int) -> float:
    """Resident set size of a process on this node, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def ordinary_row(traffic: Traffic, phase: str, probe: SpeedProbe) -> dict:
    """The ordinary requests of a phase, and the machine's speed while they ran (benchmarks/machine_speed.py)."""
    samples = [x for x in traffic.samples if x.phase == phase]
    ok = [x.seconds for x in samples if x.status == 200]
    return {"phase": phase, "ordinary": len(ok), "ordinary_errors": sum(1 for x in samples if x.status != 200),
            "p50_ms": percentile_ms(ok, 50), "p99_ms": percentile_ms(ok, 99),
            **probe.phase(*span([x.started for x in samples], [x.started + x.seconds for x in samples]))}


def completion_request(host: str, name: str) -> bytes:
    """One bogus-name completion as the bytes of an HTTP/1.1 request on a kept-alive connection."""
    body = json.dumps({"model": name, "prompt": "x", "max_tokens": 1}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Status and whether the server keeps the connection, the body read and dropped."""
    status = int((await reader.readline()).split()[1])
    length, chunked, keep = 0, False, True
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.partition(b":")
        key, value = key.strip().lower(), value.strip().lower()
        if key == b"content-length":
            length = int(value)
        elif key == b"transfer-encoding":
            chunked = b"chunked" in value
        elif key == b"connection":
            keep = value != b"close"
    if not chunked:
        await reader.readexactly(length)
        return status, keep
    while size := int((await reader.readline()).split(b";")[0], 16):
        await reader.readexactly(size + 2)
    await reader.readline()
    return status, keep


async def flood(base: str, names: list[str], rate: float, concurrency: int = 8) -> dict:
    """Send one completion per name, paced at ``rate`` per second; count the statuses.

    Plain HTTP/1.1 over ``concurrency`` kept-alive connections, each request's bytes built before the
    flood starts: the flood's client shares this machine's cores with the server it measures, and an
    ``httpx.AsyncClient`` took ~1.8 ms of CPU per request here (py-spy on the flood process), 0.27 of
    a core at 150/s, which an attacker spends on its own machines, not on the server's."""
    url = urlsplit(base)
    requests = [completion_request(url.netloc, name) for name in names]
    statuses: dict[int, int] = {}
    started = time.perf_counter()
    sent = 0

    async def sender() -> None:
        nonlocal sent
        reader = writer = None
        while sent < len(requests):
            request = requests[sent]
            due = started + sent / rate
            sent += 1
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(url.hostname, url.port)
                writer.write(request)
                code, keep = await asyncio.wait_for(read_response(reader), 120)
            except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                code, keep = -1, False
            if not keep and writer is not None:
                writer.close()
                reader = writer = None
            statuses[code] = statuses.get(code, 0) + 1
        if writer is not None:
            writer.close()

    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return {"statuses": statuses, "seconds": time.perf_counter() - started}


def flood_in_process(base: str, names: list[str], rate: float) -> dict:
    """``flood`` in a fresh process (spawned: this one runs Ray), so its client CPU is not the measuring one's."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_flood, base, names, rate).result()


def run_flood(base: str, names: list[str], rate: float) -> dict:
    started = time.process_time()
    result = asyncio.run(flood(base, names, rate))
    return {**result, "client_cpu_s": time.process_time() - started}


def print_cpu(meter: CpuMeter, bogus_per_s: float, client_cores: float) -> None:
    """Cores each Serve process used without and with the flood, and the flood's CPU per bogus request; last,
    the flood's own client (its process's CPU time over the flood), which shares this machine's cores."""
    baseline, flood_ = meter.cores("baseline", "baseline end"), meter.cores("flood", "flood end")
    rows = [{"process": name, "pids": len(meter.groups[name]), "baseline_cores": baseline[name],
             "flood_cores": flood_[name], "ms_per_bogus": (flood_[name] - baseline[name]) * 1000 / bogus_per_s}
            for name in baseline]
    rows.append({"process": "flood client", "pids": 1, "baseline_cores": 0.0, "flood_cores": client_cores,
                 "ms_per_bogus": client_cores * 1000 / bogus_per_s})
    common.print_table(rows, ["process", "pids", "baseline_cores", "flood_cores", "ms_per_bogus"],
                       title=f"CPU by process (/proc), flood at {bogus_per_s:.0f} bogus requests/s", floatfmt=".2f")


def main(argv=None) -> dict:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--names", type=int, default=10_000, help="unique bogus names in the flood (default 10000)")
    parser.add_argument("--flood-rate", type=float, default=None,
                        help="bogus requests per second (default 150, --quick 150)")
    parser.add_argument("--repeats", type=int, default=1000, help="requests for one bogus name (default 1000)")
    parser.add_argument("--clients", type=int, default=2, help="ordinary clients (default 2)")
    parser.add_argument("--cpus", type=int, default=4, help="CPUs for the local Ray cluster (default 4)")
    args = parser.parse_args(argv)
    rate = args.flood_rate or 150.0
    baseline_s = 15.0 if args.quick else 40.0
    all_started = time.perf_counter()

    import ray
    from ray import serve

    from deployments.app import build_fleet
    from deployments.config import AppArgs
    from engine.demo import ensure_demo_assets

    work = Path(tempfile.mkdtemp(prefix="lorafleet-abuse-"))
    assets = ensure_demo_assets(num_adapters=2)
    (work / "resolve").mkdir()
    port, base = start_local_serve(args.cpus)
    demo_dir = assets.adapters["demo-0"].parent
    app_args = AppArgs(max_loras_per_batch=3, max_lora_rank=16, max_batch_size=4, max_tokens_limit=64,
                       max_model_len=256, host_cache_bytes=64 << 20,
                       adapters=[{"name": "support", "source": str(demo_dir / "demo-0")}],
                       adapter_roots=[str(demo_dir), str(work / "resolve")],
                       adapter_resolvers=[str(work / "resolve")], adapter_resolver_lookups_per_s=LOOKUPS_PER_S)
    rows: list[dict] = []
    probe = SpeedProbe()
    try:
        serve.run(build_fleet(app_args, {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}),
                  name=APP, route_prefix="/")
        ingress = serve.get_app_handle(APP)
        stats = lambda: ingress.admission_stats.remote().result(timeout_s=30)   # noqa: E731
        pid = stats()["pid"]
        print(f"abuse: deployed; ingress pid {pid}; {args.clients} ordinary clients; flood of {args.names} names at "
              f"{rate:.0f}/s; lookups limited to {LOOKUPS_PER_S:g}/s", flush=True)
        meter = CpuMeter({"proxy": pids_named("ProxyActor"), "ingress": [pid],
                          "workers": pids_named(f"ServeReplica:{APP}:LoRAWorker"), "benchmark": [os.getpid()]})
        traffic = Traffic(base, "support", args.clients, max_tokens=8)
        probe.start()
        traffic.start()
        time.sleep(3.0)
        traffic.phase = "baseline"
        meter.mark("baseline")
        time.sleep(baseline_s)
        meter.mark("baseline end")

        traffic.phase = "repeats"   # the first tenth warms the 404 path; memory must then stay put
        warm = max(1, args.repeats // 10)
        first = flood_in_process(base, ["bogus-repeated"] * warm, rate)
        before_repeats = rss_mb(pid)
        repeated = flood_in_process(base, ["bogus-repeated"] * (args.repeats - warm), rate)
        after_repeats = rss_mb(pid)
        for code, n in first["statuses"].items():
            repeated["statuses"][code] = repeated["statuses"].get(code, 0) + n

        traffic.phase = "flood"
        lookups_before = stats()["resolver_lookups"]
        before_flood = rss_mb(pid)
        meter.mark("flood")
        flooded = flood_in_process(base, [f"bogus-{i:06d}-{os.urandom(4).hex()}" for i in range(args.names)], rate)
        meter.mark("flood end")
        after_flood = rss_mb(pid)
        final = stats()
        traffic.stop()
        probe.stop()
        lookups = final["resolver_lookups"] - lookups_before
    finally:
        probe.close()
        serve.shutdown()
        ray.shutdown()
        port.close()
        shutil.rmtree(work, ignore_errors=True)

    baseline_row, repeats_row, flood_row = (ordinary_row(traffic, p, probe) for p in ("baseline", "repeats", "flood"))
    rows = [
        {**baseline_row, "bogus_sent": 0, "bogus_statuses": "-", "rss_before_mb": None, "rss_after_mb": None},
        {**repeats_row, "bogus_sent": args.repeats, "bogus_statuses": repeated["statuses"],
         "rss_before_mb": before_repeats, "rss_after_mb": after_repeats},
        {**flood_row, "bogus_sent": args.names, "bogus_statuses": flooded["statuses"],
         "rss_before_mb": before_flood, "rss_after_mb": after_flood},
    ]
    print()
    common.print_table(rows, ["phase", "ordinary", "ordinary_errors", "p50_ms", "p99_ms", "probe_us", "probe_slow_pct",
                              "others_core_pct",
                              "bogus_sent", "bogus_statuses", "rss_before_mb", "rss_after_mb"],
                       title="Bogus model names vs ordinary requests (one ingress replica)", floatfmt=".1f")
    print(probe.legend())
    growth = after_flood - before_flood
    repeat_growth = after_repeats - before_repeats
    lookups_per_s = lookups / flooded["seconds"]
    ratio = flood_row["p99_ms"] / baseline_row["p99_ms"]
    print(f"\nflood: {flooded['seconds']:.1f} s, {lookups} resolver lookups ({lookups_per_s:.2f}/s), "
          f"{final['resolver_refused']} refused by the lookup limit, {final['resolver_misses_held']} misses held, "
          f"{final['early_refusals']} bogus requests answered by the model guard (all phases)")
    goals = [
        common.goal("abuse_ingress_rss_growth_mb", round(growth, 2), "< 20", growth < 20),
        common.goal("abuse_repeat_rss_growth_mb", round(repeat_growth, 2), "< 2", repeat_growth < 2),
        common.goal("abuse_worker_lookups_per_s", round(lookups_per_s, 3), f"<= {LOOKUPS_PER_S:g}",
                    lookups_per_s <= LOOKUPS_PER_S),
        common.goal("abuse_ordinary_p99_ratio", round(ratio, 3), "<= 1.1", ratio <= 1.1),
        common.goal("abuse_ordinary_errors", flood_row["ordinary_errors"] + repeats_row["ordinary_errors"], "== 0",
                    flood_row["ordinary_errors"] + repeats_row["ordinary_errors"] == 0),
    ]
    print()
    print_cpu(meter, args.names / flooded["seconds"], flooded["client_cpu_s"] / flooded["seconds"])
    print()
    common.print_goals(goals)
    print(f"\ntotal {common.elapsed_since(all_started)}")
    if args.json:
        common.write_json(args.json, "abuse", rows,
                          common.settings_of(args, flood_rate=rate, baseline_s=baseline_s,
                                             lookups_per_s_limit=LOOKUPS_PER_S), goals=goals)
    return {"rows": rows, "goals": goals}


if __name__ == "__main__":
    main()

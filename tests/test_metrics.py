"""After traffic, the lorafleet metrics are on Ray's Prometheus endpoint with sensible values."""

from __future__ import annotations

import re
import time
from collections import defaultdict

import httpx

from conftest import FLEET_ARGS, METRICS_PORT
from engine.request import GenerateRequest

LINE = re.compile(r'^(ray_lorafleet_\w+)(?:\{(.*)\})?\s+([0-9.eE+-]+|NaN)$')


def scrape() -> dict[str, list[tuple[dict, float]]]:
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    series = defaultdict(list)
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            series[match.group(1)].append((labels, float(match.group(3))))
    return series


def total(series, name, **labels) -> float:
    return sum(v for l, v in series.get(name, []) if all(l.get(k) == want for k, want in labels.items()))


def test_metrics_after_traffic(fleet):
    for extra in ["demo-6", "demo-7"]:
        fleet.register_adapter.remote(extra, f"demo:{extra}").result()
    adapters = [None, *[f"demo-{i}" for i in range(8)]]  # more than 2 replicas x 3 slots: evictions
    for i in range(40):
        adapter = adapters[(i // 2) % len(adapters)]  # each adapter twice in a row: the second is a hit
        fleet.generate.remote(GenerateRequest(adapter=adapter, prompt="m", max_tokens=2)).result()
    wanted = ["pool_slots", "pool_slots_used", "pool_pinned", "adapter_loads_total", "adapter_evictions_total",
              "pool_hits_total", "pool_misses_total", "adapter_load_seconds_count", "host_cache_bytes",
              "host_cache_hits_total", "router_decisions_total", "router_view_lag_seconds",
              "directory_events_total", "directory_replicas"]
    deadline = time.monotonic() + 60
    while True:
        series = scrape()
        missing = [w for w in wanted if f"ray_lorafleet_{w}" not in series]
        settled = total(series, "ray_lorafleet_adapter_load_seconds_count") == total(
            series, "ray_lorafleet_adapter_loads_total")  # both are pushed once a second: wait for one snapshot
        if (not missing and total(series, "ray_lorafleet_adapter_evictions_total") > 0 and settled) \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, missing
    workers = [l for l, _ in series["ray_lorafleet_pool_slots"] if l.get("deployment") == "LoRAWorker"]
    assert workers and all(v == FLEET_ARGS["max_loras_per_batch"] for _, v in series["ray_lorafleet_pool_slots"])
    assert all(0 <= v <= FLEET_ARGS["max_loras_per_batch"] for _, v in series["ray_lorafleet_pool_slots_used"])
    loads = total(series, "ray_lorafleet_adapter_loads_total")
    assert loads >= 8  # every adapter loaded at least once
    assert total(series, "ray_lorafleet_adapter_evictions_total", policy="lru") > 0
    assert total(series, "ray_lorafleet_pool_misses_total") > 0 and total(series, "ray_lorafleet_pool_hits_total") > 0
    assert total(series, "ray_lorafleet_adapter_load_seconds_count") == loads
    assert total(series, "ray_lorafleet_adapter_load_seconds_sum") > 0
    assert total(series, "ray_lorafleet_host_cache_bytes") > 0
    decisions = {l["kind"]: v for l, v in series["ray_lorafleet_router_decisions_total"]}
    assert decisions.get("affinity", 0) > 0 and sum(decisions.values()) >= 40
    assert total(series, "ray_lorafleet_directory_events_total") >= loads
    assert total(series, "ray_lorafleet_directory_replicas") >= 1

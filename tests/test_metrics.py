"""After traffic, every metric the code defines is on Ray's Prometheus endpoint, with sensible values."""

from __future__ import annotations

import re
from collections import defaultdict

import httpx
import torch

from conftest import FLEET_ARGS
from metric_names import prometheus_series
from engine.request import GenerateRequest
from waiting import wait_until

LINE = re.compile(r'^(ray_lorafleet_\w+)(?:\{(.*)\})?\s+([0-9.eE+-]+|NaN)$')
# Series that appear only after an event this traffic does not cause: quota rejections need a quota
# (checked live in tests/test_fleet_sources.py); a cancel counts only when it lands mid-generation.
# Plan moves need a shift in demand that outlasts the plan's hysteresis (tests/test_routing_directory.py).
AFTER_EVENTS = {"ray_lorafleet_adapter_quota_rejections_total", "ray_lorafleet_requests_cancelled_total",
                "ray_lorafleet_plan_moves_total"}


def scrape(url: str) -> dict[str, list[tuple[dict, float]]]:
    text = httpx.get(url, timeout=10).text
    series = defaultdict(list)
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            series[match.group(1)].append((labels, float(match.group(3))))
    return series


def total(series, name, **labels) -> float:
    return sum(v for l, v in series.get(name, []) if all(l.get(k) == want for k, want in labels.items()))


def test_metrics_after_traffic(fleet, metrics_url):
    for extra in ["demo-6", "demo-7"]:
        fleet.register_adapter.remote(extra, f"demo:{extra}").result()
    adapters = [None, *[f"demo-{i}" for i in range(8)]]  # more than 2 replicas x 3 slots: evictions
    for i in range(40):
        adapter = adapters[(i // 2) % len(adapters)]  # each adapter twice in a row: the second is a hit
        fleet.generate.remote(GenerateRequest(adapter=adapter, prompt="m", max_tokens=2)).result()
    wanted = prometheus_series() - AFTER_EVENTS  # read from the code (the dashboard shows each: test_manifests.py)
    assert AFTER_EVENTS < prometheus_series()
    missing: list[str] = []

    def settled():
        """A scrape with every series, the evictions, one snapshot's worth of loads (pushed once a second)
        and every routing decision (routers export theirs every few seconds)."""
        series = scrape(metrics_url)
        missing[:] = sorted(w for w in wanted if w not in series)
        loads = total(series, "ray_lorafleet_adapter_loads_total")
        ok = (not missing and total(series, "ray_lorafleet_adapter_evictions_total") > 0
              and total(series, "ray_lorafleet_adapter_load_seconds_count") == loads
              and total(series, "ray_lorafleet_router_decisions_total") >= 40)  # exported every 5 s
        return series if ok else None

    series = wait_until(settled, 90, "every metric's series on the metrics endpoint", interval_s=1.0,
                        detail=lambda: f"missing {missing}")
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
    decisions: dict = {}  # one series per router process and kind: sum them per kind
    for labels, value in series["ray_lorafleet_router_decisions_total"]:
        decisions[labels["kind"]] = decisions.get(labels["kind"], 0.0) + value
    assert decisions.get("affinity", 0) > 0 and sum(decisions.values()) >= 40
    assert total(series, "ray_lorafleet_directory_events_total") >= loads
    assert total(series, "ray_lorafleet_directory_replicas") >= 1
    # each worker replica says what its fast paths serve on: here (CPU, dtype auto) torch attention and LoRA, as
    # decided, the base GEMMs on oneDNN where this torch has it (``engine.cpu_gemm``) and decode scores on
    # sampled_addmm (``engine.attention``); decode steps uncaptured (CUDA graphs need CUDA)
    fast = {(l["replica"], l["path"]): (l["intended"], l["used"]) for l, v in series["ray_lorafleet_engine_fast_path"]
            if v == 1}
    replicas = {l["replica"] for l in workers}
    assert {path for _, path in fast} == {"attention", "lora_kernels", "cpu_gemm", "sparse_scores", "fused_ops",
                                         "cuda_graphs"}
    assert {r for r, _ in fast} == replicas
    assert all(used == "torch" for (_, path), (_, used) in fast.items()
               if path in ("attention", "lora_kernels", "fused_ops", "cuda_graphs")), fast
    assert all(used == "sampled_addmm" for (_, path), (_, used) in fast.items() if path == "sparse_scores"), fast
    gemm = "onednn" if torch.backends.mkldnn.is_available() else "torch"
    assert all(used == gemm for (_, path), (_, used) in fast.items() if path == "cpu_gemm"), fast

"""The elastic fleet's setup, shared by ``tests/test_elastic.py`` and ``benchmarks.elastic``: the app's name,
LoRAWorker's autoscaling config (2..3 replicas under the adapter-aware policy, short delays), how many
workers Serve runs, and pins placed one per replica so that whichever replica leaves held one."""

from __future__ import annotations

import itertools

APP = "elastic"
HEADROOM = 1.5  # slots wanted = adapters requested in the window x this


def autoscaling(downscale_delay_s: float) -> dict:
    """LoRAWorker's ``autoscaling_config``: 2..3 replicas, the adapter-aware policy, metrics every 0.5 s."""
    return {
        "min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 50,  # queues never ask for more here
        "upscale_delay_s": 0, "downscale_delay_s": 0, "metrics_interval_s": 0.5, "look_back_period_s": 2,
        "policy": {"policy_function": "deployments.autoscaling:AdapterAwarePolicy",
                   "policy_kwargs": {"max_loads_per_s_per_replica": 50.0, "working_set_headroom": HEADROOM,
                                     "upscale_delay_s": 0.0, "downscale_delay_s": downscale_delay_s}},
    }


def running_workers(app: str = APP) -> int:
    """LoRAWorker replicas Serve runs and routes to (the directory hears of a new one earlier, during its
    warm-up; a call targeted at a replica this process's router does not know yet is never routed)."""
    from ray import serve

    states = serve.status().applications[app].deployments["LoRAWorker"].replica_states
    return sum(n for state, n in states.items() if state == "RUNNING")


def pin_one_per_replica(ingress, replicas: list[str], prefix: str = "elastic-pin") -> dict[str, str]:
    """Register, pinned on one replica, the first ``<prefix>-<i>`` names the pin rule puts on each replica
    (sources: demo adapters): whichever replica leaves held a pin. Returns replica -> name."""
    from routing.pins import pin_holders

    pinned: dict[str, str] = {}
    for replica in replicas:
        name = next(f"{prefix}-{i}" for i in itertools.count() if pin_holders(f"{prefix}-{i}", replicas, 1) == [replica])
        ingress.register_adapter.remote(name, f"demo:demo-{len(pinned) + 1}", pinned=True, replicas=1).result(
            timeout_s=60)
        pinned[replica] = name
    return pinned

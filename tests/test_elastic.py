"""The elastic fleet on a real app of its own: the adapter-aware policy scales LoRAWorker out when the
working set outgrows the slots, the new replica starts warm (its pins and hot adapters loaded before
it takes traffic), and when demand goes the policy scales back in and the departed replica's pins
are held again by the survivors the pin rule names.

One module-scoped app (``elastic``, autoscaled 2..3 as ``benchmarks.elastic`` does it, with short delays);
the tests run in order on it.
"""

from __future__ import annotations

import itertools
import threading
from typing import Self

import pytest
from conftest import fleet_app_args
from fleet_helpers import delete_app, live_replicas, real_pool, view_replicas
from ray import serve
from waiting import wait_until

from engine.request import GenerateRequest
from routing.pins import pin_holders
from testkit.elastic import APP, autoscaling, pin_one_per_replica, running_workers

DEMO = [f"demo-{i}" for i in range(6)]
SLOTS = 3


@pytest.fixture(scope="module")
def elastic(ray_cluster, demo_assets):
    from deployments.app import build_fleet

    args = fleet_app_args(demo_assets).model_copy(update={"demand_window_s": 8.0})
    app = build_fleet(args, {"autoscaling_config": autoscaling(downscale_delay_s=15.0),
                             "ray_actor_options": {"num_cpus": 1}})
    handle = serve.run(app, name=APP, route_prefix=None)
    live_replicas(2, APP, timeout_s=120)
    yield handle
    delete_app(APP)


class Traffic:
    """Requests for every demo adapter in turn from a thread: a working set of six against 2 x 3 slots."""

    def __init__(self, handle):
        self.handle, self.errors, self.sent = handle, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for name in itertools.cycle(DEMO):
            if self._stop.is_set():
                return
            try:
                self.handle.generate.remote(GenerateRequest(adapter=name, prompt="x", max_tokens=2)).result(
                    timeout_s=60)
                self.sent += 1
            except Exception as exc:  # counted and asserted on: a scale event must not fail requests
                self.errors.append(repr(exc))
            self._stop.wait(0.05)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=90)


def uids(handle) -> dict[str, str]:
    return {e["name"]: e["uid"] for e in handle.list_adapters.remote().result(timeout_s=30)["data"]}


def test_a_working_set_beyond_the_slots_scales_out_and_the_new_replica_starts_warm(elastic):
    before = set(live_replicas(2, APP))
    elastic.pin_adapter.remote("demo-0", 3).result(timeout_s=30)  # pinned on every replica, the new one too
    uid0 = uids(elastic)["demo-0"]
    wait_until(lambda: all(uid0 in view_replicas(APP)[r]["pinned"] for r in before), 60, "demo-0 pinned on both")
    with Traffic(elastic) as traffic:  # 6 adapters x 1.5 headroom = 9 slots wanted, 6 held: one more replica
        (new,) = wait_until(lambda: set(view_replicas(APP)) - before, 240, "the policy to add a third replica")
        wait_until(lambda: running_workers() == 3, 120, "Serve to run the third replica")
        # real_pool targets the new replica: this process's router backs off until it hears of it
        pool = real_pool(new, APP)  # while traffic keeps the working set, and with it the third replica
        wait_until(lambda: uid0 in view_replicas(APP)[new]["pinned"], 60, "routers to see the pin on the new replica")
    assert not traffic.errors, traffic.errors[:3]
    warm = pool["warm_start"]
    plan, by_name = warm["plan"], uids(elastic)
    assert "demo-0" in plan["pins"] and uid0 in pool["pinned"]
    assert {by_name[n] for n in plan["slots"]} <= set(warm["resident"]), "planned adapters resident at ready"
    loaded = warm["loads_by_adapter_at_ready"]  # the pool's loads per adapter, as benchmarks.elastic reads them
    assert all(loaded.get(by_name[n], 0) >= 1 for n in plan["slots"]), loaded
    assert all(pool["loads_by_adapter"].get(u, 0) >= n for u, n in loaded.items())
    assert len(plan["slots"]) <= SLOTS - 1


def test_when_demand_goes_the_fleet_scales_in_and_the_departed_pins_move_to_survivors(elastic):
    with Traffic(elastic) as traffic:  # keeps the working set (and the third replica) while pins are set up
        three = live_replicas(3, APP, timeout_s=240)
        wait_until(lambda: running_workers() == 3, 120, "Serve to run three replicas")
        elastic.unpin_adapter.remote("demo-0").result(timeout_s=30)
        pinned = pin_one_per_replica(elastic, three)  # replica -> the adapter pinned on it alone
        by_name = uids(elastic)
        wait_until(lambda: all(by_name[n] in view_replicas(APP)[r]["pinned"] for r, n in pinned.items()), 90,
                   "each replica to pin its adapter")
    assert not traffic.errors, traffic.errors[:3]
    def two_left() -> list[str] | None:
        replicas = view_replicas(APP)
        return sorted(replicas) if len(replicas) == 2 and running_workers() == 2 else None

    survivors = wait_until(two_left, 180, "the policy to remove a replica once the working set fits")
    (gone,) = set(three) - set(survivors)
    moved = pinned[gone]
    (holder,) = pin_holders(moved, survivors, 1)

    def restored() -> bool:
        pools = {r: real_pool(r, APP) for r in survivors}
        assert all(len(p["pinned"]) <= SLOTS - 1 for p in pools.values()), pools  # the starvation guard holds
        return by_name[moved] in pools[holder]["pinned"]

    wait_until(restored, 60, f"{moved} (pinned on departed {gone}) to be pinned on {holder}")
    result = elastic.generate.remote(GenerateRequest(adapter=moved, prompt="x", max_tokens=2)).result(timeout_s=60)
    assert result.completion_tokens == 2

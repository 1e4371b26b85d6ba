"""``benchmarks.fleet_live``'s emulated GPU: the real engine, with the cost model's time for what a GPU does."""

from __future__ import annotations

import pytest

from benchmarks.live.emulated import EmulatedCosts
from benchmarks.live.peer_routers import ROUTER_ENV, VariantRouter, _order
from benchmarks.sim.costs import CostModel
from deployments.config import AppArgs
from engine.engine import LoRAEngine
from engine.request import GenerateRequest
from routing.hashing import rendezvous_order


@pytest.fixture
def emulated(demo_assets):
    costs = CostModel().scaled(0.05)  # a step of 1.25 ms: the test stays fast
    engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_loras_per_batch=2, max_lora_rank=16,
                                max_model_len=512, max_num_batched_tokens=64, max_batch_size=4,
                                enable_prefix_caching=False).engine_config())
    try:
        yield engine, EmulatedCosts(engine, costs, {"demo-1": 64, "demo-2": 8}), costs
    finally:
        engine.shutdown()


def test_steps_loads_and_reads_cost_the_models_time(emulated, demo_assets):
    engine, emulation, costs = emulated
    engine.register_adapter("demo-1", str(demo_assets.adapters["demo-1"]))
    assert emulation.disk_seconds == pytest.approx(costs.disk_read_s(64))  # the read, off the engine thread
    result = engine.generate_blocking(GenerateRequest(adapter="demo-1", token_ids=[11] * 100, max_tokens=4,
                                                      ignore_eos=True))
    assert result.completion_tokens == 4 and result.token_ids == [emulation.token] * 4
    # 100 prompt tokens under a 64-token budget: two prefill steps (the second samples the first token),
    # then three decode steps; the slot copy happened once, at the first step
    assert emulation.steps == 5
    assert emulation.step_seconds == pytest.approx(costs.step_s(64) + costs.step_s(36) + 3 * costs.step_s(0))
    assert emulation.copy_seconds == pytest.approx(costs.host_copy_s(64))
    # each step is timed whole: its sleeps, and the host work around them that the simulator must charge
    assert emulation.step_wall_seconds >= emulation.step_seconds + emulation.copy_seconds
    assert 0 < emulation.step_host_seconds < emulation.step_wall_seconds
    engine.generate_blocking(GenerateRequest(adapter="demo-1", token_ids=[12] * 8, max_tokens=1, ignore_eos=True))
    assert emulation.copy_seconds == pytest.approx(costs.host_copy_s(64))  # resident: no second copy


def test_a_host_tier_reread_costs_the_read_of_its_rank(emulated, demo_assets):
    engine, emulation, costs = emulated
    record = engine.register_adapter("demo-2", str(demo_assets.adapters["demo-2"]))
    engine.store.host_cache.remove(record.uid)  # evicted from the host tier
    engine.fetch_to_host(record.uid)
    assert emulation.disk_seconds == pytest.approx(2 * costs.disk_read_s(8))


def test_a_worker_reports_the_adapter_names_in_its_slots_and_host_tier(emulated, demo_assets):
    """What ``fleet_live`` records at each segment's start (a replay starts from the deploy's): names, not uids."""
    from types import SimpleNamespace

    from benchmarks.live.emulated_workers import EmulatedLoRAWorker
    from engine.request import ReplicaTarget

    engine, _, _ = emulated
    for name in ("demo-1", "demo-2"):
        engine.register_adapter(name, str(demo_assets.adapters[name]))
    engine.generate_blocking(GenerateRequest(adapter="demo-1", token_ids=[11] * 8, max_tokens=1, ignore_eos=True))
    worker = SimpleNamespace(replica_id="r1", engine=engine)
    got = EmulatedLoRAWorker.adapter_contents(worker)
    assert got == {"replica_id": "r1", "slots": ["demo-1"], "host": ["demo-1", "demo-2"]}
    with pytest.raises(RuntimeError, match="reached replica r1"):
        EmulatedLoRAWorker.adapter_contents(worker, ReplicaTarget("r2"))


def test_the_hash_peer_orders_replicas_by_rendezvous_and_the_variant_router_names_its_choices(monkeypatch):
    ids = tuple(f"r{i}" for i in range(6))
    assert list(_order("demo-3", ids)) == rendezvous_order("demo-3", list(ids))
    monkeypatch.setenv(ROUTER_ENV, "round-robin")
    with pytest.raises(ValueError, match="choose one of"):
        VariantRouter()

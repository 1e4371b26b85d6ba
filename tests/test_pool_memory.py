import pytest
import torch

from pool.errors import (
    AdapterInUseError,
    AdapterNotFoundError,
    BatchTooLargeError,
    NoEvictableSlotError,
    PinRefusedError,
    RankTooLargeError,
)
from pool.memory_pool import EMPTY, LoRAMemoryPool, batch_order
from pool.device import default_device

from pool_helpers import SHAPE, WeightBank, check_invariants, make_pool, make_weights, pool_state


def collect(pool):
    events = []
    pool.subscribe(events.append)
    return events


def test_seed_example_pinned_a_lru_c_b_a_batch_a_d_evicts_c():
    pool, _ = make_pool(slots=4)
    pool.prepare_lora_batch({None})
    for uid in ["C", "B", "A"]:  # LRU order: C oldest, then B, then A
        pool.prepare_lora_batch({uid})
    pool.release_batch()
    pool.pin("A")
    c_slot = pool.get_slot("C")
    slots = pool.prepare_lora_batch({"A", "D"})
    assert not pool.is_resident("C")
    assert slots["D"] == c_slot
    assert pool.is_resident("B") and pool.is_resident(None) and pool.is_resident("A")
    check_invariants(pool)


def test_slot_holds_rank_prefix_and_scaling():
    bank = WeightBank({"X": make_weights("X", rank=3, alpha=6.0), "R": make_weights("R", rank=4, alpha=8.0, rslora=True)})
    pool = LoRAMemoryPool(SHAPE, 2, 4, bank)
    slot = pool.prepare_lora_batch({"X"})["X"]
    w = bank.weights["X"]
    for m in SHAPE.modules:
        assert torch.equal(pool.a_buffers[m][:, slot, :3].cpu(), w.a[m])  # the pool is on CUDA when there is one
        assert torch.equal(pool.bt_buffers[m][:, slot, :3].cpu(), w.bt[m])
        assert torch.count_nonzero(pool.a_buffers[m][:, slot, 3:]) == 0
    assert pool.slot_ranks[slot] == 3
    assert float(pool.slot_scalings[slot]) == pytest.approx(2.0)
    rs = pool.prepare_lora_batch({"R"})["R"]
    assert float(pool.slot_scalings[rs]) == pytest.approx(8.0 / 2.0)  # alpha / sqrt(r)


def test_module_the_adapter_lacks_is_zeroed_not_leaked():
    """SGLang bug 7426: a slot's previous adapter must not leak into modules the new one lacks."""
    bank = WeightBank({
        "full": make_weights("full", rank=4, seed=1),
        "qonly": make_weights("qonly", rank=2, modules=["q_proj"], seed=2),
    })
    pool = LoRAMemoryPool(SHAPE, 1, 4, bank)
    slot = pool.prepare_lora_batch({"full"})["full"]
    pool.prepare_lora_batch({"qonly"})
    assert pool.get_slot("qonly") == slot
    for m in ["v_proj", "down_proj"]:
        assert torch.count_nonzero(pool.a_buffers[m][:, slot]) == 0
        assert torch.count_nonzero(pool.bt_buffers[m][:, slot]) == 0
    # the smaller rank's stale tail from "full" is zeroed as well
    assert torch.count_nonzero(pool.a_buffers["q_proj"][:, slot, 2:]) == 0


def test_base_model_slot_is_zero_rank_and_chosen_last():
    pool, _ = make_pool(slots=2)
    pool.prepare_lora_batch({"A"})
    pool.prepare_lora_batch({"B"})
    pool.release_batch()
    slot = pool.prepare_lora_batch({None})[None]  # evicts an adapter (A, the LRU one)
    assert not pool.is_resident("A")
    assert pool.slot_ranks[slot] == 0 and float(pool.slot_scalings[slot]) == 0.0
    for m in SHAPE.modules:
        assert torch.count_nonzero(pool.a_buffers[m][:, slot]) == 0
    pool.prepare_lora_batch({"C"})  # B is an adapter: evicted before the base slot
    assert pool.is_resident(None) and not pool.is_resident("B")
    pool.prepare_lora_batch({"D", "C"})  # only the base slot is a candidate now
    assert not pool.is_resident(None)
    check_invariants(pool)


def test_base_model_takes_the_last_empty_slot_so_adapters_stay_contiguous():
    pool, _ = make_pool(slots=5)
    pool.prepare_lora_batch({"A", "B"})
    assert pool.prepare_lora_batch({None, "A"})[None] == 4  # not slot 2, between the adapters
    slots = pool.prepare_lora_batch({"C", "D", "A", "B"})
    assert sorted(slots.values()) == [0, 1, 2, 3]  # one run: the CPU decode LoRA's one bmm pair (lora_padded)
    check_invariants(pool)


def test_running_batch_is_never_evicted():
    pool, _ = make_pool(slots=3)
    pool.prepare_lora_batch({"A", "B"})
    pool.prepare_lora_batch({"A", "B", "C"})  # A, B running: C takes the free slot
    pool.prepare_lora_batch({"A", "B", "D"})  # only C may go
    assert {u for u in pool.uid_to_slot} == {"A", "B", "D"}


def test_batch_larger_than_slots_is_refused_with_numbers_and_changes_nothing():
    pool, _ = make_pool(slots=3)
    pool.prepare_lora_batch({"A"})
    before = pool_state(pool)
    with pytest.raises(BatchTooLargeError) as err:
        pool.prepare_lora_batch({"A", "B", "C", "D"})
    assert "4 slots" in str(err.value) and "3 slots" in str(err.value)
    assert pool_state(pool) == before


def test_batch_that_cannot_fit_beside_pins_is_refused():
    pool, _ = make_pool(slots=3)
    pool.pin("A")
    pool.pin("B")
    assert not pool.validate_lora_batch({"C", "D"})
    assert pool.validate_lora_batch({"A", "B", "C"})
    before = pool_state(pool)
    with pytest.raises(BatchTooLargeError):
        pool.prepare_lora_batch({"C", "D"})
    assert pool_state(pool) == before


def test_validate_lora_batch_counts():
    pool, _ = make_pool(slots=4)
    assert pool.validate_lora_batch({None, "A", "B", "C"})
    assert not pool.validate_lora_batch({None, "A", "B", "C", "D"})
    pool.pin("A")
    assert pool.validate_lora_batch({None, "A", "B", "C"})
    assert not pool.validate_lora_batch({None, "B", "C", "D"})


def test_pinning_the_last_free_slot_is_refused():
    pool, _ = make_pool(slots=3)
    pool.pin("A")
    pool.pin("B")
    before = pool_state(pool)
    with pytest.raises(PinRefusedError) as err:
        pool.pin("C")
    assert "2 of 3" in str(err.value)
    assert pool_state(pool) == before
    check_invariants(pool)


def test_pin_loads_and_pinned_adapter_is_never_a_victim():
    pool, _ = make_pool(slots=2)
    pool.pin("A")
    for uid in "BCDEFG":
        pool.prepare_lora_batch({uid})
        assert pool.is_resident("A")
    assert pool.eviction_policy.eviction_count == 5


def test_pin_with_no_evictable_slot_is_refused_and_changes_nothing():
    pool, _ = make_pool(slots=3)
    pool.prepare_lora_batch({"A", "B", "C"})
    before = pool_state(pool)
    with pytest.raises(NoEvictableSlotError):
        pool.pin("D")
    assert pool_state(pool) == before


def test_unpin_and_unknown_unpin():
    pool, _ = make_pool(slots=3)
    pool.pin("A")
    assert pool.unpin("A") is True
    assert pool.unpin("A") is False
    with pytest.raises(AdapterNotFoundError):
        pool.unpin("nope")


def test_unload_frees_slot_and_is_refused_while_running():
    pool, _ = make_pool(slots=3)
    pool.prepare_lora_batch({"A", "B"})
    before = pool_state(pool)
    with pytest.raises(AdapterInUseError):
        pool.remove("A")
    assert pool_state(pool) == before
    pool.release_batch()
    pool.pin("A")
    assert pool.remove("A") is True
    assert not pool.is_resident("A") and "A" not in pool.pinned
    assert pool.free_slots() == 2
    assert pool.remove("A") is False
    # a reload after unload is a fresh FIFO/LRU entry
    pool.prepare_lora_batch({"A"})
    check_invariants(pool)


def test_unknown_adapter_fetch_error_changes_nothing():
    pool, _ = make_pool(slots=2)
    pool.prepare_lora_batch({"A", "B"})
    before = pool_state(pool)
    with pytest.raises(AdapterNotFoundError):
        pool.prepare_lora_batch({"A", "nope"})
    assert pool_state(pool) == before


def test_rank_above_pool_max_names_both_numbers():
    bank = WeightBank({"big": make_weights("big", rank=8)})
    pool = LoRAMemoryPool(SHAPE, 2, 4, bank)
    before = pool_state(pool)
    with pytest.raises(RankTooLargeError) as err:
        pool.prepare_lora_batch({"big"})
    assert "8" in str(err.value) and "4" in str(err.value)
    assert pool_state(pool) == before


def test_events_have_gapless_sequence_and_kinds():
    pool, _ = make_pool(slots=2)
    events = collect(pool)
    pool.prepare_lora_batch({None, "A"})
    pool.prepare_lora_batch({"B"})  # evicts A (None is chosen last)
    pool.release_batch()
    pool.pin("B")
    pool.unpin("B")
    pool.remove("B")
    kinds = [(e.kind, e.uid) for e in events]
    assert kinds == [("load", "A"), ("evict", "A"), ("load", "B"), ("pin", "B"), ("unpin", "B"), ("unload", "B")]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert all(e.replica_id == "r0" for e in events)
    assert events[1].slot == events[2].slot  # B took A's slot
    snap = pool.snapshot()
    assert snap.seq == events[-1].seq
    assert snap.resident == {} and snap.free_slots == 1 and snap.base_slot is not None


def test_counters_count_batch_entries_not_steps():
    pool, _ = make_pool(slots=2)
    pool.prepare_lora_batch({"A"})       # miss
    for _ in range(5):
        pool.prepare_lora_batch({"A"})   # still running: not counted again
    pool.release_batch()
    pool.prepare_lora_batch({"A"})       # hit
    pool.prepare_lora_batch({"A", "B"})  # B miss
    c = pool.snapshot().counters
    assert (c.hits, c.misses, c.loads, c.evictions) == (1, 2, 2, 0)
    assert c.load_seconds > 0


def test_fifo_and_lru_pools_differ_exactly_where_reuse_refreshes():
    results = {}
    for policy in ["lru", "fifo"]:
        pool, _ = make_pool(slots=2, policy=policy)
        for uid in ["A", "B", "A", "C"]:
            pool.prepare_lora_batch({uid})
        pool.release_batch()
        results[policy] = sorted(u for u in pool.uid_to_slot)
    assert results["lru"] == ["A", "C"]
    assert results["fifo"] == ["B", "C"]


def test_batch_order_is_deterministic_with_base_first():
    assert batch_order({"b", None, "a"}) == [None, "a", "b"]


def test_pool_uses_default_device_and_requested_dtype():
    pool = LoRAMemoryPool(SHAPE, 2, 4, WeightBank({}), dtype=torch.bfloat16)
    assert pool.device == default_device()
    assert pool.a_buffers["q_proj"].dtype == torch.bfloat16
    assert pool.a_buffers["q_proj"].shape == (2, 2, 4, 8)
    assert pool.bt_buffers["v_proj"].shape == (2, 2, 4, 4)
    assert pool.slot_to_uid == [EMPTY, EMPTY]


def test_bad_construction_arguments():
    with pytest.raises(ValueError):
        LoRAMemoryPool(SHAPE, 0, 4, WeightBank({}))
    with pytest.raises(ValueError):
        LoRAMemoryPool(SHAPE, 2, 0, WeightBank({}))
    with pytest.raises(ValueError):
        make_pool(policy="mru")


def test_kept_adapters_are_evicted_last_and_refuse_nothing():
    pool, _ = make_pool(slots=3)
    for uid in "ABC":  # LRU order A (oldest), B, C
        pool.prepare_lora_batch([uid])
    pool.release_batch()
    pool.keep(["A", "B"])  # the plan places A and B here
    pool.prepare_lora_batch(["D"])
    assert "C" not in pool.uid_to_slot and {"A", "B", "D"} <= set(pool.uid_to_slot)  # C went, not LRU's A
    pool.release_batch()
    pool.keep(["A", "B", "D"])  # everything kept: the policy's order decides among them all
    pool.prepare_lora_batch(["E"])
    assert "A" not in pool.uid_to_slot
    check_invariants(pool)
    pool.release_batch()
    pool.pin("B")
    pool.keep(["B", "D", "E"])
    pool.prepare_lora_batch(["A"])  # a kept adapter may still go when nothing else can; a pinned one never
    assert "B" in pool.uid_to_slot and "A" in pool.uid_to_slot
    check_invariants(pool)


def test_loads_by_adapter_breaks_the_load_counter_down_and_forgets_a_removed_adapter():
    """What ``LoRAWorker.pool_state`` reports per adapter (a warm start's loads after ready are read from it)."""
    pool, _ = make_pool(slots=2)
    for uid in ["A", "B", "C", "A"]:  # two slots, LRU: C evicts A, then A evicts B
        pool.prepare_lora_batch({uid})
        pool.release_batch()
    assert pool.loads_by_adapter() == {"A": 2, "B": 1, "C": 1}
    assert sum(pool.loads_by_adapter().values()) == pool.counters.loads
    pool.remove("A")
    pool.remove("B")  # not resident: its count goes too (the adapter left the replica)
    assert pool.loads_by_adapter() == {"C": 1}

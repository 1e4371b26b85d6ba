"""Small in-memory adapters and pools for the pool's unit and property tests."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from pool.adapter import AdapterConfig, LoRAAdapterWeights
from pool.memory_pool import LoRAMemoryPool
from pool.shapes import LoRAModelShape, ModuleShape

SHAPE = LoRAModelShape(
    num_layers=2,
    modules={"q_proj": ModuleShape(8, 8), "v_proj": ModuleShape(8, 4), "down_proj": ModuleShape(12, 8)},
)


def make_weights(name: str, rank: int = 2, modules: Optional[Iterable[str]] = None, seed: int = 0,
                 shape: LoRAModelShape = SHAPE, alpha: float = 16.0, rslora: bool = False) -> LoRAAdapterWeights:
    g = torch.Generator().manual_seed(seed)
    mods = list(modules) if modules is not None else list(shape.modules)
    a = {m: torch.randn(shape.num_layers, rank, shape.modules[m].in_features, generator=g) for m in mods}
    bt = {m: torch.randn(shape.num_layers, rank, shape.modules[m].out_features, generator=g) for m in mods}
    cfg = AdapterConfig(rank=rank, alpha=alpha, use_rslora=rslora, target_modules=tuple(mods))
    return LoRAAdapterWeights(name, cfg, a, bt)


class WeightBank:
    """fetch_weights backed by a dict; unknown uids raise like the store does."""

    def __init__(self, weights: dict[str, LoRAAdapterWeights]):
        self.weights = weights
        self.fetches: list[str] = []

    def __call__(self, uid: str) -> LoRAAdapterWeights:
        from pool.errors import AdapterNotFoundError

        self.fetches.append(uid)
        if uid not in self.weights:
            raise AdapterNotFoundError(f"adapter {uid!r} is not registered")
        return self.weights[uid]


def make_pool(slots: int = 4, names: Iterable[str] = "ABCDEFG", policy: str = "lru", max_rank: int = 4,
              ranks: Optional[dict[str, int]] = None) -> tuple[LoRAMemoryPool, WeightBank]:
    ranks = ranks or {}
    bank = WeightBank({n: make_weights(n, rank=ranks.get(n, 2), seed=i) for i, n in enumerate(names)})
    return LoRAMemoryPool(SHAPE, slots, max_rank, bank, eviction_policy=policy, replica_id="r0"), bank


def pool_state(pool: LoRAMemoryPool) -> tuple:
    """Everything observable about a pool, for 'a refused step changed nothing' checks."""
    order = list(getattr(pool.eviction_policy, "order", lambda: [])())
    return (
        dict(pool.uid_to_slot), list(pool.slot_to_uid), set(pool.pinned), pool.active, list(pool.slot_ranks),
        pool.slot_scalings.clone().tolist(), pool.snapshot().seq, order, pool.eviction_policy.eviction_count,
        tuple((m, tuple(t.flatten().tolist())) for m, t in sorted(pool.a_buffers.items())),
        tuple((m, tuple(t.flatten().tolist())) for m, t in sorted(pool.bt_buffers.items())),
        pool.snapshot().counters,
    )


def check_invariants(pool: LoRAMemoryPool) -> None:
    from pool.memory_pool import EMPTY

    assert len(pool.slot_to_uid) == pool.slots
    for uid, slot in pool.uid_to_slot.items():
        assert pool.slot_to_uid[slot] == uid
    occupied = [u for u in pool.slot_to_uid if u is not EMPTY]
    assert len(occupied) == len(set(occupied)) == len(pool.uid_to_slot)
    assert pool.pinned <= set(pool.uid_to_slot)
    assert len(pool.pinned) <= pool.slots - 1
    assert set(pool.active) <= set(pool.uid_to_slot)
    if None in pool.uid_to_slot:
        s = pool.uid_to_slot[None]
        assert pool.slot_ranks[s] == 0 and float(pool.slot_scalings[s]) == 0.0

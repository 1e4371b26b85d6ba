"""Settings a running engine changes without a restart (Serve's ``user_config``)."""

from __future__ import annotations

from pool.eviction import get_eviction_policy
from pool.memory_pool import LoRAMemoryPool

from .config import EngineConfig
from .scheduler import Scheduler

LIVE_SETTINGS = ("eviction_policy", "max_batch_size", "max_tokens_limit")


def apply_live_settings(settings: dict, *, config: EngineConfig, pool: LoRAMemoryPool, scheduler: Scheduler,
                        kv_blocks: int) -> None:
    """Check every setting first, then apply them all: a bad one changes nothing.

    ``kv_blocks`` bounds ``max_batch_size``: every running request holds at least one KV block.
    """
    unknown = sorted(set(settings) - set(LIVE_SETTINGS))
    if unknown:
        raise ValueError(f"not live-changeable: {unknown}; live settings are {list(LIVE_SETTINGS)}")
    policy = get_eviction_policy(settings["eviction_policy"]) if "eviction_policy" in settings else None
    size = settings.get("max_batch_size")
    if size is not None and not 1 <= int(size) <= kv_blocks:
        raise ValueError(f"max_batch_size must be in [1, {kv_blocks}] (the KV cache's blocks), got {size}")
    budget = scheduler.max_num_batched_tokens
    if size is not None and budget is not None and int(size) > budget:
        raise ValueError(f"max_batch_size must be at most max_num_batched_tokens={budget} (one step must fit "
                         f"every running request's next token), got {size}")
    limit = settings.get("max_tokens_limit")
    if limit is not None and int(limit) < 1:
        raise ValueError(f"max_tokens_limit must be >= 1, got {limit}")
    if policy is not None:
        pool.set_eviction_policy(policy)
    if size is not None:
        scheduler.max_batch_size = int(size)
    if limit is not None:
        config.max_tokens_limit = int(limit)

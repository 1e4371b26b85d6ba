"""Engine settings: one dataclass, filled from serve_config.yaml's application args."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pool.shapes import ALL_TARGET_MODULES


@dataclass
class EngineConfig:
    base_model: str = "demo"
    revision: Optional[str] = None
    dtype: str = "float32"
    device: Optional[str] = None             # None/"auto": cuda when available
    max_loras_per_batch: int = 4             # pool slots, the base model's slot included
    max_lora_rank: int = 16
    target_modules: tuple[str, ...] = ALL_TARGET_MODULES
    eviction_policy: str = "lru"
    host_cache_bytes: int = 1 << 30
    max_batch_size: int = 16                 # running requests (= KV cache rows)
    max_model_len: Optional[int] = None      # None: min(max_position_embeddings, 2048)
    max_tokens_limit: int = 1024
    adapter_roots: Optional[list[str]] = None  # allow-list of local folders (None: any)
    hub_orgs: Optional[list[str]] = None       # allow-list of hub organisations (None: any)
    max_bypass_steps: int = 16
    replica_id: str = "local"
    extra: dict = field(default_factory=dict)

"""Adapter memory: eviction policies, the slot pool, adapter loading, the host tier."""

from .adapter import AdapterConfig, LoRAAdapterWeights, load_adapter_folder
from .events import PoolCounters, PoolEvent, PoolSnapshot
from .eviction import (
    EvictionPolicy,
    FIFOEvictionPolicy,
    LRUEvictionPolicy,
    SIEVEEvictionPolicy,
    get_eviction_policy,
)
from .host_cache import HostAdapterCache
from .memory_pool import EMPTY, LoRAMemoryPool
from .shapes import LoRAModelShape, ModuleShape
from .sources import SourcePolicy, resolve_adapter_source
from .store import AdapterStore

__all__ = [
    "AdapterConfig", "AdapterStore", "EMPTY", "EvictionPolicy", "FIFOEvictionPolicy", "HostAdapterCache",
    "LRUEvictionPolicy", "LoRAAdapterWeights", "LoRAMemoryPool", "LoRAModelShape", "ModuleShape",
    "PoolCounters", "PoolEvent", "PoolSnapshot", "SIEVEEvictionPolicy", "SourcePolicy", "get_eviction_policy",
    "load_adapter_folder", "resolve_adapter_source",
]

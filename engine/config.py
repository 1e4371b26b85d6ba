"""Engine settings: one dataclass with no defaults of its own.

Every value comes from the application args (``deployments.config.AppArgs``, the single
source of defaults, via ``AppArgs.engine_config``), so a setting cannot mean one thing in
serve_config.yaml and another in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineConfig:
    base_model: str
    revision: Optional[str]
    dtype: str
    device: Optional[str]                    # None/"auto": cuda when available
    max_loras_per_batch: int                 # pool slots, the base model's slot included
    max_lora_rank: int
    target_modules: tuple[str, ...]
    eviction_policy: str
    host_cache_bytes: int
    max_batch_size: int                      # running requests at most (each holds KV blocks for its tokens)
    max_num_batched_tokens: Optional[int]    # tokens one step feeds (longer prompts are chunked); None: per device
    long_prefill_tokens: Optional[int]       # a prompt with more tokens left is long; None: per device
    long_prefill_chunk_tokens: Optional[int]  # tokens a step feeds of a long prompt; None: per device
    max_model_len: Optional[int]             # None: min(max_position_embeddings, 2048, what the KV cache holds)
    kv_cache_bytes: Optional[int]            # KV budget; None: CUDA kv_cache_memory_fraction of free memory, CPU max_batch_size x max_model_len tokens
    kv_cache_memory_fraction: float          # on CUDA with kv_cache_bytes None: share of the memory free after weights and pool
    kv_block_size: int                       # token positions per KV block
    enable_prefix_caching: bool              # reuse full KV blocks of the same adapter uid and prompt prefix
    max_tokens_limit: int
    adapter_roots: Optional[list[str]]       # allow-list of local folders (None: any)
    hub_orgs: Optional[list[str]]            # allow-list of hub organisations (None: any)
    object_store_prefixes: Optional[list[str]]  # allow-list of s3:// and gs:// prefixes (None: any)
    adapter_cache_dir: Optional[str]         # node-local object-store download cache (None: the default)
    adapter_cache_bytes: Optional[int]       # disk budget of the node's adapter download caches (None: unbounded)
    max_bypass_steps: int
    max_waiting_requests: int                # a full waiting queue refuses new requests (503), never grows
    replica_id: str

"""Sizing the paged KV cache for a model, and the context window it can serve."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .attention import KV_LAYOUT, choose_backend
from .config import EngineConfig
from .kv_cache import PagedKVCache, kv_budget_bytes, kv_bytes_per_token

log = logging.getLogger(__name__)

# Tokens one step feeds when ``max_num_batched_tokens`` is unset. CUDA: enough to keep a large GPU's
# GEMMs busy while bounding the MLP's temporaries (8192 x intermediate 14336 x 2 bytes ~ 235 MB for
# Llama-3-8B). CPU: a GEMM costs less per token the more tokens it takes (measured on 2 cores, fp32,
# 1024 x 5632: 2.3x cheaper per token at 512 rows than at 32, 1.4x than at 256), so many short prompts
# arriving together are best prefilled in one large step; 256 served 30-45% fewer tok/s than 1024 on
# ``benchmarks.engine_throughput``'s all-at-once rows.
DEFAULT_TOKEN_BUDGET = {"cuda": 8192, "cpu": 1024}
# Tokens a step feeds of a long prompt when ``long_prefill_tokens`` is unset and so is the budget: on the CPU
# a chunk's step is what a short request arriving meanwhile waits at most, and what every running decode waits
# for its next token; on CUDA no cap (a full 8192-token step is tens of ms). A configured budget sizes steps
# itself: no cap then. CPU 128, not 256: ``benchmarks.engine_throughput``'s long-prompt rows (2 prompts of 4096
# tokens among 32 short Poisson requests, 2 shared cores, 3 rounds each taking turns) measured the short
# requests' TTFT p99 over their p99 alone at 3.157/6.406/3.438 with 256 and 2.243/1.732/1.902 with 128 (short
# TPOT p99 ~420 -> ~240 ms), the long prompts' TTFT p50 7.2-10.3 s -> 8.6-12.3 s, and all-at-once tok/s
# 119.8/115.7/100.9 vs 82.7/112.2/88.9 (best 119.8 vs 112.2: noise on a loaded machine; its prompts of 16-128
# tokens are never long at either cap, so their steps are the same).
# A long prompt's chunk (``long_prefill_chunk_tokens``) when unset with the defaults: CPU 64 (seventeenth round, the
# same rows, 4 runs each, threshold and chunk both 64 against both 128): short TTFT ratio 1.37/1.73/0.92/1.64 against
# 2.16/2.07/2.07/2.05 (short TPOT during the long prompts 115-137 -> 63-72 ms), the long prompts' own TTFT p50
# 5.5-6.5 s -> 6.6-7.8 s. A threshold of 64 made every prompt of 65-128 tokens long too, fed alone among prefills
# (all-at-once rows, prompts 16-128: 279 -> 242/233 tok/s in one window), so the threshold stays 128.
DEFAULT_LONG_PREFILL = {"cuda": None, "cpu": 128}
DEFAULT_LONG_PREFILL_CHUNK = {"cuda": None, "cpu": 64}
# With the CPU defaults a long prompt's chunk shrinks as its cached context grows (``Scheduler``'s ``context_span``):
# a fed token's attention over c cached tokens is 4 * heads * head_dim * c flops against 2 * (its projections'
# weights) for the projections, and on the CPU it runs at about half the projections' flop rate (the K/V gather and
# a masked SDPA; ``benchmarks.engine_throughput``'s model, 2 cores: a 64-token chunk 41 ms at no context, 87 ms after
# 4032 cached tokens, a 32-token one 26 / 53 ms), so the span is the flops' ratio over this factor.
CPU_ATTENTION_COST_FACTOR = 2.0


def token_budget(config: EngineConfig, device: torch.device) -> int:
    """Tokens per step: the configured budget, else the device's default; never below ``max_batch_size``
    (every running request's next token must fit one step)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens  # the scheduler refuses one below max_batch_size
    default = DEFAULT_TOKEN_BUDGET["cuda" if device.type == "cuda" else "cpu"]
    return max(default, config.max_batch_size)


def long_prefill_cap(config: EngineConfig, device: torch.device) -> Optional[int]:
    """Most tokens a step feeds of a long prompt (``Scheduler``'s ``long_prefill_tokens``): the configured cap,
    else the device's default while the budget is the default too; None: no cap."""
    if config.long_prefill_tokens is not None:
        return config.long_prefill_tokens
    if config.max_num_batched_tokens is not None:
        return None
    return DEFAULT_LONG_PREFILL["cuda" if device.type == "cuda" else "cpu"]


def long_prefill_chunk(config: EngineConfig, device: torch.device) -> Optional[int]:
    """Tokens a step feeds of a long prompt (``Scheduler``'s ``long_prefill_chunk_tokens``): the configured chunk,
    else the device's default while the budget and the long threshold are the defaults too, else the threshold."""
    if config.long_prefill_chunk_tokens is not None:
        return config.long_prefill_chunk_tokens
    if config.max_num_batched_tokens is None and config.long_prefill_tokens is None:
        default = DEFAULT_LONG_PREFILL_CHUNK["cuda" if device.type == "cuda" else "cpu"]
        if default is not None:
            return default
    return long_prefill_cap(config, device)


def context_span(model, config: EngineConfig, device: torch.device) -> Optional[int]:
    """Cached tokens whose attention costs one fed token's projections, for the scheduler's long-prompt chunks:
    on the CPU while the budget, the long threshold and the chunk are all the defaults; None elsewhere (a configured
    chunk stays a token count)."""
    if device.type == "cuda" or (config.max_num_batched_tokens, config.long_prefill_tokens,
                                 config.long_prefill_chunk_tokens) != (None, None, None):
        return None
    layer = model.model.layers[0]
    attn = layer.self_attn
    weights = sum(module.weight.numel() for module in (
        attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))
    per_position = 2 * attn.q_proj.weight.shape[0]  # 4 * heads * head_dim flops against 2 * weights
    return max(1, int(weights / per_position / CPU_ATTENTION_COST_FACTOR))


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv heads, head size) of a transformers decoder."""
    attn = model.model.layers[0].self_attn
    return len(model.model.layers), attn.k_proj.weight.shape[0] // attn.head_dim, attn.head_dim


def build_kv_cache(model, config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
                   reserve_bytes: int = 0, budget_bytes: Optional[int] = None,
                   backend: Optional[str] = None) -> PagedKVCache:
    """The paged KV cache sized by ``kv_cache_bytes`` (see ``kv_budget_bytes`` for the default), or by
    ``budget_bytes`` when given; ``reserve_bytes`` (a step's activations) is left out of the free memory.
    ``backend``: the attention backend it is laid out for (the engine's checked choice); None: ``choose_backend``."""
    layers, kv_heads, head_dim = kv_shape(model)
    if budget_bytes is None:
        budget_bytes = kv_budget_bytes(config.kv_cache_bytes, device=device,
                                       bytes_per_token=kv_bytes_per_token(layers, kv_heads, head_dim, dtype),
                                       max_batch_size=config.max_batch_size, max_model_len=max_model_len,
                                       memory_fraction=config.kv_cache_memory_fraction, reserve_bytes=reserve_bytes)
    if backend is None:
        backend = choose_backend(device, dtype, head_dim=head_dim)
    return PagedKVCache.from_budget(budget_bytes, layers, config.kv_block_size, kv_heads, head_dim, device=device,
                                    dtype=dtype, prefix_caching=config.enable_prefix_caching,
                                    layout=KV_LAYOUT[backend])


def fit_max_model_len(cache: PagedKVCache, max_model_len: int, configured: bool) -> int:
    """A request must fit the cache alone (so the oldest request can always run): clamp the
    default context window to the cache, refuse a configured one it cannot hold."""
    capacity = cache.capacity_tokens
    if max_model_len <= capacity:
        return max_model_len
    if configured:
        raise ValueError(f"max_model_len={max_model_len} does not fit the KV cache ({cache.num_blocks} "
                         f"blocks of {cache.block_size} tokens = {capacity} tokens): raise kv_cache_bytes "
                         f"or lower max_model_len")
    log.warning("context window clamped to the KV cache's %d tokens (the model allows %d)", capacity, max_model_len)
    return capacity

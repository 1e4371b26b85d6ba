"""The memory one full step's activations take, measured at start, so the KV cache leaves room for it.

The engine runs one profiling forward of ``max_num_batched_tokens`` prompt tokens (the most
a step may feed, whatever mix of prefill chunks and decodes) through its own runner over a
throwaway cache, and reads the CUDA allocator's peak above what was allocated before. The
KV cache is then sized from the memory free after that reserve, so no burst of long
prompts runs a step out of memory. On the CPU the KV budget does not come from free
memory, so nothing is measured there.
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import EngineConfig
from .kv_cache import kv_bytes_per_token
from .kv_setup import build_kv_cache, kv_shape
from .lora_layers import LoRABatchContext
from .model_runner import ModelRunner, SeqInput

# headroom over the measured peak: allocator fragmentation and the sampler's temporaries
RESERVE_MARGIN = 1.1


def profile_forward(model, pool, context: LoRABatchContext, config: EngineConfig, device: torch.device,
                    dtype: torch.dtype, tokens: int, backend: Optional[str] = None,
                    lora_kernels: Optional[bool] = None) -> torch.Tensor:
    """One forward of ``tokens`` prompt tokens over a cache just large enough for them; its logits
    (``backend``, ``lora_kernels``: the engine's checked fast paths, see ``ModelRunner``)."""
    layers, kv_heads, head_dim = kv_shape(model)
    blocks = -(-tokens // config.kv_block_size)
    per_block = config.kv_block_size * kv_bytes_per_token(layers, kv_heads, head_dim, dtype)
    cache = build_kv_cache(model, config, device, dtype, tokens, budget_bytes=blocks * per_block, backend=backend)
    runner = ModelRunner(model, pool, cache, context, lora_kernels=lora_kernels)
    ids = [i % model.config.vocab_size for i in range(tokens)]
    return runner.forward([SeqInput(list(range(blocks)), ids, 0, 0)])


def activation_reserve_bytes(model, pool, context: LoRABatchContext, config: EngineConfig, device: torch.device,
                             dtype: torch.dtype, tokens: int, backend: Optional[str] = None,
                             lora_kernels: Optional[bool] = None) -> int:
    """Peak bytes a step of ``tokens`` tokens allocates beyond what is allocated now (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(model, pool, context, config, device, dtype, tokens, backend, lora_kernels)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak * RESERVE_MARGIN)

"""The paged KV cache: per layer, one K and one V tensor cut into fixed-size blocks.

Memory is a byte budget cut into blocks of ``block_size`` token positions
(``engine.block_allocator``); a sequence holds only the blocks its tokens fill, so short
requests no longer pay for ``max_model_len``. Two layouts, one per attention backend:

- ``page_major``: ``[num_blocks, kv_heads, block_size, head_dim]``, FlashInfer's ``HND``
  paged layout, which its CUDA kernels read as it is;
- ``head_major``: ``[kv_heads, num_blocks, block_size, head_dim]`` for the torch path.

Either is gathered as rows of ``block_size * head_dim`` values (``block_rows``, ``gather_rows``):
a step's blocks come out ``[kv_heads, tokens, head_dim]``, the layout the torch path's batched
matmuls take, with no transpose copy; decode rows read it position by position (``position_rows``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .block_allocator import BlockAllocator, KVCacheFullError

__all__ = ["PagedKVCache", "KVCacheFullError", "kv_budget_bytes", "kv_bytes_per_token", "LAYOUTS"]

LAYOUTS = ("head_major", "page_major")


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token position across all layers."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_budget_bytes(configured: Optional[int], *, device: torch.device, bytes_per_token: int,
                    max_batch_size: int, max_model_len: int, memory_fraction: float, reserve_bytes: int = 0) -> int:
    """The KV budget: ``configured`` if set; else on CUDA ``memory_fraction`` of the memory free
    now (after weights and the LoRA pool) less ``reserve_bytes`` (a full step's activations, measured);
    else what the contiguous rows took (``max_batch_size x max_model_len`` tokens)."""
    if configured is not None:
        if int(configured) < bytes_per_token:
            raise ValueError(f"kv_cache_bytes={configured} is less than one token's K/V ({bytes_per_token} bytes)")
        return int(configured)
    if device.type == "cuda":
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {memory_fraction}")
        free, _ = torch.cuda.mem_get_info(device)
        if free <= reserve_bytes:
            raise ValueError(f"a step of activations needs {reserve_bytes} bytes but only {free} are free: lower "
                             f"max_num_batched_tokens")
        return int((free - reserve_bytes) * memory_fraction)
    return max_batch_size * max_model_len * bytes_per_token


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 device: torch.device, dtype: torch.dtype, prefix_caching: bool = True, layout: str = "head_major"):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; choose one of {LAYOUTS}")
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
        self.layout = layout
        if layout == "page_major":
            shape = (num_layers, num_blocks, kv_heads, block_size, head_dim)
        else:
            shape = (num_layers, kv_heads, num_blocks, block_size, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_layers = num_layers
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.bytes_per_block = block_size * kv_bytes_per_token(num_layers, kv_heads, head_dim, dtype)
        self.peak_blocks_used = 0

    @classmethod
    def from_budget(cls, budget_bytes: int, num_layers: int, block_size: int, kv_heads: int, head_dim: int, *,
                    device: torch.device, dtype: torch.dtype, prefix_caching: bool = True,
                    layout: str = "head_major") -> "PagedKVCache":
        per_block = block_size * kv_bytes_per_token(num_layers, kv_heads, head_dim, dtype)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                             f"({per_block} bytes each)")
        return cls(num_layers, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype,
                   prefix_caching=prefix_caching, layout=layout)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the cache can hold at all (alone)."""
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def note_usage(self) -> None:
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)

    def release(self) -> None:
        """Drop the K/V tensors (an engine that shut down): on CUDA the memory goes back to the allocator's pool at
        once, and to the device with ``torch.cuda.empty_cache``, so the next engine's sizing sees it free."""
        device = self.k.device
        self.k = self.v = torch.empty(0, device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K/V ([tokens, kv_heads, head_dim]): token i at ``blocks[i]``, ``offsets[i]``."""
        if self.layout == "page_major":
            self.k[layer][blocks, :, offsets] = k
            self.v[layer][blocks, :, offsets] = v
        else:
            self.k[layer][:, blocks, offsets] = k.transpose(0, 1)
            self.v[layer][:, blocks, offsets] = v.transpose(0, 1)

    def block_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Row ids of ``blocks`` (flat ids) for ``gather_rows``: every KV head's copy of each block, head by head.

        Why rows: a layer's K (or V) seen as ``[kv_heads * num_blocks, block_size * head_dim]`` (either layout: a
        block of one head is ``block_size * head_dim`` contiguous values) is gathered along its first axis, which
        ``index_select`` does with one ``memcpy`` per row; along the block axis of the 4-d tensor it ran a strided
        copy per block (measured on 2 cores, fp32, 160 blocks of 16 x 8 heads x 64: K and V of one layer 1.2 ms
        -> 0.22 ms, a decode step at batch 32 gathers 8 of them). The ids depend only on the blocks, so a step
        computes them once and every layer reuses them."""
        heads = torch.arange(self.kv_heads, device=blocks.device)[:, None]
        if self.layout == "page_major":  # [blocks, kv_heads, ...]: a block's heads are neighbours
            return (blocks[None, :] * self.kv_heads + heads).reshape(-1)
        return (heads * self.k.shape[2] + blocks[None, :]).reshape(-1)  # [kv_heads, blocks, ...]

    def gather_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the rows ``block_rows(blocks)`` names: ``[kv_heads, len(blocks) * block_size, head_dim]``."""
        return self.gather_keys(layer, rows), self.gather_values(layer, rows)

    def gather_keys(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """K alone of ``gather_rows``."""
        return self._gather(self.k[layer], rows)

    def gather_values(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """V alone of ``gather_rows``."""
        return self._gather(self.v[layer], rows)

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        shape = (self.kv_heads, rows.numel() // self.kv_heads * self.block_size, self.head_dim)
        return cache.view(-1, self.block_size * self.head_dim).index_select(0, rows).view(shape)

    def position_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """For ``blocks`` ``[rows, n]`` (each row's block ids), ``[rows, kv_heads, n * block_size]``: the row of
        ``key_positions``/``value_positions`` holding each (row, KV head, position), in either layout.

        Why positions, not blocks (``block_rows``): a decode step gathers K only up to its longest row and reads V
        only up to each row's length (``attention_layout``), not the unwritten rest of each last block."""
        heads = torch.arange(self.kv_heads, device=blocks.device)[None, :, None]
        if self.layout == "page_major":  # [blocks, kv_heads, block_size, head_dim]
            rows = blocks[:, None, :] * self.kv_heads + heads
        else:  # [kv_heads, blocks, block_size, head_dim]
            rows = heads * self.k.shape[2] + blocks[:, None, :]
        offsets = torch.arange(self.block_size, device=blocks.device)
        return (rows[..., None] * self.block_size + offsets).flatten(2)

    def key_positions(self, layer: int) -> torch.Tensor:
        """K of ``layer`` as one row per (KV head, block, position): ``[-1, head_dim]`` (``position_rows``)."""
        return self.k[layer].view(-1, self.head_dim)

    def value_positions(self, layer: int) -> torch.Tensor:
        """V of ``layer`` as one row per (KV head, block, position): ``[-1, head_dim]``, in either layout row
        ``block_row * block_size + offset`` for a ``block_rows`` id (attention reads V there without a gather)."""
        return self.v[layer].view(-1, self.head_dim)

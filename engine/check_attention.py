"""The start-up checks of attention's fast paths: FlashInfer's paged attention (one tiny step against
``TorchPagedAttention``) and the torch backend's ``sampled_addmm`` decode scores (``sparse_scores_error``).

The step has what serving has: a prefill from position 0, a chunk that continues a cached
prefix, and a decode row, over block tables that are not in order, for each sliding-window
size the model's layers use. Both backends read the same K/V, written into a cache of
each one's layout; the first ``plan`` and ``run`` compile FlashInfer's kernels for this
model's head size and dtype, so serving never does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .attention import KV_LAYOUT, TorchPagedAttention
from .attention_layout import StepLayout
from .fast_paths import relative_error
from .kv_cache import PagedKVCache

BLOCK_SIZE = 16
# (first new position, new tokens) per sequence: a prefill, a chunk after a cached prefix, a decode row
SEQUENCES = ((0, 21), (19, 7), (37, 1))


def flashinfer_error(device: torch.device, dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int,
                     windows: Sequence[Optional[int]], scale: float, seed: int) -> float:
    """The largest relative difference of FlashInfer's output from torch's over the step, for every window."""
    from .attention_flashinfer import FlashInferPagedAttention

    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(start + n) // BLOCK_SIZE) for start, n in SEQUENCES]
    total_blocks = sum(blocks_per_seq)
    order = torch.randperm(total_blocks, generator=g).tolist()  # tables out of order, as after churn
    tables, at = [], 0
    for nb in blocks_per_seq:
        tables.append(order[at:at + nb])
        at += nb
    caches = {name: PagedKVCache(1, total_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype,
                                 prefix_caching=False, layout=layout) for name, layout in KV_LAYOUT.items()}
    lengths = [start + n for start, n in SEQUENCES]
    full_k = [torch.randn(n, kv_heads, head_dim, generator=g).to(device, dtype) for n in lengths]
    full_v = [torch.randn(n, kv_heads, head_dim, generator=g).to(device, dtype) for n in lengths]
    history = StepLayout(tables, [0] * len(lengths), lengths, BLOCK_SIZE, device)  # every position, for writing
    for cache in caches.values():
        cache.write(0, history.write_blocks, history.write_offsets, torch.cat(full_k), torch.cat(full_v))
    layout = StepLayout(tables, [s for s, _ in SEQUENCES], [n for _, n in SEQUENCES], BLOCK_SIZE, device)
    k = torch.cat([fk[s:s + n] for fk, (s, n) in zip(full_k, SEQUENCES)])
    v = torch.cat([fv[s:s + n] for fv, (s, n) in zip(full_v, SEQUENCES)])
    q = torch.randn(layout.num_tokens, num_heads, head_dim, generator=g).to(device, dtype)
    reference = TorchPagedAttention(caches["torch"], num_heads, kv_heads, head_dim)
    fast = FlashInferPagedAttention(caches["flashinfer"], num_heads, kv_heads, head_dim)
    distinct = sorted(set(windows), key=lambda w: -1 if w is None else w)
    fast.begin_step(layout, distinct, scale)
    worst = 0.0
    for window in distinct:
        expected = reference(0, q, k, v, layout, window, scale)
        got = fast(0, q, k, v, layout, window, scale)
        worst = max(worst, relative_error(got, expected))
    return worst


# cached tokens of the decode rows ``sparse_scores_error`` checks: different lengths (padding), one a block's multiple
DECODE_LENGTHS = (37, 16, 29, 5)


def sparse_scores_error(device: torch.device, dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int,
                        windows: Sequence[Optional[int]], scale: float, seed: int) -> float:
    """The largest relative difference of decode attention with ``sampled_addmm`` scores from the gathered keys'
    batched matmul, over decode rows of different lengths on tables out of order, for every window."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in DECODE_LENGTHS]
    order = torch.randperm(sum(blocks_per_seq), generator=g).tolist()
    tables, at = [], 0
    for nb in blocks_per_seq:
        tables.append(order[at:at + nb])
        at += nb
    cache = PagedKVCache(1, len(order), BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype,
                         prefix_caching=False, layout=KV_LAYOUT["torch"])
    lengths = list(DECODE_LENGTHS)
    history = StepLayout(tables, [0] * len(lengths), lengths, BLOCK_SIZE, device)
    k = torch.randn(sum(lengths), kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(sum(lengths), kv_heads, head_dim, generator=g).to(device, dtype)
    cache.write(0, history.write_blocks, history.write_offsets, k, v)
    layout = StepLayout(tables, [n - 1 for n in lengths], [1] * len(lengths), BLOCK_SIZE, device)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g).to(device, dtype)
    reference = TorchPagedAttention(cache, num_heads, kv_heads, head_dim)
    fast = TorchPagedAttention(cache, num_heads, kv_heads, head_dim, sparse_scores=True)
    worst = 0.0
    for window in sorted(set(windows), key=lambda w: -1 if w is None else w):
        expected = reference(0, q, None, None, layout, window, scale)
        worst = max(worst, relative_error(fast(0, q, None, None, layout, window, scale), expected))
    return worst

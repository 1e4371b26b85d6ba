"""Attention over the paged KV cache, read through each sequence's block table.

``StepLayout`` is built once per step from the sequences' block tables and positions
(flat write slots, gather indices, masks per sliding-window size) and shared by every
layer. Two backends read it:

- ``TorchPagedAttention`` (CPU, and CUDA without FlashInfer): decode rows gather their
  blocks with one ``index_select`` per layer and run one batched SDPA with the query heads
  of each KV head as that head's query rows (grouped-query attention without repeating
  K/V); a prefill from position 0 attends to its own fresh K/V (no gather), one that
  continues a cached prefix gathers its blocks.
- ``FlashInferPagedAttention`` (CUDA, fp16/bf16, when ``flashinfer`` is installed): one
  ``BatchPrefillWithPagedKVCacheWrapper`` plan per step and window size, run per layer on
  the cache tensors as they are (``NHD`` layout).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class StepLayout:
    """Where a step's tokens go in the cache and which cached positions each one reads.

    ``tables[i]`` is sequence i's block table, ``starts[i]`` its first new position,
    ``counts[i]`` its number of new tokens; tokens are laid out sequence after sequence.
    """

    def __init__(self, tables: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int],
                 block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.tables = tables
        self.starts = list(starts)
        self.counts = list(counts)
        self.kv_lens = [s + n for s, n in zip(starts, counts)]
        slots: list[int] = []
        positions: list[int] = []
        decode_seqs: list[int] = []
        self.prefill_seqs: list[int] = []
        self.token_offsets: list[int] = []
        offset = 0
        for i, (table, start, n) in enumerate(zip(tables, starts, counts)):
            if len(table) * block_size < start + n:
                raise ValueError(f"sequence {i}: {len(table)} blocks of {block_size} cannot hold {start + n} tokens")
            self.token_offsets.append(offset)
            for p in range(start, start + n):
                slots.append(table[p // block_size] * block_size + p % block_size)
            positions.extend(range(start, start + n))
            (decode_seqs if n == 1 else self.prefill_seqs).append(i)
            offset += n
        self.num_tokens = offset
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.decode_seqs = decode_seqs
        self._decode: Optional[_DecodeGather] = _DecodeGather(self, decode_seqs) if decode_seqs else None
        self._prefill_gathers: dict[int, torch.Tensor] = {}

    @property
    def decode(self) -> Optional["_DecodeGather"]:
        return self._decode

    def prefill_gather(self, i: int) -> torch.Tensor:
        """Block ids covering sequence i's whole context (for a prefill that continues a cached prefix)."""
        if i not in self._prefill_gathers:
            nb = -(-self.kv_lens[i] // self.block_size)
            self._prefill_gathers[i] = torch.tensor(list(self.tables[i][:nb]), dtype=torch.long, device=self.device)
        return self._prefill_gathers[i]


class _DecodeGather:
    """Decode rows (one new token each): padded block ids and a key mask per window size."""

    def __init__(self, layout: StepLayout, seqs: list[int]):
        bs = layout.block_size
        device = layout.device
        lens = [layout.kv_lens[i] for i in seqs]
        nb = -(-max(lens) // bs)
        padded = [list(layout.tables[i][: -(-n // bs)]) for i, n in zip(seqs, lens)]
        self.blocks = torch.tensor([t + [0] * (nb - len(t)) for t in padded], dtype=torch.long, device=device)
        self.tokens = torch.tensor([layout.token_offsets[i] for i in seqs], dtype=torch.long, device=device)
        self.lengths = torch.tensor(lens, dtype=torch.long, device=device)
        self.span = nb * bs
        self._masks: dict[Optional[int], torch.Tensor] = {}

    def mask(self, window: Optional[int]) -> torch.Tensor:
        """[B, 1, 1, span] booleans: key position < length (and within the window)."""
        if window not in self._masks:
            key_pos = torch.arange(self.span, device=self.lengths.device)
            qpos = (self.lengths - 1)[:, None]
            m = key_pos[None, :] <= qpos
            if window:
                m &= key_pos[None, :] > qpos - window
            self._masks[window] = m[:, None, None, :]
        return self._masks[window]


class TorchPagedAttention:
    name = "torch-sdpa"

    def __init__(self, cache, num_heads: int, num_kv_heads: int, head_dim: int):
        self.cache = cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads

    def begin_step(self, layout: StepLayout, windows: Sequence[Optional[int]], scale: float) -> None:
        """Nothing to plan: masks are built lazily on the layout and shared by the layers."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout,
                 window: Optional[int], scale: float) -> torch.Tensor:
        """Attention output [tokens, heads * head_dim]; the step's K/V are already in the cache."""
        T = q.shape[0]
        H, KV, hd = self.num_heads, self.num_kv_heads, self.head_dim
        out = torch.empty(T, H * hd, device=q.device, dtype=q.dtype)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        dec = layout.decode
        if dec is not None:
            B = dec.blocks.shape[0]
            flat = dec.blocks.view(-1)
            keys = kc.index_select(0, flat).view(B, dec.span, KV, hd).transpose(1, 2)   # [B, KV, L, hd]
            values = vc.index_select(0, flat).view(B, dec.span, KV, hd).transpose(1, 2)
            # the query heads sharing a KV head become that head's query rows: no K/V repeat
            qd = q.index_select(0, dec.tokens).view(B, KV, self.group, hd)
            od = F.scaled_dot_product_attention(qd, keys, values, attn_mask=dec.mask(window), scale=scale)
            out.index_copy_(0, dec.tokens, od.reshape(B, H * hd))
        for i in layout.prefill_seqs:
            start, n, off = layout.starts[i], layout.counts[i], layout.token_offsets[i]
            total = start + n
            qp = q[off:off + n].transpose(0, 1)[None]                      # [1, H, n, hd]
            if start == 0:
                keys, values = k[off:off + n], v[off:off + n]               # this step's own K/V
            else:
                blocks = layout.prefill_gather(i)
                keys = kc.index_select(0, blocks).view(-1, KV, hd)[:total]
                values = vc.index_select(0, blocks).view(-1, KV, hd)[:total]
            keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
            if start == 0 and not window:
                op = F.scaled_dot_product_attention(qp, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            else:
                qpos = torch.arange(start, total, device=q.device)[:, None]
                key_pos = torch.arange(total, device=q.device)[None, :]
                mask = key_pos <= qpos
                if window:
                    mask &= key_pos > qpos - window
                op = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask[None, None], scale=scale,
                                                    enable_gqa=True)
            out[off:off + n] = op[0].transpose(0, 1).reshape(n, H * hd)
        return out


class FlashInferPagedAttention:
    """FlashInfer's paged prefill kernel for every token of a step (decode rows are prefills of one token)."""

    name = "flashinfer"
    WORKSPACE_BYTES = 128 << 20

    def __init__(self, cache, num_heads: int, num_kv_heads: int, head_dim: int):
        import flashinfer

        self.cache = cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._flashinfer = flashinfer
        self._workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=cache.k.device)
        self._wrappers: dict[Optional[int], object] = {}
        self._scale: Optional[float] = None

    def begin_step(self, layout: StepLayout, windows: Sequence[Optional[int]], scale: float) -> None:
        bs = layout.block_size
        device = layout.device
        qo, kv_indptr, indices, last = [0], [0], [], []
        for table, n, total in zip(layout.tables, layout.counts, layout.kv_lens):
            nb = -(-total // bs)
            qo.append(qo[-1] + n)
            indices.extend(table[:nb])
            kv_indptr.append(kv_indptr[-1] + nb)
            last.append(total - (nb - 1) * bs)
        as_int = dict(dtype=torch.int32, device=device)
        qo_t, kv_t = torch.tensor(qo, **as_int), torch.tensor(kv_indptr, **as_int)
        idx_t, last_t = torch.tensor(indices, **as_int), torch.tensor(last, **as_int)
        for window in set(windows):
            wrapper = self._wrappers.get(window)
            if wrapper is None:
                wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
                self._wrappers[window] = wrapper
            wrapper.plan(qo_t, kv_t, idx_t, last_t, self.num_heads, self.num_kv_heads, self.head_dim, bs,
                         causal=True, window_left=(window - 1) if window else -1, sm_scale=scale,
                         q_data_type=self.cache.k.dtype, kv_data_type=self.cache.k.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout,
                 window: Optional[int], scale: float) -> torch.Tensor:
        o = self._wrappers[window].run(q, (self.cache.k[layer], self.cache.v[layer]))
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def make_attention(cache, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "auto"):
    """FlashInfer on CUDA in fp16/bf16 when installed (``backend="auto"``), else torch SDPA."""
    if backend not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {backend!r}; choose auto, torch or flashinfer")
    usable = cache.k.device.type == "cuda" and cache.k.dtype in FLASHINFER_DTYPES
    if backend == "flashinfer" or (backend == "auto" and usable):
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            if backend == "flashinfer":
                raise
            log.info("flashinfer is not installed: attention runs on torch SDPA")
        else:
            if not usable:
                raise ValueError("the flashinfer backend needs a CUDA cache in float16 or bfloat16")
            return FlashInferPagedAttention(cache, num_heads, num_kv_heads, head_dim)
    return TorchPagedAttention(cache, num_heads, num_kv_heads, head_dim)

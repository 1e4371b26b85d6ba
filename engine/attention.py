"""Attention over the paged KV cache, read through each sequence's block table.

``StepLayout`` is built once per step from the sequences' block tables and positions
(where each new token's K/V goes, gather indices, masks per sliding-window size) and is
shared by every layer. Two backends read it:

- ``TorchPagedAttention`` (CPU, and CUDA without FlashInfer): decode rows gather their
  blocks head-major with one ``index_select`` per layer for K and one for V, then attend
  with two batched matmuls (batch = KV head x request, the query heads sharing a KV head
  as its rows: grouped-query attention without repeating K/V) and an additive mask. A
  prefill from position 0 attends to its own fresh K/V (no gather); one that continues a
  cached prefix gathers its blocks. Prefills use SDPA.
- ``FlashInferPagedAttention`` (CUDA, fp16/bf16, when ``flashinfer`` is installed): one
  ``BatchPrefillWithPagedKVCacheWrapper`` plan per step and window size, run per layer on
  the cache tensors as they are (``HND`` layout).
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
        blocks: list[int] = []
        offsets: list[int] = []
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
                blocks.append(table[p // block_size])
                offsets.append(p % block_size)
            positions.extend(range(start, start + n))
            (decode_seqs if n == 1 else self.prefill_seqs).append(i)
            offset += n
        self.num_tokens = offset
        self.write_blocks = torch.tensor(blocks, dtype=torch.long, device=device)
        self.write_offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.decode_seqs = decode_seqs
        self._decode: Optional[_DecodeGather] = _DecodeGather(self, decode_seqs) if decode_seqs else None
        self._prefill_gathers: dict[int, torch.Tensor] = {}

    @property
    def slots(self) -> torch.Tensor:
        """Flat cache slot of each new token: ``block * block_size + offset``."""
        return self.write_blocks * self.block_size + self.write_offsets

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
    """Decode rows (one new token each): padded block ids and an additive key mask per window size."""

    def __init__(self, layout: StepLayout, seqs: list[int]):
        bs = layout.block_size
        device = layout.device
        lens = [layout.kv_lens[i] for i in seqs]
        nb = -(-max(lens) // bs)
        padded = [list(layout.tables[i][: -(-n // bs)]) for i, n in zip(seqs, lens)]
        self.blocks = torch.tensor([t + [t[0]] * (nb - len(t)) for t in padded], dtype=torch.long, device=device)
        self.tokens = torch.tensor([layout.token_offsets[i] for i in seqs], dtype=torch.long, device=device)
        self.lengths = torch.tensor(lens, dtype=torch.long, device=device)
        self.span = nb * bs
        self._masks: dict[Optional[int], torch.Tensor] = {}
        self._biases: dict[tuple, torch.Tensor] = {}

    def mask(self, window: Optional[int]) -> torch.Tensor:
        """[B, span] booleans: key position < length (and within the window)."""
        if window not in self._masks:
            key_pos = torch.arange(self.span, device=self.lengths.device)
            qpos = (self.lengths - 1)[:, None]
            m = key_pos[None, :] <= qpos
            if window:
                m &= key_pos[None, :] > qpos - window
            self._masks[window] = m
        return self._masks[window]

    def bias(self, window: Optional[int], kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """[kv_heads * B, 1, span]: 0 where a key is visible, -inf where not (KV-head-major, as the scores)."""
        key = (window, kv_heads, dtype)
        if key not in self._biases:
            zero = torch.zeros((), dtype=dtype, device=self.lengths.device)
            bias = torch.where(self.mask(window), zero, float("-inf"))
            B = bias.shape[0]
            self._biases[key] = bias[None, :, None, :].expand(kv_heads, B, 1, self.span).reshape(kv_heads * B, 1,
                                                                                                  self.span)
        return self._biases[key]


class TorchPagedAttention:
    name = "torch"

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
        H, KV, G, hd = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        out = torch.empty(T, H * hd, device=q.device, dtype=q.dtype)
        dec = layout.decode
        if dec is not None:
            B = dec.blocks.shape[0]
            keys, values = self.cache.gather(layer, dec.blocks.view(-1))           # [KV, B * span, hd]
            keys = keys.view(KV * B, dec.span, hd)
            values = values.view(KV * B, dec.span, hd)
            qd = q.index_select(0, dec.tokens).view(B, KV, G, hd).transpose(0, 1).reshape(KV * B, G, hd)
            scores = torch.baddbmm(dec.bias(window, KV, q.dtype), qd, keys.transpose(1, 2), alpha=scale)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            od = torch.bmm(probs, values).view(KV, B, G, hd).transpose(0, 1).reshape(B, H * hd)
            out.index_copy_(0, dec.tokens, od)
        for i in layout.prefill_seqs:
            start, n, off = layout.starts[i], layout.counts[i], layout.token_offsets[i]
            total = start + n
            qp = q[off:off + n].transpose(0, 1)[None]                      # [1, H, n, hd]
            if start == 0:
                keys, values = k[off:off + n].transpose(0, 1), v[off:off + n].transpose(0, 1)   # fresh K/V
            else:
                keys, values = self.cache.gather(layer, layout.prefill_gather(i))
                keys, values = keys[:, :total], values[:, :total]
            keys, values = keys[None], values[None]                        # [1, KV, total, hd]
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
    """FlashInfer's paged prefill kernel for every token of a step (decode rows are prefills of one token).

    The plan's index arrays are built on the host: ``plan`` reads them there anyway and
    copies them to the device once, so passing device tensors would only add a sync.
    """

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

    def begin_step(self, layout: StepLayout, windows: Sequence[Optional[int]], scale: float) -> None:
        bs = layout.block_size
        qo, kv_indptr, indices, last = [0], [0], [], []
        for table, n, total in zip(layout.tables, layout.counts, layout.kv_lens):
            nb = -(-total // bs)
            qo.append(qo[-1] + n)
            indices.extend(table[:nb])
            kv_indptr.append(kv_indptr[-1] + nb)
            last.append(total - (nb - 1) * bs)
        host = dict(dtype=torch.int32, device="cpu")
        qo_t, kv_t = torch.tensor(qo, **host), torch.tensor(kv_indptr, **host)
        idx_t, last_t = torch.tensor(indices, **host), torch.tensor(last, **host)
        for window in set(windows):
            wrapper = self._wrappers.get(window)
            if wrapper is None:
                wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND")
                self._wrappers[window] = wrapper
            # HF's sliding_window w: a query sees itself and the w - 1 keys before it (window_left is inclusive)
            wrapper.plan(qo_t, kv_t, idx_t, last_t, self.num_heads, self.num_kv_heads, self.head_dim, bs,
                         causal=True, window_left=(window - 1) if window else -1, sm_scale=scale,
                         q_data_type=self.cache.k.dtype, kv_data_type=self.cache.k.dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout,
                 window: Optional[int], scale: float) -> torch.Tensor:
        """Attention output [tokens, heads * head_dim]; the step's K/V are already in the cache."""
        o = self._wrappers[window].run(q.contiguous(), (self.cache.k[layer], self.cache.v[layer]))
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
BACKENDS = ("auto", "torch", "flashinfer")
KV_LAYOUT = {"torch": "head_major", "flashinfer": "page_major"}


def choose_backend(device: torch.device, dtype: torch.dtype, requested: str = "auto") -> str:
    """FlashInfer on CUDA in fp16/bf16 when installed (for ``auto``), else torch; decides the cache layout."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {BACKENDS}")
    usable = device.type == "cuda" and dtype in FLASHINFER_DTYPES
    if requested == "torch" or (requested == "auto" and not usable):
        return "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        if requested == "flashinfer":
            raise
        log.info("flashinfer is not installed: attention runs on torch")
        return "torch"
    if not usable:
        raise ValueError("the flashinfer backend needs CUDA and float16 or bfloat16")
    return "flashinfer"


def make_attention(cache, num_heads: int, num_kv_heads: int, head_dim: int):
    """The backend that reads ``cache``'s layout (``KV_LAYOUT``)."""
    if cache.layout == KV_LAYOUT["flashinfer"]:
        return FlashInferPagedAttention(cache, num_heads, num_kv_heads, head_dim)
    return TorchPagedAttention(cache, num_heads, num_kv_heads, head_dim)

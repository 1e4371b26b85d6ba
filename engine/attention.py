"""Attention over the paged KV cache, read through each sequence's block table.

Two backends read a step's ``StepLayout`` (``engine.attention_layout``):

- ``TorchPagedAttention`` (CPU, and CUDA without FlashInfer): decode rows gather their
  K with one ``index_select`` per layer, position by position up to the group's longest row
  (``PagedKVCache.position_rows``, the row ids computed once per step; the gather's buffer reused by
  the step's layers), and take their scores with one batched matmul (batch = request x KV head, the
  query heads sharing a KV head as its rows: grouped-query attention without repeating K/V; a row's
  heads already are its KV heads' groups, so neither the queries nor the output are transposed) and
  an additive mask. On the CPU the probabilities then weight V where it lies in the cache, as one
  ``F.embedding_bag`` (a bag per query: sum of its positions' V rows times their probabilities, none
  past the row's length), instead of gathering V and a second batched matmul: at batch 32 over 65
  cached tokens the V gather wrote 5 MB per layer and the matmul read it back (in an A/B on the
  engine thread the step went 67.4 -> 64.2 ms, logits within 2e-6). Gathering whole blocks read the
  unwritten rest of each row's last block (at 65 tokens in blocks of 16, 80 positions for 65) and
  transposed the queries and output (KV-head-major): positions, request-major, took the benchmark's
  decode step from 35.6 to 34.4 ms (in-process A/B, 30 alternating repeats; logits within 2.6e-6: the
  softmax sums a row of another width). Where its start-up check passes (``sparse_scores``, the CPU in
  float32 by default) the scores skip the K gather: one ``torch.sparse.sampled_addmm`` takes each
  (query, key position) dot product from the cache in place, over a CSR pattern of the step's positions
  whose values are the mask (``_DecodeGather.score_pattern``). In-process A/B on the engine thread
  (batch 32 over 8 adapters, 30 alternating repeats, 2 cores, a busy machine): step over gathered-K step
  0.95-0.98 at 64 cached tokens, 0.86 at 500; logits within 3e-6. On CUDA V is gathered and multiplied
  as K is. A prefill
  from position 0 attends to its own fresh K/V (no gather); one that continues a cached
  prefix gathers its blocks. Prefills use SDPA.
- ``FlashInferPagedAttention`` (``engine.attention_flashinfer``; CUDA, fp16/bf16, when
  ``flashinfer`` is installed).

The backend decides the cache layout (``KV_LAYOUT``), so it is chosen before the cache
is allocated (``choose_backend``) and read back from the cache (``make_attention``).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .attention_flashinfer import FlashInferPagedAttention
from .attention_layout import StepLayout

log = logging.getLogger(__name__)


class TorchPagedAttention:
    name = "torch"

    def __init__(self, cache, num_heads: int, num_kv_heads: int, head_dim: int, sparse_scores: bool = False):
        """``sparse_scores``: decode rows' scores as one ``torch.sparse.sampled_addmm`` (``sparse_scores_unsupported``;
        the engine's start-up check decides, ``engine.check_attention``)."""
        self.cache = cache
        self.sparse_scores = sparse_scores
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        # decode rows weight V where it lies in the cache (``F.embedding_bag``) on the CPU; on CUDA they gather it
        self.values_in_place = cache.k.device.type == "cpu"

    def begin_step(self, layout: StepLayout, windows: Sequence[Optional[int]], scale: float,
                   graph_rows: Optional[int] = None) -> None:
        """Nothing to plan: masks are built lazily on the layout and shared by the layers (``graph_rows``: this path
        is never captured, ``engine.decode_graphs``; its padded body reads the layout as any step does)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout,
                 window: Optional[int], scale: float) -> torch.Tensor:
        """Attention output [tokens, heads * head_dim]; the step's K/V are already in the cache."""
        T = q.shape[0]
        H, hd = self.num_heads, self.head_dim
        groups = layout.decode_groups
        if len(groups) == 1 and groups[0].all_rows:  # every row decodes, in order: no gather, no scatter
            return self._decode(layer, q, groups[0], window, scale)
        out = torch.empty(T, H * hd, device=q.device, dtype=q.dtype)
        for dec in groups:  # rows of similar lengths: little padding (``attention_layout``)
            out.index_copy_(0, dec.tokens, self._decode(layer, q.index_select(0, dec.tokens), dec, window, scale))
        for i in layout.prefill_seqs:
            start, n, off = layout.starts[i], layout.counts[i], layout.token_offsets[i]
            total = start + n
            qp = q[off:off + n].transpose(0, 1)[None]                      # [1, H, n, hd]
            if start == 0:
                keys, values = k[off:off + n].transpose(0, 1), v[off:off + n].transpose(0, 1)   # fresh K/V
            else:
                keys, values = self.cache.gather_rows(layer, layout.prefill_rows(i, self.cache))
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

    def _decode(self, layer: int, qd: torch.Tensor, dec, window: Optional[int], scale: float) -> torch.Tensor:
        """Attention of one group of decode rows (``qd``: their queries, [B, heads, head_dim]): [B, heads * head_dim]."""
        KV, G, hd = self.num_kv_heads, self.group, self.head_dim
        B = dec.blocks.shape[0]
        qd = qd.reshape(B * KV, G, hd)                                             # a row's heads: its KV groups
        if self.sparse_scores:  # K read in place: no gather; the mask is the pattern's values
            pattern = dec.score_pattern(self.cache, window, G, qd.dtype)
            scores = torch.sparse.sampled_addmm(pattern, qd.view(-1, hd), self.cache.key_positions(layer).t(),
                                                alpha=scale).values().view(B * KV, G, dec.span)
        else:
            keys = dec.gather(self.cache.key_positions(layer), self.cache)         # [B * KV, span, hd]
            scores = torch.baddbmm(dec.bias(window, KV, qd.dtype), qd, keys.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qd.dtype)
        if self.values_in_place:  # V read in place: no gather (``value_bags``)
            ids, offsets, select = dec.value_bags(self.cache, G)
            weights = probs.reshape(-1) if select is None else probs.reshape(-1).index_select(0, select)
            out = F.embedding_bag(ids, self.cache.value_positions(layer), offsets, mode="sum",
                                  per_sample_weights=weights)
        else:
            values = dec.gather(self.cache.value_positions(layer), self.cache)  # the keys' buffer: scored already
            out = torch.bmm(probs, values)
        return out.view(B, self.num_heads * hd)


def sparse_scores_unsupported(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None where ``auto`` tries ``sampled_addmm`` scores (the CPU in float32, where it was measured), else why not."""
    if device.type != "cpu":
        return "sampled_addmm scores are measured on the CPU only: the device gathers K"
    if dtype != torch.float32:
        return f"sampled_addmm scores are measured in float32 only (its CPU kernel refuses bfloat16): this engine is {dtype}"
    return None


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
BACKENDS = ("auto", "torch", "flashinfer")
KV_LAYOUT = {"torch": "head_major", "flashinfer": "page_major"}


FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's prebuilt paged kernels take (it refuses < 64)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    """A backend fallback is logged once per process, not once per engine or step."""
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


def choose_backend(device: torch.device, dtype: torch.dtype, requested: str = "auto",
                   head_dim: Optional[int] = None) -> str:
    """FlashInfer on CUDA in fp16/bf16 with a head size it supports, when installed (for ``auto``), else torch
    (the fallback logged once); decides the cache layout. ``head_dim`` None: not checked."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {BACKENDS}")
    head_ok = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    usable = device.type == "cuda" and dtype in FLASHINFER_DTYPES and head_ok
    if requested == "torch" or (requested == "auto" and not usable):
        if requested == "auto" and device.type == "cuda":
            _log_once(f"attention runs on torch: FlashInfer takes {FLASHINFER_DTYPES} and head sizes "
                      f"{FLASHINFER_HEAD_DIMS}, this model is {dtype} with head size {head_dim}")
        return "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        if requested == "flashinfer":
            raise
        _log_once("flashinfer is not installed: attention runs on torch")
        return "torch"
    if not usable:
        raise ValueError(f"the flashinfer backend needs CUDA, float16 or bfloat16 and a head size in "
                         f"{FLASHINFER_HEAD_DIMS} (got {device.type}, {dtype}, head size {head_dim})")
    return "flashinfer"


def make_attention(cache, num_heads: int, num_kv_heads: int, head_dim: int, sparse_scores: bool = False):
    """The backend that reads ``cache``'s layout (``KV_LAYOUT``); ``sparse_scores``: the torch backend's decode
    scores as ``sampled_addmm``."""
    if cache.layout == KV_LAYOUT["flashinfer"]:
        return FlashInferPagedAttention(cache, num_heads, num_kv_heads, head_dim)
    return TorchPagedAttention(cache, num_heads, num_kv_heads, head_dim, sparse_scores)

"""Segmented LoRA shrink/expand as two Triton kernels: one launch each per module, all adapters at once.

The step's tokens are laid out grouped by pool slot (``engine.model_runner``), so a batch
is a list of segments ``(slot, start, len, rank, scaling)``. Shrink computes
``y[t, :r] = x[t] @ A[slot].T`` and expand adds ``scaling * y[t, :r] @ Bt[slot, :r]`` into
the base output, each program working on one tile of one segment: every adapter's A and
B tiles are read once per token tile (the SGMV idea of Punica/S-LoRA), where the
per-token gather copied each token's rows. Ranks are masked per segment, so a rank-8
adapter in a rank-64 pool multiplies by 8 rows.

CUDA runs them compiled; the CPU keeps the torch segment loop (``engine.lora_layers``),
and the tests prove these kernels equal it under Triton's interpreter
(``TRITON_INTERPRET=1``, read when this module is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16   # token rows per program (tl.dot needs 16 at least)
BLOCK_K = 32   # input features per inner step of shrink
BLOCK_N = 64   # output features per program of expand


@dataclass
class SegmentPlan:
    """A step's segments as device arrays, built once per step and read by every LoRA layer."""

    starts: torch.Tensor   # int32 [segments]: first token row
    lengths: torch.Tensor  # int32 [segments]
    slots: torch.Tensor    # int32 [segments]: pool slot
    ranks: torch.Tensor    # int32 [segments]
    scales: torch.Tensor   # float32 [segments]
    max_length: int        # the longest segment (grid size along tokens)
    max_rank: int          # the largest rank (the shrink output's width)

    @classmethod
    def build(cls, segments, device: torch.device) -> "SegmentPlan":
        """From ``LoRASegment``s (host), in one host-to-device copy."""
        n = len(segments)
        fields = torch.tensor([[s.start for s in segments], [s.end - s.start for s in segments],
                               [s.slot for s in segments], [s.rank for s in segments]], dtype=torch.int32)
        scales = torch.tensor([s.scaling for s in segments], dtype=torch.float32).view(torch.int32)
        packed = torch.cat([fields.flatten(), scales]).to(device)     # one copy; the scales keep their bits
        return cls(packed[:n], packed[n:2 * n], packed[2 * n:3 * n], packed[3 * n:4 * n],
                   packed[4 * n:].view(torch.float32), max(s.end - s.start for s in segments),
                   max(s.rank for s in segments))


@triton.jit
def _segment_tile(starts_ptr, lengths_ptr, slots_ptr, ranks_ptr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's token rows of its segment (absolute, with their mask), rank columns (with mask) and slot."""
    seg = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(lengths_ptr + seg)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < tl.load(ranks_ptr + seg)
    tokens = (tl.load(starts_ptr + seg) + rows).to(tl.int64)
    return tokens, row_ok, r, r_ok, tl.load(slots_ptr + seg).to(tl.int64)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, y_ptr, starts_ptr, lengths_ptr, slots_ptr, ranks_ptr,
                   in_features, stride_xt, stride_as, stride_ar, stride_yt,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    if tl.program_id(1) * BLOCK_M >= tl.load(lengths_ptr + tl.program_id(0)):
        return  # a tile past this segment's end (the grid covers the longest segment)
    tokens, row_ok, r, r_ok, slot = _segment_tile(starts_ptr, lengths_ptr, slots_ptr, ranks_ptr, BLOCK_M, BLOCK_R)
    # a builtin (tl.zeros is @jit: not interpretable once triton was imported without TRITON_INTERPRET)
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=r_ok[None, :] & k_ok[:, None], other=0.0)          # [BLOCK_K, BLOCK_R]: A[slot].T
        if IEEE:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    tl.store(y_ptr + tokens[:, None] * stride_yt + r[None, :], acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _expand_kernel(y_ptr, bt_ptr, out_ptr, starts_ptr, lengths_ptr, slots_ptr, ranks_ptr, scales_ptr,
                   out_features, stride_yt, stride_bs, stride_br, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    if tl.program_id(1) * BLOCK_M >= tl.load(lengths_ptr + tl.program_id(0)):
        return
    tokens, row_ok, r, r_ok, slot = _segment_tile(starts_ptr, lengths_ptr, slots_ptr, ranks_ptr, BLOCK_M, BLOCK_R)
    scale = tl.load(scales_ptr + tl.program_id(0))
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    y = tl.load(y_ptr + tokens[:, None] * stride_yt + r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    bt = tl.load(bt_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :],
                 mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    if IEEE:
        delta = tl.dot(y, bt, input_precision="ieee")
    else:
        delta = tl.dot(y, bt)
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (base.to(tl.float32) + scale * delta).to(out_ptr.dtype.element_ty), mask=mask)


def _rank_block(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def lora_shrink(x: torch.Tensor, a_buffer: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """``y[t, :rank] = x[t] @ A[slot(t), :rank].T`` for every segment's tokens: [tokens, BLOCK_R], zero past the
    rank (tokens outside every segment are left unset)."""
    block_r = _rank_block(plan.max_rank)
    if a_buffer.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError("lora_shrink needs x and the A buffer contiguous along the input features")
    y = torch.empty(x.shape[0], block_r, dtype=x.dtype, device=x.device)
    a = a_buffer  # rows past a segment's rank are masked, never read
    grid = (plan.starts.shape[0], triton.cdiv(plan.max_length, BLOCK_M))
    _shrink_kernel[grid](x, a, y, plan.starts, plan.lengths, plan.slots, plan.ranks,
                         x.shape[1], x.stride(0), a.stride(0), a.stride(1), y.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return y


def lora_expand(y: torch.Tensor, bt_buffer: torch.Tensor, plan: SegmentPlan, out: torch.Tensor) -> None:
    """``out[t] += scale * y[t, :rank] @ Bt[slot(t), :rank]`` in place, for every segment's tokens."""
    if bt_buffer.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("lora_expand needs out and the B buffer contiguous along the output features")
    block_r = y.shape[1]
    bt = bt_buffer  # rows past a segment's rank are masked, never read
    grid = (plan.starts.shape[0], triton.cdiv(plan.max_length, BLOCK_M), triton.cdiv(out.shape[1], BLOCK_N))
    _expand_kernel[grid](y, bt, out, plan.starts, plan.lengths, plan.slots, plan.ranks, plan.scales,
                         out.shape[1], y.stride(0), bt.stride(0), bt.stride(1), out.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N, IEEE=y.dtype == torch.float32)


def add_lora(x: torch.Tensor, a_buffer: torch.Tensor, bt_buffer: torch.Tensor, plan: SegmentPlan,
             out: torch.Tensor) -> None:
    """``out += scale[s] * (x @ A[s].T) @ Bt[s]`` per segment: two launches whatever the number of adapters."""
    lora_expand(lora_shrink(x, a_buffer, plan), bt_buffer, plan, out)

"""Segmented LoRA shrink/expand as two Triton kernels: one launch each per projection group, all adapters at once.

The step's tokens are laid out grouped by pool slot (``engine.model_runner``), so a batch
is a list of segments ``(slot, start, len, rank, scaling)`` (``engine.lora_plan``). Shrink
computes ``y[t, :r] = x[t] @ A[slot].T`` and expand adds ``scaling * y[t, :r] @ Bt[slot, :r]``
into the base output, each program working on one tile of one segment: every adapter's A
and B tiles are read once per token tile (the SGMV idea of Punica/S-LoRA). Ranks are masked
per segment, so a rank-8 adapter in a rank-64 pool multiplies by 8 rows.

Two things keep a decode step's LoRA cheap on a large GPU:

- **Split-K shrink.** A decode step over 8 adapters has 8 token tiles; with one program per
  tile, 8 of 132 SMs loop over thousands of input features. Shrink splits the input
  features into ``splits`` ranges, one program each, and writes fp32 partial sums
  ``[slices, splits, tokens, BLOCK_R]``; expand adds the partials up in fp32 as it reads
  them, so the split costs no extra launch and no atomics (the sum's order is fixed:
  results do not change from run to run).
- **Fused slices.** Projections that read the same input (q/k/v; gate/up) run as one
  shrink and one expand launch with up to ``MAX_SLICES`` slices, each with its own A, B
  and output tensor.

The grid's only runtime-varying integers (``splits``, ``k_per_split``) are left
unspecialised, and every other argument is fixed by the model's shapes, so the variants a
replica needs are exactly (slices, ``BLOCK_R``) for the configured dtype: the start-up
self-check (``engine.check_lora``) compiles each one before the replica is ready.

CUDA runs them compiled; the CPU keeps the torch segment loop (``engine.lora_layers``),
and the tests prove these kernels equal it under Triton's interpreter
(``TRITON_INTERPRET=1``, read when this module is imported).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from .lora_plan import SegmentPlan

BLOCK_M = 16   # token rows per program (tl.dot needs 16 at least)
BLOCK_K = 32   # input features per inner step of shrink
BLOCK_N = 64   # output features per program of expand
MAX_SLICES = 3  # projections sharing one input fused in a launch (q/k/v)
RANK_BLOCKS = (16, 32, 64, 128)  # the BLOCK_R variants: ranks padded to a power of two, 16 at least
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, as Triton reads it
DEFAULT_TARGET_PROGRAMS = 264  # shrink programs split-K aims for: 2 per SM of a 132-SM GPU (EngineTuning overrides)
# the integer arguments that vary from step to step, left unspecialised so that they never select a new compiled
# variant (every other argument is fixed by the model, the pool and the dtype; tests/test_engine_fast_paths.py
# checks serving launches no variant the start-up check did not)
SHRINK_UNSPECIALISED = ("splits", "k_per_split")
EXPAND_UNSPECIALISED = ("splits",)


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


@triton.jit(do_not_specialize=SHRINK_UNSPECIALISED)
def _shrink_kernel(x_ptr, a0_ptr, a1_ptr, a2_ptr, y_ptr, starts_ptr, lengths_ptr, slots_ptr, ranks_ptr,
                   in_features, splits, k_per_split, stride_xt, stride_as, stride_ar, stride_ys, stride_yk,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SLICES: tl.constexpr,
                   EXACT: tl.constexpr):
    if tl.program_id(1) * BLOCK_M >= tl.load(lengths_ptr + tl.program_id(0)):
        return  # a tile past this segment's end (the grid covers the longest segment)
    tokens, row_ok, r, r_ok, slot = _segment_tile(starts_ptr, lengths_ptr, slots_ptr, ranks_ptr, BLOCK_M, BLOCK_R)
    piece = tl.program_id(2)
    which = piece % NUM_SLICES
    split = piece // NUM_SLICES
    a_ptr = a0_ptr
    if NUM_SLICES > 1:
        if which == 1:
            a_ptr = a1_ptr
    if NUM_SLICES > 2:
        if which == 2:
            a_ptr = a2_ptr
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    # a builtin (tl.zeros is @jit: not interpretable once triton was imported without TRITON_INTERPRET)
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_hi
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=r_ok[None, :] & k_ok[:, None], other=0.0)          # [BLOCK_K, BLOCK_R]: A[slot].T
        if EXACT:
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    y_ptrs = y_ptr + which * stride_ys + split * stride_yk + tokens[:, None] * BLOCK_R + r[None, :]
    tl.store(y_ptrs, acc, mask=row_ok[:, None])  # fp32 partial sums: expand adds the splits up


@triton.jit(do_not_specialize=EXPAND_UNSPECIALISED)
def _expand_kernel(y_ptr, bt0_ptr, bt1_ptr, bt2_ptr, out0_ptr, out1_ptr, out2_ptr, n0, n1, n2,
                   starts_ptr, lengths_ptr, slots_ptr, ranks_ptr, scales_ptr, splits, max_rank, stride_ys, stride_yk,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SLICES: tl.constexpr,
                   EXACT: tl.constexpr):
    if tl.program_id(1) * BLOCK_M >= tl.load(lengths_ptr + tl.program_id(0)):
        return
    piece = tl.program_id(2)
    which = piece % NUM_SLICES
    n_tile = piece // NUM_SLICES
    bt_ptr, out_ptr, width = bt0_ptr, out0_ptr, n0
    if NUM_SLICES > 1:
        if which == 1:
            bt_ptr, out_ptr, width = bt1_ptr, out1_ptr, n1
    if NUM_SLICES > 2:
        if which == 2:
            bt_ptr, out_ptr, width = bt2_ptr, out2_ptr, n2
    if n_tile * BLOCK_N >= width:
        return  # a slice narrower than the widest one: its last tiles have nothing to do
    tokens, row_ok, r, r_ok, slot = _segment_tile(starts_ptr, lengths_ptr, slots_ptr, ranks_ptr, BLOCK_M, BLOCK_R)
    scale = tl.load(scales_ptr + tl.program_id(0))
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < width
    y_mask = row_ok[:, None] & r_ok[None, :]
    y_ptrs = y_ptr + which * stride_ys + tokens[:, None] * BLOCK_R + r[None, :]
    y = tl.full((BLOCK_M, BLOCK_R), 0.0, dtype=tl.float32)
    for split in range(0, splits):
        y += tl.load(y_ptrs + split * stride_yk, mask=y_mask, other=0.0)
    bt = tl.load(bt_ptr + slot * max_rank * width + r[:, None] * width + n[None, :],
                 mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    y = y.to(bt.dtype)  # the shrink result rounded to the weights' dtype, as in torch's path
    if EXACT:
        delta = tl.dot(y.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
    else:
        delta = tl.dot(y, bt)
    out_ptrs = out_ptr + tokens[:, None] * width + n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (base.to(tl.float32) + scale * delta).to(out_ptr.dtype.element_ty), mask=mask)


def exact_dots(dtype: torch.dtype) -> bool:
    """fp32 dots in IEEE precision (no TF32), and, under the interpreter, half-precision operands widened to fp32
    first: its dot emulation misreads bf16 bits (Triton 3.9), and widening is exact (a bf16 product fits fp32),
    so the interpreted kernel computes what the tensor cores do, up to the order of the fp32 sums."""
    return dtype == torch.float32 or INTERPRETED


def rank_block(max_rank: int) -> int:
    """The ``BLOCK_R`` variant a rank needs."""
    return max(16, triton.next_power_of_2(max_rank))


def split_k(plan: SegmentPlan, slices: int, in_features: int, target_programs: int) -> tuple[int, int]:
    """(splits, input features per split): enough shrink programs to reach ``target_programs``, each split a
    whole number of ``BLOCK_K`` chunks."""
    chunks = triton.cdiv(in_features, BLOCK_K)
    programs = plan.num_segments * triton.cdiv(plan.max_length, BLOCK_M) * slices
    wanted = max(1, min(chunks, triton.cdiv(target_programs, programs)))
    per_split = triton.cdiv(chunks, wanted) * BLOCK_K
    return triton.cdiv(in_features, per_split), per_split


def _check_contiguous(tensors: Sequence[torch.Tensor], what: str) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"the LoRA kernels need {what} contiguous (got strides {t.stride()})")


def lora_shrink(x: torch.Tensor, a_buffers: Sequence[torch.Tensor], plan: SegmentPlan,
                target_programs: int = DEFAULT_TARGET_PROGRAMS) -> torch.Tensor:
    """fp32 partial sums ``y[slice, split, t, :rank]`` of ``x[t] @ A_slice[slot(t), :rank].T`` over each split's
    input features: [slices, splits, tokens, BLOCK_R]; rows outside every segment are left unset."""
    slices = len(a_buffers)
    if not 1 <= slices <= MAX_SLICES:
        raise ValueError(f"1 to {MAX_SLICES} slices per launch (got {slices})")
    if x.stride(1) != 1:
        raise ValueError("lora_shrink needs x contiguous along the input features")
    _check_contiguous(a_buffers, "the A buffers")
    if any(a.shape != a_buffers[0].shape for a in a_buffers):
        raise ValueError("fused slices share one input: their A buffers must have one shape")
    block_r = rank_block(plan.max_rank)
    in_features = x.shape[1]
    splits, per_split = split_k(plan, slices, in_features, target_programs)
    y = torch.empty(slices, splits, plan.num_tokens, block_r, dtype=torch.float32, device=x.device)
    a = list(a_buffers) + [a_buffers[0]] * (MAX_SLICES - slices)
    grid = (plan.num_segments, triton.cdiv(plan.max_length, BLOCK_M), splits * slices)
    _shrink_kernel[grid](x, a[0], a[1], a[2], y, plan.starts, plan.lengths, plan.slots, plan.ranks,
                         in_features, splits, per_split, x.stride(0), a[0].stride(0), a[0].stride(1),
                         y.stride(0), y.stride(1),
                         BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, NUM_SLICES=slices,
                         EXACT=exact_dots(x.dtype))
    return y


def lora_expand(y: torch.Tensor, bt_buffers: Sequence[torch.Tensor], plan: SegmentPlan,
                outs: Sequence[torch.Tensor]) -> None:
    """``out_s[t] += scale * (sum over splits of y[s, :, t, :rank]) @ Bt_s[slot(t), :rank]`` in place."""
    slices = len(bt_buffers)
    if len(outs) != slices or y.shape[0] != slices:
        raise ValueError(f"{slices} B buffers need as many outputs and shrink slices")
    _check_contiguous(list(bt_buffers) + list(outs), "the B buffers and outputs")
    widths = [o.shape[1] for o in outs]
    if any(bt.shape[2] != w for bt, w in zip(bt_buffers, widths)):
        raise ValueError("each B buffer's width must be its output's")
    block_r = y.shape[3]
    pad = MAX_SLICES - slices
    bt = list(bt_buffers) + [bt_buffers[0]] * pad
    out = list(outs) + [outs[0]] * pad
    n = widths + [widths[0]] * pad
    grid = (plan.num_segments, triton.cdiv(plan.max_length, BLOCK_M), triton.cdiv(max(widths), BLOCK_N) * slices)
    _expand_kernel[grid](y, bt[0], bt[1], bt[2], out[0], out[1], out[2], n[0], n[1], n[2],
                         plan.starts, plan.lengths, plan.slots, plan.ranks, plan.scales, y.shape[1],
                         bt[0].shape[1], y.stride(0), y.stride(1),
                         BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N, NUM_SLICES=slices,
                         EXACT=exact_dots(bt[0].dtype))


def add_lora_slices(x: torch.Tensor, a_buffers: Sequence[torch.Tensor], bt_buffers: Sequence[torch.Tensor],
                    plan: SegmentPlan, outs: Sequence[torch.Tensor],
                    target_programs: int = DEFAULT_TARGET_PROGRAMS) -> None:
    """``outs[i] += scale[s] * (x @ A_i[s].T) @ Bt_i[s]`` per segment, for every slice i: two launches whatever
    the number of adapters and slices."""
    lora_expand(lora_shrink(x, a_buffers, plan, target_programs), bt_buffers, plan, outs)


def add_lora(x: torch.Tensor, a_buffer: torch.Tensor, bt_buffer: torch.Tensor, plan: SegmentPlan,
             out: torch.Tensor, target_programs: int = DEFAULT_TARGET_PROGRAMS) -> None:
    """One projection: ``out += scale[s] * (x @ A[s].T) @ Bt[s]`` per segment."""
    add_lora_slices(x, [a_buffer], [bt_buffer], plan, [out], target_programs)

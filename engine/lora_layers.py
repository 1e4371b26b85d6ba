"""LoRA-aware linear layers that read the pool's slot buffers.

The engine lays out each step's tokens grouped by slot, so one batch-wide list of
``(slot, start, end, rank)`` segments serves every layer: per segment, one matmul pair on
a contiguous slice (Punica/S-LoRA's SGMV idea with the gather done once, by layout).
Work is rank-bounded (a rank-8 adapter in a rank-64 pool multiplies by 8 rows), and a
batch with no adapter tokens does no LoRA work at all.

On CUDA, decode-shaped steps (few tokens, several adapters) take a gathered form instead:
each token's A and B rows (up to the batch's largest rank; the pool keeps the rest zero)
are gathered per layer and applied with two batched matmuls, so the number of kernels does
not grow with the number of adapters. On the CPU the segment loop measured faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from pool.memory_pool import LoRAMemoryPool


@dataclass
class LoRASegment:
    slot: int
    start: int
    end: int
    rank: int
    scaling: float


GATHER_MAX_TOKENS = 64  # above this, per-token gathers of A/B cost more than a loop over segments


@dataclass
class GatherPlan:
    """Per-token slot indices for the gathered (decode-shaped) form."""

    rows: torch.Tensor    # token positions that have an adapter
    slots: torch.Tensor   # their slots
    scales: torch.Tensor  # their scaling, [tokens, 1]
    rank: int             # the batch's largest rank


@dataclass
class LoRABatchContext:
    """The current forward's segments; set by the engine before each forward."""

    segments: list[LoRASegment] = field(default_factory=list)
    gather: Optional[GatherPlan] = None

    def set_segments(self, segments: list[LoRASegment], device: Optional[torch.device] = None) -> None:
        self.segments = [s for s in segments if s.rank > 0 and s.end > s.start]
        self.gather = None
        tokens = sum(s.end - s.start for s in self.segments)
        if len(self.segments) > 1 and tokens <= GATHER_MAX_TOKENS and device is not None:
            rows, slots, scales = [], [], []
            for s in self.segments:
                rows.extend(range(s.start, s.end))
                slots.extend([s.slot] * (s.end - s.start))
                scales.extend([s.scaling] * (s.end - s.start))
            self.gather = GatherPlan(
                rows=torch.tensor(rows, device=device), slots=torch.tensor(slots, device=device),
                scales=torch.tensor(scales, device=device).unsqueeze(1), rank=max(s.rank for s in self.segments))


class LoRALinear(nn.Module):
    """``base(x) + scale[s] * (x @ A[s, :r].T) @ Bt[s, :r]`` for each token's slot ``s``."""

    def __init__(self, base: nn.Linear, a_buffer: torch.Tensor, bt_buffer: torch.Tensor, context: LoRABatchContext):
        super().__init__()
        self.base = base
        self.a_buffer = a_buffer    # [slots, max_rank, in]: a view into the pool
        self.bt_buffer = bt_buffer  # [slots, max_rank, out]
        self.context = context

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        segments = self.context.segments
        if not segments:
            return out
        flat_x = x.reshape(-1, x.shape[-1])
        flat_out = out.view(-1, out.shape[-1])
        plan = self.context.gather
        if plan is not None:
            xs = flat_x.index_select(0, plan.rows).unsqueeze(-1)                 # [t, in, 1]
            a = self.a_buffer[:, : plan.rank].index_select(0, plan.slots)       # [t, r, in]
            shrink = torch.bmm(a, xs).squeeze(-1) * plan.scales.to(xs.dtype)    # [t, r]
            bt = self.bt_buffer[:, : plan.rank].index_select(0, plan.slots)     # [t, r, out]
            flat_out.index_add_(0, plan.rows, torch.bmm(shrink.unsqueeze(1), bt).squeeze(1))
            return out
        for seg in segments:
            shrink = flat_x[seg.start:seg.end] @ self.a_buffer[seg.slot, : seg.rank].t()
            flat_out[seg.start:seg.end].addmm_(shrink, self.bt_buffer[seg.slot, : seg.rank], alpha=seg.scaling)
        return out


def attach_lora(model: nn.Module, pool: LoRAMemoryPool, context: LoRABatchContext) -> list[LoRALinear]:
    """Wrap every target ``nn.Linear`` of every decoder layer with a ``LoRALinear`` in place."""
    wrapped = []
    layers = model.model.layers
    for layer_idx, layer in enumerate(layers):
        for parent_name in ("self_attn", "mlp"):
            parent = getattr(layer, parent_name)
            for module_name in pool.shape.modules:
                base = getattr(parent, module_name, None)
                if not isinstance(base, nn.Linear):
                    continue
                lora = LoRALinear(
                    base,
                    pool.a_buffers[module_name][layer_idx],
                    pool.bt_buffers[module_name][layer_idx],
                    context,
                )
                setattr(parent, module_name, lora)
                wrapped.append(lora)
    return wrapped

"""LoRA-aware linear layers that read the pool's slot buffers.

The engine lays out each step's tokens grouped by slot, so one batch-wide list of
``(slot, start, end, rank)`` segments serves every layer: per segment, one matmul pair on
a contiguous slice (Punica/S-LoRA's SGMV idea with the gather done once, by layout).
Work is rank-bounded (a rank-8 adapter in a rank-64 pool multiplies by 8 rows), and a
batch with no adapter tokens does no LoRA work at all.

On CUDA, a step with several adapters takes the segmented Triton kernels instead
(``engine.lora_triton``): one shrink and one expand launch per module for all adapters,
each adapter's weights read once per tile of its tokens, so the number of kernels does not
grow with the number of adapters. On the CPU the segment loop is the default (the kernels
run there only under Triton's interpreter, in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pool.memory_pool import LoRAMemoryPool

from .cpu_gemm import Linear, module_linear, project
from .lora_padded import PaddedSegments, RunViews, add_padded

if TYPE_CHECKING:
    from .lora_plan import SegmentPlan


@dataclass
class LoRASegment:
    slot: int
    start: int
    end: int
    rank: int
    scaling: float


@dataclass
class LoRABatchContext:
    """The current forward's segments; set by the engine before each forward."""

    segments: list[LoRASegment] = field(default_factory=list)
    plan: Optional["SegmentPlan"] = None  # the segments on the device, for the Triton kernels
    padded: Optional[PaddedSegments] = None  # a decode step's segments as one padded batch (no kernels)
    target_programs: int = 264  # split-K's aim for shrink programs (EngineTuning.lora_target_programs)
    base_linear: Linear = module_linear  # how a base ``nn.Linear`` runs (``engine.cpu_gemm``: oneDNN on the CPU)

    def set_segments(self, segments: list[LoRASegment], device: Optional[torch.device] = None,
                     num_tokens: Optional[int] = None, decode_on: Optional[torch.device] = None) -> None:
        """``device``: run the segmented kernels there (several adapters); None: the torch segment loop.
        ``num_tokens``: rows of the step's activations (None: the last segment's end). ``decode_on``: every
        segment is decode rows (one token per request) on that device: without the kernels they run as one
        padded ``bmm`` pair per module (``engine.lora_padded``) where their slots allow."""
        self.segments = [s for s in segments if s.rank > 0 and s.end > s.start]
        self.plan = None
        self.padded = None
        if len(self.segments) > 1 and device is not None:
            from .lora_plan import SegmentPlan

            self.plan = SegmentPlan.build(self.segments, device, num_tokens)
        elif decode_on is not None:
            self.padded = PaddedSegments.build(self.segments, decode_on)


class LoRALinear(nn.Module):
    """``base(x) + scale[s] * (x @ A[s, :r].T) @ Bt[s, :r]`` for each token's slot ``s``."""

    def __init__(self, base: nn.Linear, a_buffer: torch.Tensor, bt_buffer: torch.Tensor, context: LoRABatchContext):
        super().__init__()
        self.base = base
        self.a_buffer = a_buffer    # [slots, max_rank, in]: a view into the pool
        self.bt_buffer = bt_buffer  # [slots, max_rank, out]
        self.context = context
        self.padded_views = RunViews()  # the padded path's A/Bt views of the step's slots, kept between steps

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.context.base_linear(self.base, x)
        plan = self.context.plan  # before the segments: a captured decode graph's fixed plan has no host segments
        if plan is None and not self.context.segments:
            return out
        flat_x = x.reshape(-1, x.shape[-1])
        flat_out = out.view(-1, out.shape[-1])
        if plan is not None:
            from . import lora_triton  # read at call time: the tests reload it under the interpreter

            lora_triton.add_lora(flat_x, self.a_buffer, self.bt_buffer, plan, flat_out, self.context.target_programs)
            return out
        segments = self.context.segments
        if self.context.padded is not None:
            add_padded(flat_x, self.a_buffer, self.bt_buffer, self.context.padded, flat_out, self.padded_views)
            return out
        add_segment_loop(flat_x, self.a_buffer, self.bt_buffer, segments, flat_out)
        return out


def add_segment_loop(x: torch.Tensor, a_buffer: torch.Tensor, bt_buffer: torch.Tensor,
                     segments: list[LoRASegment], out: torch.Tensor) -> None:
    """The plain torch path: one matmul pair per segment (the reference every fast path is checked against)."""
    for seg in segments:
        shrink = x[seg.start:seg.end] @ a_buffer[seg.slot, : seg.rank].t()
        out[seg.start:seg.end].addmm_(shrink, bt_buffer[seg.slot, : seg.rank], alpha=seg.scaling)


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # projections of one input


def kernel_groups(targeted) -> list[tuple[str, ...]]:
    """The projection groups the kernels run as one launch pair: q/k/v and gate/up when all are targeted (the
    runner fuses them, ``fused_projections``), every other targeted module alone."""
    groups = [g for g in FUSED_GROUPS if all(m in targeted for m in g)]
    fused = {m for g in groups for m in g}
    return groups + [(m,) for m in targeted if m not in fused]


def fused_projections(modules: list[nn.Module], x: torch.Tensor, linear: Linear = module_linear) -> list[torch.Tensor]:
    """``modules`` (q/k/v, or gate/up) applied to one input, their LoRA in one kernel pair when the step runs the
    kernels (``LoRABatchContext.plan``); otherwise each module as it is (a plain ``nn.Linear`` through ``linear``)."""
    if not all(isinstance(m, LoRALinear) for m in modules) or modules[0].context.plan is None:
        return [project(m, x, linear) for m in modules]
    context = modules[0].context
    outs = [context.base_linear(m.base, x) for m in modules]
    from . import lora_triton

    flat_x = x.reshape(-1, x.shape[-1])
    lora_triton.add_lora_slices(flat_x, [m.a_buffer for m in modules], [m.bt_buffer for m in modules], context.plan,
                                [o.view(-1, o.shape[-1]) for o in outs], context.target_programs)
    return outs


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

"""A decode step's LoRA segments as one padded batch: two ``bmm``s per module instead of a matmul pair per adapter.

Why: on the CPU the segment loop (``lora_layers.add_segment_loop``) pays a few tens of microseconds of
dispatch and small-GEMM set-up per matmul, and a decode step over 8 adapters runs 2 x 8 of them in each of
its 7 x layers LoRA modules (448 on a 4-layer model) for almost no arithmetic. Measured on 2 cores, fp32,
batch 32 over 8 adapters (4 rows each), rank 16, the 28 modules of the benchmark model alone: loop 12.4 ms,
one ``bmm`` pair per module 3.3 ms; in the whole step (``benchmarks.throughput.roofline``'s) 60.8 -> 53.4 ms
over a 37.7 ms GEMM floor, logits bit-identical at those shapes (others may sum in another order: a few
ulps). A dense product against every slot's rows, masked, was no faster (11.6 ms: 8x the arithmetic).

The grouping is built once per step (``PaddedSegments.build``) and read by every LoRA layer. Each slot of a
run of consecutive pool slots gets a block of ``rows`` rows (its segment, padded); a slot in the run without
rows is a block of padding. The A/Bt buffers of the run are then views (no copy): the pool keeps the rows past
a slot's rank zero (``LoRAMemoryPool``), so padding every segment to the largest rank adds exact zeros.
Only decode steps take it: their segments are a few rows each, so padding wastes little; a prefill segment's
matmuls are large enough that the loop's overhead does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# a run of slots may hold at most this many times the slots that have rows (padding blocks cost arithmetic)
MAX_SLOT_RUN_FACTOR = 2


@dataclass(frozen=True)
class PaddedSegments:
    """A decode step's segments over ``num_slots`` consecutive pool slots from ``first_slot``, ``rows`` rows each."""

    first_slot: int
    num_slots: int
    rows: int
    rank: int                         # the largest segment rank: the buffers' rows read
    first_row: int                    # tiled: the first activation row of the blocks
    gather: Optional[torch.Tensor]    # [num_slots * rows] activation row of each padded row; None: tiled
    row_scale: Optional[torch.Tensor]  # [num_slots, rows, 1] each row's scale, 0 on padding; None: ``scale``
    scale: float

    @classmethod
    def build(cls, segments: Sequence, device: torch.device) -> Optional["PaddedSegments"]:
        """From the step's ``LoRASegment``s (ordered by slot, rank > 0); None when fewer than two or when their
        slots spread over a run more than ``MAX_SLOT_RUN_FACTOR`` times their number (the loop is cheaper)."""
        if len(segments) < 2:
            return None
        first, last = segments[0].slot, segments[-1].slot
        num_slots = last - first + 1
        if any(b.slot <= a.slot for a, b in zip(segments, segments[1:])) or num_slots > MAX_SLOT_RUN_FACTOR * len(segments):
            return None
        rows = max(s.end - s.start for s in segments)
        rank = max(s.rank for s in segments)
        scales = {s.scaling for s in segments}
        uniform = len(scales) == 1
        tiled = uniform and num_slots == len(segments) and all(
            s.end - s.start == rows and s.start == segments[0].start + i * rows for i, s in enumerate(segments))
        if tiled:  # the step's rows already are the blocks, in order: views, no gather
            return cls(first, num_slots, rows, rank, segments[0].start, None, None, scales.pop())
        gather = [0] * (num_slots * rows)   # padding rows read row 0 and are scaled by 0
        row_scale = [0.0] * (num_slots * rows)
        for s in segments:
            at = (s.slot - first) * rows
            gather[at:at + s.end - s.start] = range(s.start, s.end)
            row_scale[at:at + s.end - s.start] = [s.scaling] * (s.end - s.start)
        return cls(first, num_slots, rows, rank, 0, torch.tensor(gather, device=device),
                   torch.tensor(row_scale, device=device).view(num_slots, rows, 1), 1.0)


class RunViews:
    """The A/Bt views one module reads for a step's run of slots, kept from step to step: a decode batch usually
    keeps its slots, and the pool's buffers never move (loads copy into them), so the views stay valid. Saves a
    module four slicing ops a step (28 modules: ~110 ops of the step's ~1,000)."""

    __slots__ = ("key", "a_t", "bt")

    def __init__(self):
        self.key: Optional[tuple[int, int, int]] = None

    def get(self, a_buffer: torch.Tensor, bt_buffer: torch.Tensor, padded: PaddedSegments) -> tuple:
        """``(A[run, :rank].T, Bt[run, :rank])`` of ``padded``'s run of slots."""
        key = (padded.first_slot, padded.num_slots, padded.rank)
        if key != self.key:
            run = slice(padded.first_slot, padded.first_slot + padded.num_slots)
            self.key, self.a_t, self.bt = key, a_buffer[run, :padded.rank].transpose(1, 2), bt_buffer[run, :padded.rank]
        return self.a_t, self.bt


def add_padded(x: torch.Tensor, a_buffer: torch.Tensor, bt_buffer: torch.Tensor, padded: PaddedSegments,
               out: torch.Tensor, views: Optional[RunViews] = None) -> None:
    """``out += scale * (x @ A.T) @ Bt`` for every row's slot, as one shrink and one expand ``bmm``; ``views``: the
    module's kept views (None: sliced here)."""
    a_t, bt = (views or RunViews()).get(a_buffer, bt_buffer, padded)
    blocks = (padded.num_slots, padded.rows)
    if padded.gather is None:
        rows = slice(padded.first_row, padded.first_row + padded.num_slots * padded.rows)
        shrink = torch.bmm(x[rows].reshape(*blocks, -1), a_t)
        out[rows].view(*blocks, -1).baddbmm_(shrink, bt, alpha=padded.scale)
        return
    shrink = torch.bmm(x.index_select(0, padded.gather).view(*blocks, -1), a_t)
    shrink.mul_(padded.row_scale)  # padding rows become exact zeros: they add 0 to row 0
    out.index_add_(0, padded.gather, torch.bmm(shrink, bt).view(-1, out.shape[-1]))

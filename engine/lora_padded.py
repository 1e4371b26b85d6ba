"""A decode step's LoRA segments as one padded batch: two ``bmm``s per module instead of a matmul pair per adapter.

Why: on the CPU the segment loop (``lora_layers.add_segment_loop``) pays a few tens of microseconds of
dispatch and small-GEMM set-up per matmul, and a decode step over 8 adapters runs 2 x 8 of them in each of
its 7 x layers LoRA modules (448 on a 4-layer model) for almost no arithmetic. Measured on 2 cores, fp32,
batch 32 over 8 adapters (4 rows each), rank 16, the 28 modules of the benchmark model alone: loop 12.4 ms,
one ``bmm`` pair per module 3.3 ms; in the whole step (``benchmarks.throughput.roofline``'s) 60.8 -> 53.4 ms
over a 37.7 ms GEMM floor, logits bit-identical at those shapes (others may sum in another order: a few
ulps). A dense product against every slot's rows, masked, was no faster (11.6 ms: 8x the arithmetic).

The grouping is built once per step (``PaddedSegments.build``) and read by every LoRA layer. Where the
segments make at most ``MAX_TILES`` tiles (runs of consecutive slots whose equal segments lie back to back), each
tile's rows of x and out already are its blocks: one ``bmm`` pair per tile on views. Otherwise each slot of a
run of consecutive pool slots gets a block of ``rows`` rows (its segment, gathered and padded); a slot in the run
without rows is a block of padding. The A/Bt buffers of a run are views either way (no copy): the pool keeps the
rows past a slot's rank zero (``LoRAMemoryPool``), so padding every segment to the largest rank adds exact zeros.
Only decode steps take it: their segments are a few rows each, so padding wastes little; a prefill segment's
matmuls are large enough that the loop's overhead does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .host_copy import to_device

# a run of slots may hold at most this many times the slots that have rows (padding blocks cost arithmetic)
MAX_SLOT_RUN_FACTOR = 2
# at most this many tiles run as views; more take the gather path. Measured (2 cores, fp32, the 28 modules of the
# benchmark model, batch 32 over 8 rank-16 adapters): one tile 2.65 ms, two 2.82-3.04, four 4.09, eight 8.40; the
# gather path 3.95-4.39 ms whatever the slots
MAX_TILES = 2


@dataclass(frozen=True)
class Tile:
    """``num_slots`` consecutive pool slots from ``first_slot`` whose segments lie back to back from activation row
    ``first_row``, ``rows`` rows each, with one scale: x's rows are already the bmm's blocks (views, no copy)."""

    first_slot: int
    num_slots: int
    rows: int
    first_row: int
    scale: float


@dataclass(frozen=True)
class PaddedSegments:
    """A decode step's segments: as ``tiles`` (views of x and out), else gathered into ``num_slots`` blocks of
    ``rows`` rows over the consecutive pool slots from ``first_slot``."""

    first_slot: int
    num_slots: int
    rows: int
    rank: int                         # the largest segment rank: the buffers' rows read
    tiles: tuple[Tile, ...]           # empty: the gather path
    gather: Optional[torch.Tensor]    # [num_slots * rows] activation row of each padded row; None: tiles
    row_scale: Optional[torch.Tensor]  # [num_slots, rows, 1] each row's scale, 0 on padding; None: tiles

    @classmethod
    def build(cls, segments: Sequence, device: torch.device) -> Optional["PaddedSegments"]:
        """From the step's ``LoRASegment``s (ordered by slot, rank > 0); None when fewer than two, or when they
        make more than ``MAX_TILES`` tiles and their slots spread over a run more than ``MAX_SLOT_RUN_FACTOR`` times
        their number (the loop is cheaper)."""
        if len(segments) < 2 or any(b.slot <= a.slot for a, b in zip(segments, segments[1:])):
            return None
        first, last = segments[0].slot, segments[-1].slot
        num_slots = last - first + 1
        rows = max(s.end - s.start for s in segments)
        rank = max(s.rank for s in segments)
        tiles = tile(segments)
        if len(tiles) <= MAX_TILES:
            return cls(first, num_slots, rows, rank, tiles, None, None)
        if num_slots > MAX_SLOT_RUN_FACTOR * len(segments):
            return None
        gather = [0] * (num_slots * rows)   # padding rows read row 0 and are scaled by 0
        row_scale = [0.0] * (num_slots * rows)
        for s in segments:
            at = (s.slot - first) * rows
            gather[at:at + s.end - s.start] = range(s.start, s.end)
            row_scale[at:at + s.end - s.start] = [s.scaling] * (s.end - s.start)
        return cls(first, num_slots, rows, rank, (), to_device(torch.tensor(gather), device),
                   to_device(torch.tensor(row_scale), device).view(num_slots, rows, 1))


def tile(segments: Sequence) -> tuple[Tile, ...]:
    """The fewest ``Tile``s that cover ``segments`` (in slot order): a segment joins the previous one's tile when its
    slot and first row follow on, with as many rows and the same scale. Why several: a slot between the step's
    adapters (the base model's, one no request of the step uses) split them, and the gather path cost the benchmark's
    decode step ~1.3 ms more than its views over the 28 modules."""
    tiles: list[Tile] = []
    for s in segments:
        n = s.end - s.start
        if tiles:
            t = tiles[-1]
            if (s.slot == t.first_slot + t.num_slots and s.start == t.first_row + t.num_slots * t.rows and n == t.rows
                    and s.scaling == t.scale):
                tiles[-1] = Tile(t.first_slot, t.num_slots + 1, t.rows, t.first_row, t.scale)
                continue
        tiles.append(Tile(s.slot, 1, n, s.start, s.scaling))
    return tuple(tiles)


class RunViews:
    """The A/Bt views one module reads for a step's runs of slots, kept from step to step: a decode batch usually
    keeps its slots, and the pool's buffers never move (loads copy into them), so the views stay valid. Saves a
    module four slicing ops per run a step (28 modules: ~110 ops of the step's ~1,000)."""

    __slots__ = ("views",)

    def __init__(self):
        self.views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, a_buffer: torch.Tensor, bt_buffer: torch.Tensor, first_slot: int, num_slots: int,
            rank: int) -> tuple:
        """``(A[run, :rank].T, Bt[run, :rank])`` of the ``num_slots`` slots from ``first_slot``."""
        key = (first_slot, num_slots, rank)
        got = self.views.get(key)
        if got is None:
            if len(self.views) >= 2 * MAX_TILES:  # the step's runs changed: drop the oldest
                del self.views[next(iter(self.views))]
            run = slice(first_slot, first_slot + num_slots)
            got = self.views[key] = (a_buffer[run, :rank].transpose(1, 2), bt_buffer[run, :rank])
        return got


def add_padded(x: torch.Tensor, a_buffer: torch.Tensor, bt_buffer: torch.Tensor, padded: PaddedSegments,
               out: torch.Tensor, views: Optional[RunViews] = None) -> None:
    """``out += scale * (x @ A.T) @ Bt`` for every row's slot, as one shrink and one expand ``bmm`` per tile (or one
    pair over the gathered rows); ``views``: the module's kept views (None: sliced here)."""
    views = views or RunViews()
    for t in padded.tiles:
        a_t, bt = views.get(a_buffer, bt_buffer, t.first_slot, t.num_slots, padded.rank)
        rows = slice(t.first_row, t.first_row + t.num_slots * t.rows)
        shrink = torch.bmm(x[rows].reshape(t.num_slots, t.rows, -1), a_t)
        out[rows].view(t.num_slots, t.rows, -1).baddbmm_(shrink, bt, alpha=t.scale)
    if padded.gather is None:
        return
    a_t, bt = views.get(a_buffer, bt_buffer, padded.first_slot, padded.num_slots, padded.rank)
    shrink = torch.bmm(x.index_select(0, padded.gather).view(padded.num_slots, padded.rows, -1), a_t)
    shrink.mul_(padded.row_scale)  # padding rows become exact zeros: they add 0 to row 0
    out.index_add_(0, padded.gather, torch.bmm(shrink, bt).view(-1, out.shape[-1]))

"""A step's LoRA segments as device arrays: what the segmented kernels read (``engine.lora_triton``).

Built once per step from the host's segment list in one host-to-device copy and read by
every LoRA layer of the step. Kept free of Triton so the engine can build and hold it on
machines where Triton is missing (the kernels then never run; see ``engine.fast_paths``).

Each field starts on a 16-byte boundary of the packed buffer: Triton compiles a kernel
once per pointer-alignment class, so a field whose offset depended on the number of
segments would compile a new variant mid-serving whenever that number changed parity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .host_copy import to_device

FIELD_ALIGN = 4  # int32 elements per 16 bytes: every field of the packed buffer starts aligned


@dataclass
class SegmentPlan:
    """A step's segments on the device, plus the host-side sizes the launch grid needs."""

    starts: torch.Tensor   # int32 [segments]: first token row
    lengths: torch.Tensor  # int32 [segments]
    slots: torch.Tensor    # int32 [segments]: pool slot
    ranks: torch.Tensor    # int32 [segments]
    scales: torch.Tensor   # float32 [segments]
    max_length: int        # the longest segment (grid size along tokens)
    max_rank: int          # the largest rank (the shrink output's width)
    num_tokens: int        # rows of the step's activations (the kernels' intermediate buffers)
    packed: Optional[torch.Tensor] = None  # int32 [5, width]: the fields' storage (``fixed`` plans refill it)

    @property
    def num_segments(self) -> int:
        return int(self.starts.shape[0])

    @classmethod
    def build(cls, segments, device: torch.device, num_tokens: int | None = None) -> "SegmentPlan":
        """From ``LoRASegment``s (host), in one host-to-device copy. ``num_tokens``: the activations' rows
        (None: the end of the last segment)."""
        n = len(segments)
        width = -(-n // FIELD_ALIGN) * FIELD_ALIGN
        packed = to_device(_host_fields(segments, width), device)  # one copy (pinned); the scales keep their bits
        rows = max(s.end for s in segments) if num_tokens is None else num_tokens
        return cls(packed[0, :n], packed[1, :n], packed[2, :n], packed[3, :n], packed[4, :n].view(torch.float32),
                   max(s.end - s.start for s in segments), max(s.rank for s in segments), rows)

    @classmethod
    def fixed(cls, width: int, num_tokens: int, max_rank: int, device: torch.device) -> "SegmentPlan":
        """A plan of ``width`` segments at a fixed address, all empty until ``refill``: what a captured decode graph
        reads (``engine.decode_graphs``). Its grid is fixed (``width`` segments, ``num_tokens`` rows each at most,
        ``max_rank``'s ``BLOCK_R``), and a segment of length 0 launches programs that return at once."""
        aligned = -(-width // FIELD_ALIGN) * FIELD_ALIGN
        packed = torch.zeros(5, aligned, dtype=torch.int32, device=device)
        return cls(packed[0, :width], packed[1, :width], packed[2, :width], packed[3, :width],
                   packed[4, :width].view(torch.float32), num_tokens, max_rank, num_tokens, packed)

    def refill(self, segments) -> None:
        """This ``fixed`` plan's segments become ``segments`` (the rest empty), in one copy to the same address."""
        if self.packed is None:
            raise ValueError("only a fixed plan is refilled: build() makes a new one each step")
        width = self.packed.shape[1]
        if len(segments) > self.num_segments:
            raise ValueError(f"{len(segments)} segments: this plan holds {self.num_segments}")
        if any(s.end - s.start > self.max_length or s.rank > self.max_rank for s in segments):
            raise ValueError(f"a segment exceeds this plan's {self.max_length} rows or rank {self.max_rank}")
        host = _host_fields(segments, width)
        if self.packed.device.type == "cuda":
            host = host.pin_memory()  # torch's pinned allocator keeps it until the copy is done
        self.packed.copy_(host, non_blocking=True)


def _host_fields(segments, width: int) -> torch.Tensor:
    """int32 [5, width]: starts, lengths, slots, ranks and the scales' bits; zeros past the segments."""
    n = len(segments)
    packed = torch.zeros(5, width, dtype=torch.int32)
    if n:
        packed[0, :n] = torch.tensor([s.start for s in segments], dtype=torch.int32)
        packed[1, :n] = torch.tensor([s.end - s.start for s in segments], dtype=torch.int32)
        packed[2, :n] = torch.tensor([s.slot for s in segments], dtype=torch.int32)
        packed[3, :n] = torch.tensor([s.rank for s in segments], dtype=torch.int32)
        packed[4, :n] = torch.tensor([s.scaling for s in segments], dtype=torch.float32).view(torch.int32)
    return packed
